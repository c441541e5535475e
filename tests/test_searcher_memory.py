"""The searcher's memory: loaded segments are accounted in bytes, released once no served version uses them,
and kept under SHOAL_SEARCHER_CACHE_BYTES by unloading the least recently searched indexes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.errors import CapacityError
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec

DIM = 16


def _index(shoal: Shoal, name: str, n: int, seed: int) -> np.ndarray:
    """A data source and flat index `name` with n random points, materialized; returns the vectors."""
    shoal.create_data_source(DataSourceSpec(name, "1", DIM, {"id": "int64"}, ["id"]))
    index = shoal.create_index(IndexSpec(f"{name}.Index", "1", name, "1", algorithm="FaissIndex.L2"))
    vectors = np.random.default_rng(seed).normal(size=(n, DIM)).astype(np.float32)
    shoal.producer(name, "1").upload_columns(vectors, {"id": np.arange(n)})
    for shard in index.shards:
        ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)
    return vectors


def _nearest(shoal_searcher: object, name: str, query: np.ndarray) -> int:
    hits = shoal_searcher.search(f"{name}.Index", "1", query[None], 1)  # type: ignore[attr-defined]
    return int(hits[0].column("id")[0])


def _one_index_bytes(settings: Settings) -> tuple[int, np.ndarray, np.ndarray]:
    """Indexes A and B (2,000 points each) made under `settings`; the bytes one of them takes loaded."""
    with Shoal(settings, notify=False) as probe:
        a = _index(probe, "A", 2000, 2)
        b = _index(probe, "B", 2000, 3)
        searcher = probe.searcher(follow=False)
        _nearest(searcher, "A", a[0])
        one_index = probe.runtime.segment_cache.bytes
        searcher.close()
    return one_index, a, b


def test_superseded_segments_are_released(make_settings: Callable[..., Settings]) -> None:
    with Shoal(make_settings("local"), notify=False) as shoal:
        vectors = _index(shoal, "Mem", 500, 1)
        searcher = shoal.searcher(follow=False)
        cache = shoal.runtime.segment_cache
        try:
            assert _nearest(searcher, "Mem", vectors[7]) == 7
            first = cache.bytes
            assert first > vectors.nbytes and len(cache) == 1
            # Three more versions, then a merge into one segment: what the searcher held before is superseded.
            producer = shoal.producer("Mem", "1")
            shard_id = shoal.get_index("Mem.Index", "1").shards[0].id
            builder = ShardBuilder(shoal.engine, shoal.storage)
            for i in range(3):
                producer.upload_columns(vectors[:100] + 10.0 * (i + 1), {"id": np.arange(100)})
                builder.materialize(shard_id)
                searcher.refresh()
                assert len(cache) == i + 2  # the new segment beside the old ones, which the version still uses
            builder.merge(shard_id, force=True)
            searcher.refresh()
            assert len(cache) == 1, "segments no served version uses must be released"
            assert cache.bytes < first + vectors.nbytes  # one merged segment of the same 500 rows, not four
            assert _nearest(searcher, "Mem", vectors[300]) == 300
        finally:
            searcher.close()
        assert len(cache) == 0 and cache.bytes == 0  # a closed searcher holds nothing


def test_budget_unloads_least_recently_searched(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings("local")
    one_index, a, b = _one_index_bytes(settings)
    # Room for one of the two indexes, not both.
    budget = int(one_index * 1.5)
    with Shoal(settings.model_copy(update={"searcher_cache_bytes": budget}), notify=False) as shoal:
        searcher = shoal.searcher(follow=False)
        cache = shoal.runtime.segment_cache
        try:
            assert _nearest(searcher, "A", a[5]) == 5
            assert searcher.loaded("A.Index", "1")
            assert _nearest(searcher, "B", b[6]) == 6
            assert searcher.loaded("B.Index", "1") and not searcher.loaded("A.Index", "1")
            assert cache.bytes <= budget
            assert _nearest(searcher, "A", a[9]) == 9  # loaded again on demand, B unloaded in turn
            assert not searcher.loaded("B.Index", "1") and cache.bytes <= budget
        finally:
            searcher.close()
    # An index that alone passes the budget is refused with an error naming the setting, not served over it.
    with Shoal(settings.model_copy(update={"searcher_cache_bytes": one_index // 2}), notify=False) as shoal:
        searcher = shoal.searcher(follow=False)
        try:
            with pytest.raises(CapacityError, match="SHOAL_SEARCHER_CACHE_BYTES"):
                searcher.search("A.Index", "1", a[:1], 1)
            assert shoal.runtime.segment_cache.bytes == 0
        finally:
            searcher.close()


def test_the_budget_is_the_process_s_across_searchers(make_settings: Callable[..., Settings]) -> None:
    """Two searchers of one runtime (`Shoal.searcher()` makes a service each) share its budget: loading an
    index in one unloads the least recently searched index of the other, rather than refusing an index that
    fits (it was refused, and the error counted the other searcher's bytes as its need)."""
    settings = make_settings("local")
    one_index, a, b = _one_index_bytes(settings)
    budget = int(one_index * 1.5)
    with Shoal(settings.model_copy(update={"searcher_cache_bytes": budget}), notify=False) as shoal:
        first, second = shoal.searcher(follow=False), shoal.searcher(follow=False)
        cache = shoal.runtime.segment_cache
        try:
            assert _nearest(first, "A", a[5]) == 5
            assert _nearest(second, "B", b[6]) == 6  # fits once the first searcher's A goes
            assert second.loaded("B.Index", "1") and not first.loaded("A.Index", "1")
            assert cache.bytes <= budget
            assert _nearest(first, "A", a[9]) == 9  # loaded again on demand; the second's B goes in turn
            assert not second.loaded("B.Index", "1") and cache.bytes <= budget
        finally:
            first.close()
            second.close()
    # Too large alone: the error names the index's own size, not what other searchers hold.
    with Shoal(settings.model_copy(update={"searcher_cache_bytes": one_index // 2}), notify=False) as shoal:
        first, second = shoal.searcher(follow=False), shoal.searcher(follow=False)
        try:
            with pytest.raises(CapacityError, match=f"needs about {one_index:,} bytes"):
                second.search("A.Index", "1", a[:1], 1)
        finally:
            first.close()
            second.close()


def test_a_refresh_does_not_reload_what_the_budget_unloaded(make_settings: Callable[..., Settings]) -> None:
    """An index the budget unloads during a refresh (a poll, an announcement) stays unloaded until searched: the
    refresh went on to load it again, as it was on its list, unloading a more recently searched index instead."""
    settings = make_settings("local")
    one_index, a, b = _one_index_bytes(settings)
    with Shoal(settings, notify=False) as shoal:
        c = _index(shoal, "C", 2000, 4)
    with Shoal(settings.model_copy(update={"searcher_cache_bytes": int(one_index * 3.5)}), notify=False) as shoal:
        searcher = shoal.searcher(follow=False)
        try:
            assert _nearest(searcher, "A", a[5]) == 5
            assert _nearest(searcher, "B", b[6]) == 6
            assert _nearest(searcher, "C", c[7]) == 7
            assert _nearest(searcher, "A", a[8]) == 8 and _nearest(searcher, "B", b[9]) == 9  # C: least recent
            # B doubles: its new version leaves room for A and B only.
            shoal.producer("B", "1").upload_columns(b + 100.0, {"id": np.arange(2000, 4000)})
            for shard in shoal.get_index("B.Index", "1").shards:
                ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)
            searcher.refresh()
            loaded = [n for n in "ABC" if searcher.loaded(f"{n}.Index", "1")]
            assert loaded == ["A", "B"], loaded
            assert shoal.runtime.segment_cache.bytes <= int(one_index * 3.5)
        finally:
            searcher.close()


def test_an_unloaded_index_keeps_no_young_tier(make_settings: Callable[..., Settings]) -> None:
    """A young tier read for an index the budget unloaded meanwhile (a strong search or the follower in flight
    while another search evicts it) is not kept: it would pin the index's segments outside the budget until the
    index is searched again. (The race is made here by extending the tail of a view the service no longer
    serves, as the in-flight search does.)"""
    settings = make_settings("local")
    one_index, a, b = _one_index_bytes(settings)
    with Shoal(settings.model_copy(update={"searcher_cache_bytes": int(one_index * 1.5)}), notify=False) as shoal:
        shoal.producer("A", "1").upload_columns(a[:50] + 1.0, {"id": np.arange(50)})  # a tail past A's version
        head = shoal.get_data_source("A", "1").head_seq
        searcher = shoal.searcher(follow=False)
        service = searcher.service
        try:
            view = searcher.view("A.Index", "1")
            assert _nearest(searcher, "B", b[6]) == 6  # unloads A
            assert not searcher.loaded("A.Index", "1")
            made = service._extend(view, head)  # the in-flight search's extension, finishing now
            assert made.end == head  # that search still gets its tail ...
            assert view.index.id not in service._tails  # ... but the service keeps none for an unloaded index
        finally:
            searcher.close()


def test_a_huge_k_over_a_small_young_tier_takes_no_memory_for_k(make_settings: Callable[..., Settings]) -> None:
    """A k far past every row (a caller may send any k: only rows count toward SHOAL_MAX_SEARCH_HITS) over rows
    not built yet, in two splits, answers those rows without arrays k wide: a k of ten million took 1.6 GB."""
    import tracemalloc

    from shoal.searcher.consistency import Consistency

    with Shoal(make_settings("local"), notify=False) as shoal:
        shoal.create_data_source(DataSourceSpec("Big", "1", 2, {"id": "int64", "cat": "string"}, ["id", "cat"]))
        shoal.create_index(IndexSpec("Big.Index", "1", "Big", "1", algorithm="flat", metric="euclidean",
                                     id_attributes=["id"], split_attributes=["cat"]))
        shoal.producer("Big", "1").upload_columns(np.array([[0, 0], [3, 4]], np.float32),
                                                  {"id": np.arange(2), "cat": ["a", "b"]})
        searcher = shoal.searcher(follow=False)
        try:
            tracemalloc.start()
            hits = searcher.search("Big.Index", "1", [[0.0, 0.0]], 10**7, consistency=Consistency.strong())[0]
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert [(h.attributes["id"], h.distance) for h in hits] == [(0, 0.0), (1, 5.0)]
            assert peak < 20 << 20, f"{peak:,} bytes at the peak"
        finally:
            searcher.close()


def test_searches_of_tags_keep_the_cache_within_its_budget(make_settings: Callable[..., Settings]) -> None:
    """Each tag (an older version, a segment of its own) loaded into the shared cache and stayed: searches of
    ten tags held ten versions' segments, past SHOAL_SEARCHER_CACHE_BYTES, until the next load of a current
    version. They stay only while they fit."""
    settings = make_settings("local")
    with Shoal(settings, notify=False) as probe:
        vectors = _index(probe, "T", 500, 4)
        searcher = probe.searcher(follow=False)
        _nearest(searcher, "T", vectors[0])
        one_version = probe.runtime.segment_cache.bytes
        searcher.close()
    budget = int(one_version * 3.5)
    with Shoal(settings.model_copy(update={"searcher_cache_bytes": budget}), notify=False) as shoal:
        producer, builder = shoal.producer("T", "1"), ShardBuilder(shoal.engine, shoal.storage)
        shard = shoal.get_index("T.Index", "1").shards[0].id
        for i in range(10):  # ten versions, each one merged segment of its own (no segment shared), each tagged
            producer.upload_columns(vectors[:50] + float(i + 1), {"id": np.arange(1000 + 50 * i, 1050 + 50 * i)})
            builder.materialize(shard)
            builder.merge(shard, force=True)
            shoal.tag_index("T.Index", "1", f"t{i}")
        searcher = shoal.searcher(follow=False)
        try:
            for i in range(10):
                hits = searcher.search("T.Index", "1", vectors[7:8], 1, tag=f"t{i}")
                assert int(hits[0].column("id")[0]) == 7
                assert shoal.runtime.segment_cache.bytes <= budget, (i, shoal.runtime.segment_cache.bytes, budget)
        finally:
            searcher.close()


def test_a_filters_cache_key_is_small_however_long_the_filter() -> None:
    """The mask caches and the per-index filter cache were keyed by the filter's whole text: 1,200 distinct
    200 KB filters grew a `shoal api` by 220 MB past the caches' byte budgets, which counted only the masks.
    Keys are a fixed-size digest now: equal filters, equal keys; others, other keys."""
    from shoal.log.records import AttributeType
    from shoal.searcher.filters import parse_filter

    types = {"tag": AttributeType.STRING}
    big = {"tag": {"$in": [f"value-{i:06d}" for i in range(10_000)]}}
    other = {"tag": {"$in": [f"value-{i:06d}" for i in range(1, 10_001)]}}
    first, again, second = (parse_filter(f, types) for f in (big, dict(big), other))
    assert first is not None and again is not None and second is not None
    assert len(first.key) == 32 and first.key == again.key != second.key
