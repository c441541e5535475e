"""Real Celery workers against the real broker: ingest triggers materialization, searches follow, and a
worker SIGKILLed during materialization and merge, repeatedly, never leaves a broken version behind."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from conftest import kill_worker, start_worker, stop_process, wait_for
from helpers.kill_points import freeze_inside
from sqlalchemy import select
from sqlalchemy.orm import Session

from shoal import DataSourceSpec, Shoal
from shoal.catalog.models import IndexShard, IndexVersion
from shoal.engines.metrics import Metric, exact_top_k
from shoal.index.builder import shard_dir
from shoal.index.segment import ROWS_FILE, load_segment, read_deletions, segment_files
from shoal.log.records import IndexSpec
from shoal.log.validation import SEQ
from shoal.searcher.consistency import Consistency
from shoal.workers.triggers import MERGE, enqueue, producer_app

pytestmark = pytest.mark.slow  # real Celery worker processes

DIM = 16


@pytest.fixture
def wshoal(make_settings, redis_url: str, worker_catalog: str):  # type: ignore[no-untyped-def]
    """A Shoal on a catalog of its own whose settings point workers and triggers at the real broker."""
    settings = make_settings(
        "local",
        database_url=worker_catalog,
        redis_url=redis_url,
        sweep_interval_s=1.0,
        merge_interval_s=1.0,  # beat's merge sweep queues the merges the SIGKILL test interrupts
        lease_seconds=3.0,
        pending_ttl_s=2.0,
        task_visibility_timeout_s=5.0,
        max_segments=3,
    )
    client = Shoal(settings)
    yield client
    client.close()


def _source(tag: str) -> DataSourceSpec:
    return DataSourceSpec(f"w-{tag}", "1", DIM, {"id": "int64", "tag": "string"}, ["id"])


def _upload(shoal: Shoal, spec: DataSourceSpec, ids: np.ndarray, rng: np.random.Generator) -> int:
    vectors = rng.standard_normal((len(ids), DIM)).astype(np.float32)
    return shoal.producer(spec.name, "1").upload_columns(vectors, {"id": ids, "tag": [f"t{i}" for i in ids]}).seq


def _caught_up(shoal: Shoal, index: str) -> bool:
    status = shoal.index_status(index, "1")
    return all(s.built_watermark == s.head for s in status)


def _check_exact(shoal: Shoal, spec: DataSourceSpec, index: str, rng: np.random.Generator) -> None:
    folded = shoal.fold(spec.name, "1")
    vectors = np.asarray(folded["__vector"].to_pylist(), dtype=np.float32).reshape(-1, DIM)
    ids = np.asarray(folded["id"].to_pylist())
    queries = rng.standard_normal((5, DIM)).astype(np.float32)
    searcher = shoal.searcher(follow=False)
    try:
        hits = searcher.search(index, "1", queries, 10)
    finally:
        searcher.close()
    dist, labels = exact_top_k(Metric.EUCLIDEAN, queries, vectors, 10)
    for q in range(len(queries)):
        assert [h.attributes["id"] for h in hits[q]] == ids[labels[q]].tolist()
        np.testing.assert_allclose([h.distance for h in hits[q]], dist[q], rtol=1e-5)


def test_ingest_triggers_real_workers_and_searches_follow(wshoal: Shoal) -> None:
    rng = np.random.default_rng(7)
    spec = _source(uuid.uuid4().hex[:8])
    wshoal.create_data_source(spec)
    wshoal.create_index(
        IndexSpec(f"{spec.name}-idx", "1", spec.name, "1", algorithm="flat", metric="euclidean", shard_count=2)
    )
    index = f"{spec.name}-idx"
    worker = start_worker(wshoal.settings, beat=True)
    searcher = wshoal.searcher(poll_interval=0.2)
    try:
        token = _upload(wshoal, spec, np.arange(500), rng)
        wait_for(lambda: _caught_up(wshoal, index), 90, "workers to materialize the first upload")
        wait_for(
            lambda: min(searcher.served_watermarks(index, "1").values()) >= token,
            30,
            "the searcher to follow the new versions",
        )
        status = wshoal.index_status(index, "1")
        assert [s.served_watermark for s in status] == [token, token]
        assert all(s.lag_seqs == 0 for s in status)
        _check_exact(wshoal, spec, index, rng)

        # A tombstone: eventual search stops returning the point once the version with it is served.
        gone = searcher.search(index, "1", np.zeros((1, DIM), np.float32), 1)[0][0].attributes["id"]
        token = wshoal.producer(spec.name, "1").delete({"id": [gone]}).seq
        # read-your-writes: at_least(token) sees the delete at once, whatever the workers did.
        first = searcher.search(index, "1", np.zeros((1, DIM), np.float32), 1, consistency=Consistency.at_least(token))
        assert first[0][0].attributes["id"] != gone
        wait_for(lambda: min(searcher.served_watermarks(index, "1").values()) >= token, 60, "the delete to be served")
        assert searcher.search(index, "1", np.zeros((1, DIM), np.float32), 1)[0][0].attributes["id"] != gone
    finally:
        searcher.close()
        stop_process(worker)


def _verify_all_versions(shoal: Shoal, index_name: str) -> int:
    """Every version of every shard references only existing files whose checksums match."""
    index = shoal.get_index(index_name, "1")
    checked = 0
    with Session(shoal.engine) as s:
        shard_ids = [sh.id for sh in index.shards]
        versions = s.scalars(select(IndexVersion).where(IndexVersion.shard_id.in_(shard_ids))).all()
        active = set(s.scalars(select(IndexShard.active_version_id).where(IndexShard.id.in_(shard_ids))))
    for version in versions:
        for entry in version.manifest["segments"]:
            seg = load_segment(shoal.storage, entry, index.spec)  # raises on a missing or corrupt file
            assert seg.rows.num_rows == entry["rows"]
            assert len(read_deletions(shoal.storage, entry)) == (entry["deleted"] or {}).get("count", 0)
        checked += 1
    assert active - {None} <= {v.id for v in versions}
    return checked


class BuildWindow:
    """What a worker's build of one index shard has written that no version references yet, read from the
    catalog and storage only (not from Celery's log), so the test can kill the worker inside a build.

    A materialization runs under the shard's lease, writes new files (deletion files in existing segment
    folders, then a new segment folder: rows first, then the split indexes, whose build is the long part) and
    publishes a version naming them. A merge writes its segment the same way without the lease (so that
    materializations go on) and takes the lease only to publish. Files present when the window was opened (left
    by earlier kills) do not count.
    """

    def __init__(self, shoal: Shoal, index_name: str) -> None:
        self.shoal = shoal
        index = shoal.get_index(index_name, "1")
        self.shard_id = index.shards[0].id
        self.folder = shard_dir(index, index.shards[0], index.generation)
        self.before = set(shoal.storage.list_files(self.folder))
        self.owner_before = self.shard().lease_owner
        self.max_seq: dict[str, int] = {}  # rows file -> its highest seq (files never change)

    def shard(self) -> IndexShard:
        """The shard's catalog row as it is now."""
        with Session(self.shoal.engine) as s:
            shard = s.get(IndexShard, self.shard_id)
            assert shard is not None
            return shard

    def unpublished(self, *, leased: bool = True) -> tuple[set[str], int] | None:
        """(the files a running build wrote and no version names, the active watermark); with `leased`, only
        while a worker started since the window opened holds the shard's lease (None otherwise)."""
        new = set(self.shoal.storage.list_files(self.folder)) - self.before  # listed before the rows are read
        shard = self.shard()
        if leased and (shard.lease_owner is None or shard.lease_owner == self.owner_before):
            return None
        with Session(self.shoal.engine) as s:
            versions = s.scalars(select(IndexVersion).where(IndexVersion.shard_id == self.shard_id)).all()
            named = {path for v in versions for entry in v.manifest["segments"] for path in segment_files(entry)}
            active = s.get(IndexVersion, shard.active_version_id) if shard.active_version_id else None
        return new - named, active.watermark if active else 0

    def rows_above(self, files: set[str], watermark: int) -> list[bool]:
        """For each new segment's rows file: True when it holds seqs above the watermark (a materialization's
        segment), False when it holds none (a merge's rewrite of published rows)."""
        out = []
        for path in files:
            if path.endswith(f"/{ROWS_FILE}"):
                if path not in self.max_seq:
                    seqs = pq.read_table(pa.BufferReader(self.shoal.storage.read(path)), columns=[SEQ])[SEQ]
                    self.max_seq[path] = int(pc.max(seqs).as_py() or 0)
                out.append(self.max_seq[path] > watermark)
        return out

    def inside(self, kind: str) -> bool:
        """True while a build of this `kind` is running and has written unpublished files:
        `materialize-deletions` (deletion files, which only a materialization writes), `materialize-rows` (a new
        segment with new seqs) or `merge-rows` (a new segment holding only published seqs)."""
        seen = self.unpublished(leased=kind != "merge-rows")  # a merge builds without the lease
        if seen is None:
            return False
        files, watermark = seen
        if kind == "materialize-deletions":
            return any(p.rsplit("/", 1)[1].startswith("deleted-") for p in files)
        above = self.rows_above(files, watermark)
        return any(above) if kind == "materialize-rows" else not all(above)


def _nudge_merges(shoal: Shoal, shard_id: int, stop: threading.Event) -> None:
    """Queue a merge of the shard every 2 s until `stop` is set."""
    app = producer_app(shoal.runtime.broker_url())
    while not stop.wait(2.0):
        with contextlib.suppress(Exception):  # a queue refused while the worker dies: the next try goes on
            enqueue(shoal.runtime.redis(), app, MERGE, shard_id, 2.0)


def _kill_inside(worker, window: BuildWindow, kind: str) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL the worker (its whole session) once it is frozen inside a build of `kind`."""
    freeze_inside(worker.pid, lambda: window.inside(kind), 120, f"the worker to be inside {kind}", group=True)
    kill_worker(worker)
    if kind != "merge-rows":
        # The killed build never gave its lease back: the kill landed inside the build, not after it.
        assert window.shard().lease_owner not in (None, window.owner_before)


def test_sigkill_during_materialize_and_merge(wshoal: Shoal) -> None:
    rng = np.random.default_rng(11)
    spec = _source(uuid.uuid4().hex[:8])
    wshoal.create_data_source(spec)
    index = f"{spec.name}-hnsw"
    record = wshoal.create_index(
        IndexSpec(
            index,
            "1",
            spec.name,
            "1",
            algorithm="hnsw",
            metric="euclidean",
            params={"M": 16, "ef_construction": 200, "ef_search": 400},
        )
    )
    # Where each kill lands, in turn: in a materialization that wrote its first files, mid deletion files or
    # with its new segment's rows written (its index building); in a merge with the merged rows written.
    materialize_windows = ["materialize-rows", "materialize-deletions", "materialize-rows", "materialize-deletions"]
    next_id = 0
    killed = {"materialize_shard": 0, "merge_shard": 0}
    started: list[subprocess.Popen[str]] = []

    def launch(**env: str) -> subprocess.Popen[str]:
        started.append(start_worker(wshoal.settings, beat=True, **env))
        return started[-1]

    try:
        for round_no in range(8):
            # New points, updates of old ones and deletes: every materialization writes a segment and deletions.
            ids = np.arange(next_id, next_id + 2000)
            next_id += 2000
            _upload(wshoal, spec, ids, rng)
            _upload(wshoal, spec, rng.choice(next_id, 300, replace=False), rng)
            wshoal.producer(spec.name, "1").delete({"id": rng.choice(next_id, 100, replace=False)})
            if round_no % 2 == 0:
                window = BuildWindow(wshoal, index)
                worker = launch()
                _kill_inside(worker, window, materialize_windows[round_no // 2])
                killed["materialize_shard"] += 1
            else:
                # Let this round's materialization finish, then make every multi-segment shard due for a merge
                # (max_segments=1) and kill the worker in the middle of that merge (beat's sweep_merges queues it).
                # This worker merges nothing: a merge of its own, after the second upload's segment, could leave
                # the shard one segment with nothing to merge for the worker to be killed in (seen once).
                worker = launch(SHOAL_MAX_SEGMENTS="1000", SHOAL_MERGE_INTERVAL_S="0")
                wait_for(lambda: _caught_up(wshoal, index), 120, "the worker to catch up")
                _upload(wshoal, spec, rng.choice(next_id, 300, replace=False), rng)  # a second segment at least
                wait_for(lambda: _caught_up(wshoal, index), 120, "the worker to catch up again")
                stop_process(worker)
                window = BuildWindow(wshoal, index)
                worker = launch(SHOAL_MAX_SEGMENTS="1")
                # Beat's merge sweep queues it within a second; it is also queued directly, every 2 s, as a
                # materialization would queue it.
                nudging = threading.Event()
                nudger = threading.Thread(target=_nudge_merges, args=(wshoal, window.shard_id, nudging), daemon=True)
                nudger.start()
                try:
                    _kill_inside(worker, window, "merge-rows")
                finally:
                    nudging.set()
                    nudger.join(10)
                killed["merge_shard"] += 1
            _verify_all_versions(wshoal, index)
        worker = launch()
        try:
            wait_for(lambda: _caught_up(wshoal, index), 180, "a fresh worker to catch up after the kills")
        finally:
            stop_process(worker)
    finally:  # a round that fails leaves no worker (frozen or not) taking later tests' tasks from the broker
        for proc in started:
            if proc.poll() is None:
                kill_worker(proc)
    print("kills inside tasks:", killed)
    assert killed["materialize_shard"] >= 2 and killed["merge_shard"] >= 2, killed
    assert killed == {"materialize_shard": 4, "merge_shard": 4}  # every kill landed inside its build
    assert _verify_all_versions(wshoal, index) > 4
    active = wshoal.shards.active_version(record.shards[0].id)
    assert active is not None and active.watermark == wshoal.get_data_source(spec.name, "1").head_seq
    # HNSW at ef_search 400 over the live points: the top-10 must match brute force nearly always.
    folded = wshoal.fold(spec.name, "1")
    vectors = np.asarray(folded["__vector"].to_pylist(), dtype=np.float32).reshape(-1, DIM)
    ids = np.asarray(folded["id"].to_pylist())
    queries = rng.standard_normal((20, DIM)).astype(np.float32)
    searcher = wshoal.searcher(follow=False)
    hits = searcher.search(index, "1", queries, 10)
    searcher.close()
    _, labels = exact_top_k(Metric.EUCLIDEAN, queries, vectors, 10)
    recall = np.mean(
        [len({h.attributes["id"] for h in hits[q]} & set(ids[labels[q]].tolist())) / 10 for q in range(len(queries))]
    )
    assert recall >= 0.95


def test_quick_segments_are_rebuilt_at_full_quality_soon_after_ingest_stops(  # type: ignore[no-untyped-def]
    make_settings, redis_url: str, worker_catalog: str
) -> None:
    """A burst past the backlog threshold is built quickly; once the data source has taken fewer entries than
    the threshold for a quick window, the worker rebuilds those segments at the index's own parameters by
    itself: no further commit, and no merge sweep by beat (off here), has to come first."""
    settings = make_settings("local", database_url=worker_catalog, redis_url=redis_url,
                             sweep_interval_s=1.0, merge_interval_s=0.0,
                             pending_ttl_s=2.0, quick_build_backlog_seqs=500, quick_ef_construction=16,
                             quick_window_s=2.0)
    shoal = Shoal(settings)
    spec = _source(uuid.uuid4().hex[:8])
    shoal.create_data_source(spec)
    index = f"{spec.name}-hnsw"
    shoal.create_index(IndexSpec(index, "1", spec.name, "1", algorithm="hnsw", metric="euclidean",
                                 params={"M": 16, "ef_construction": 200, "ef_search": 200}))
    shard_id = shoal.get_index(index, "1").shards[0].id
    worker = start_worker(settings, beat=True)
    try:
        rng = np.random.default_rng(5)
        _upload(shoal, spec, np.arange(2_000), rng)  # one commit: a backlog of 2,000 entries

        def manifests() -> list[list[dict]]:  # type: ignore[type-arg]
            with Session(shoal.engine) as s:
                rows = s.scalars(select(IndexVersion).where(IndexVersion.shard_id == shard_id)
                                 .order_by(IndexVersion.id)).all()
                return [list(v.manifest["segments"]) for v in rows]

        wait_for(lambda: _caught_up(shoal, index), 90, "the worker to build the burst")
        first = next(m for m in manifests() if m)
        assert [bool(s.get("quick")) for s in first] == [True]  # the burst was built quickly
        wait_for(lambda: not any(s.get("quick") for s in manifests()[-1]), 60,
                 "the quick segment to be rebuilt at full quality")
        (rebuilt,) = manifests()[-1]
        assert rebuilt["rows"] == 2_000
        folded = shoal.fold(spec.name, "1")
        vectors = np.asarray(folded["__vector"].to_pylist(), dtype=np.float32).reshape(-1, DIM)
        searcher = shoal.searcher(follow=False)
        try:
            hits = searcher.search(index, "1", vectors[:200], 1)
        finally:
            searcher.close()
        assert [h[0].attributes["id"] for h in hits] == folded["id"].to_pylist()[:200]
    finally:
        stop_process(worker)
        shoal.close()
