"""A merge never blocks materialization of new data for its shard (issue 14): the merged segment is built
without the shard's lease; only its publish takes it, carrying over what a materialization published in
between (new segments, rows of the merged segments deleted or updated since). And quickly built segments
(ingest outrunning the builds) are rebuilt at the index's own parameters once the backlog is gone."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from shoal import DataSourceSpec, Shoal
from shoal.catalog.indexes import ShardCatalog
from shoal.config.settings import Settings
from shoal.index.builder import BuildResult, MergePolicy, ShardBuilder
from shoal.index.manifest import Manifest
from shoal.index.segment import load_segment
from shoal.log.records import IndexSpec

DIM = 32


def _vectors(ids: np.ndarray, salt: int = 0) -> np.ndarray:
    v = np.stack([np.random.default_rng(int(i) * 7 + salt).standard_normal(DIM) for i in ids]).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _segments(shoal: Shoal, shard_id: int) -> Manifest:
    active = ShardCatalog(shoal.engine).active_version(shard_id)
    assert active is not None
    return Manifest.of(active.manifest)


def _setup(settings: Settings, tag: str) -> tuple[Shoal, str, int, Callable[..., int]]:
    shoal = Shoal(settings, notify=False)
    source = DataSourceSpec(f"merge-{tag}", "1", DIM, {"id": "int64"}, ["id"])
    shoal.create_data_source(source)
    index = f"merge-{tag}-idx"
    shoal.create_index(IndexSpec(index, "1", source.name, "1", algorithm="hnsw", metric="euclidean",
                                 params={"M": 16, "ef_construction": 200, "ef_search": 200}))
    producer = shoal.producer(source.name, "1")

    def upload(ids: np.ndarray, salt: int = 0) -> int:
        return producer.upload_columns(_vectors(ids, salt), {"id": ids.astype(np.int64)}).seq

    return shoal, index, shoal.get_index(index, "1").shards[0].id, upload


def test_materialization_goes_on_while_a_merge_builds(make_settings: Callable[..., Settings]) -> None:
    shoal, index, shard_id, upload = _setup(make_settings("local"), f"{time.monotonic_ns() % 10**9}")
    try:
        builder = ShardBuilder(shoal.engine, shoal.storage)
        for part in range(3):
            upload(np.arange(part * 15_000, (part + 1) * 15_000))
            builder.materialize(shard_id)
        assert len(_segments(shoal, shard_id).segments) == 3

        merged: list[BuildResult] = []
        errors: list[BaseException] = []

        def merge() -> None:
            try:
                merged.append(ShardBuilder(shoal.engine, shoal.storage).merge(shard_id, force=True))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        merging = threading.Thread(target=merge)
        merging.start()
        try:
            # While it builds: delete 100 merged keys, update 100 more, add 100 new ones, and materialize.
            shoal.producer(shoal.get_index(index, "1").spec.source_name, "1").delete(
                {"id": np.arange(100, dtype=np.int64)})
            upload(np.arange(100, 200), salt=1)
            head = upload(np.arange(50_000, 50_100))
            began = time.monotonic()
            result = builder.materialize(shard_id)  # no LeaseBusyError: the merge does not hold the lease
            took = time.monotonic() - began
            assert result.changed and result.watermark == head
            assert merging.is_alive(), "the merge ended before the materialization: nothing was shown"
            print(f"materialized {took:.2f} s into the merge, which was still building")
        finally:
            merging.join(300)
        assert not errors, errors
        assert merged and merged[0].changed

        manifest = _segments(shoal, shard_id)
        assert manifest.watermark == head
        live = sum(s.rows - s.deleted_count for s in manifest.segments)
        assert live == 45_000  # 100 deleted, 100 updated in place, 100 new
        searcher = shoal.searcher(follow=False)
        try:
            def nearest(vectors: np.ndarray) -> list[tuple[int, float]]:
                hits = searcher.search(index, "1", vectors, 1)
                return [(h[0].attributes["id"], h[0].distance) for h in hits]

            # Deleted keys stay deleted, updated keys answer with their new vector only, new keys are there.
            assert all(i >= 100 for i, _ in nearest(_vectors(np.arange(0, 100))))
            assert [i for i, d in nearest(_vectors(np.arange(100, 200), salt=1)) if d < 1e-4] == list(range(100, 200))
            assert not [i for i, d in nearest(_vectors(np.arange(100, 200))) if d < 1e-4]
            fresh = np.arange(50_000, 50_100)
            assert [i for i, d in nearest(_vectors(fresh)) if d < 1e-4] == fresh.tolist()
        finally:
            searcher.close()
    finally:
        shoal.close()


def test_quick_segments_under_a_backlog_are_rebuilt_once_it_is_gone(make_settings: Callable[..., Settings]) -> None:
    shoal, index, shard_id, upload = _setup(make_settings("local"), f"{time.monotonic_ns() % 10**9}")
    try:
        builder = ShardBuilder(shoal.engine, shoal.storage, quick_backlog_seqs=1_000, quick_ef_construction=16)
        upload(np.arange(0, 500))  # a small backlog: built at the index's own parameters
        builder.materialize(shard_id)
        upload(np.arange(500, 3_000))  # a backlog past the threshold: built quickly
        builder.materialize(shard_id)
        segments = _segments(shoal, shard_id).segments
        assert [s.quick for s in segments] == [False, True]
        assert builder.needs_merge(shard_id)  # no backlog now: the quick segment is due for a rebuild
        result = builder.merge(shard_id)
        assert result.changed
        segments = _segments(shoal, shard_id).segments
        assert not any(s.quick for s in segments)
        assert sum(s.rows - s.deleted_count for s in segments) == 3_000
        assert not builder.needs_merge(shard_id)
    finally:
        shoal.close()


def test_a_merge_adds_the_smaller_segments_to_the_largest(make_settings: Callable[..., Settings]) -> None:
    """Under ingest, the merged segment is the largest one's rows (dead ones kept under its deletions, same row
    numbers) followed by the others' live rows, its graph extended rather than rebuilt; at rest a merge leaves
    no dead rows. Searches see exactly the live points throughout."""
    shoal, index, shard_id, upload = _setup(make_settings("local"), f"{time.monotonic_ns() % 10**9}")
    try:
        # Busy throughout: every build has a backlog of at least one entry, and the window outlasts the test.
        builder = ShardBuilder(shoal.engine, shoal.storage, policy=MergePolicy(max_segments=1),
                               quick_backlog_seqs=1, quick_ef_construction=16, quick_window_s=3_600.0)
        upload(np.arange(0, 2_000))
        builder.materialize(shard_id)
        upload(np.arange(10, 20), salt=1)  # 10 keys of the large segment updated: its rows go dead
        builder.materialize(shard_id)
        upload(np.arange(2_000, 2_300))
        builder.materialize(shard_id)
        shoal.producer(shoal.get_index(index, "1").spec.source_name, "1").delete(
            {"id": np.array([20, 2_000], dtype=np.int64)})  # one key of the large segment, one of a small one
        builder.materialize(shard_id)
        before = _segments(shoal, shard_id).segments
        assert [s.rows for s in before] == [2_000, 10, 300]
        assert [s.deleted_count for s in before] == [11, 0, 1]
        large = load_segment(shoal.storage, before[0], shoal.get_index(index, "1").spec)

        assert builder.merge(shard_id).changed
        (merged,) = _segments(shoal, shard_id).segments
        assert merged.id not in {s.id for s in before} and merged.quick  # quick like the segment it extends
        assert merged.rows == 2_000 + 10 + 299 and merged.deleted_count == 11  # the large one's dead rows
        seg = load_segment(shoal.storage, merged, shoal.get_index(index, "1").spec)
        assert seg.keys[:2_000].tolist() == large.keys.tolist()  # its rows first, under the same numbers
        assert len(seg.splits[0].engine) == merged.rows

        def check_searches() -> None:
            searcher = shoal.searcher(follow=False)
            try:
                def own(ids: np.ndarray, salt: int = 0) -> list[int]:
                    hits = searcher.search(index, "1", _vectors(ids, salt), 1)
                    return [h[0].attributes["id"] for h in hits if h and h[0].distance < 1e-4]

                live = np.setdiff1d(np.arange(2_300), [20, 2_000])
                assert own(live[(live < 10) | (live >= 20)]) == live[(live < 10) | (live >= 20)].tolist()
                assert own(np.arange(10, 20), salt=1) == list(range(10, 20))  # updated: the new vectors
                assert own(np.arange(10, 20)) == []  # and not the old ones (dead rows in the extended graph)
                assert own(np.array([20, 2_000])) == []  # deleted
            finally:
                searcher.close()

        check_searches()
        # At rest (a builder that never finds the shard busy), the merge rebuilds: no dead rows, full quality.
        at_rest = ShardBuilder(shoal.engine, shoal.storage, policy=MergePolicy(max_segments=1))
        assert at_rest.merge(shard_id, force=False).changed
        (clean,) = _segments(shoal, shard_id).segments
        assert (clean.rows, clean.deleted_count, clean.quick) == (2_298, 0, False)
        check_searches()
    finally:
        shoal.close()


def test_a_shard_with_quick_segments_stays_busy_while_ingest_goes_on(make_settings: Callable[..., Settings]) -> None:
    """Under sustained ingest the backlog comes and goes with each build: a merge between two builds keeps the
    quick segments quick while the data source still takes enough entries per window (by the catalog's commit
    times, the same for every worker process), and rebuilds them at full quality once it takes fewer."""
    shoal, _, shard_id, upload = _setup(make_settings("local"), f"{time.monotonic_ns() % 10**9}")
    try:
        def builder(window_s: float) -> ShardBuilder:
            return ShardBuilder(shoal.engine, shoal.storage, quick_backlog_seqs=1_000, quick_ef_construction=16,
                                quick_window_s=window_s)

        upload(np.arange(0, 2_000))
        builder(3_600.0).materialize(shard_id)
        assert [s.quick for s in _segments(shoal, shard_id).segments] == [True]
        # No backlog now, but 2,000 entries within the window: busy, so the quick segment is not due.
        assert not builder(3_600.0).needs_merge(shard_id)
        upload(np.arange(2_000, 2_100))  # a build under ingest stays quick even without a backlog
        builder(3_600.0).materialize(shard_id)
        assert [s.quick for s in _segments(shoal, shard_id).segments] == [True, True]
        # Seen through a window those commits are older than, ingest has slowed: the quick segments are due.
        slowed = builder(0.001)
        assert slowed.needs_merge(shard_id)
        assert slowed.merge(shard_id).changed
        segments = _segments(shoal, shard_id).segments
        assert [s.quick for s in segments] == [False]
        assert sum(s.rows - s.deleted_count for s in segments) == 2_100
    finally:
        shoal.close()
