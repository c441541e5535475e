"""Real Celery workers against the real broker: ingest triggers materialization, searches follow, and a
worker SIGKILLed during materialization and merge, repeatedly, never leaves a broken version behind."""

from __future__ import annotations

import random
import re
import time
import uuid

import numpy as np
import pytest
from conftest import kill_worker, start_worker, stop_process, wait_for
from sqlalchemy import select
from sqlalchemy.orm import Session

from shoal import DataSourceSpec, Shoal
from shoal.index.segment import load_segment, read_deletions
from shoal.catalog.models import IndexShard, IndexVersion
from shoal.engines.metrics import Metric, exact_top_k
from shoal.log.records import IndexSpec
from shoal.searcher.consistency import Consistency

pytestmark = pytest.mark.slow  # real Celery worker processes

DIM = 16


@pytest.fixture
def wshoal(make_settings, redis_url: str):  # type: ignore[no-untyped-def]
    """A Shoal whose settings point workers and triggers at the real broker."""
    settings = make_settings(
        "local",
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


BUILD_TASK = re.compile(r"Task shoal\.workers\.tasks\.(\w+)\[([0-9a-f-]+)\] (received|succeeded|retry)")


def _running_builds(log_path, task: str) -> int:  # type: ignore[no-untyped-def]
    """How many `task` tasks the worker's log shows received and not yet finished."""
    state: dict[str, str] = {}
    for name, task_id, what in BUILD_TASK.findall(log_path.read_text()):
        if name == task:
            state[task_id] = what
    return sum(1 for what in state.values() if what == "received")


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


def _kill_during(worker, task: str, chooser: random.Random) -> bool:  # type: ignore[no-untyped-def]
    """Wait until the worker runs `task`, SIGKILL it at a random moment; True if the task was still running."""
    wait_for(lambda: _running_builds(worker.log_path, task) > 0, 90, f"the worker to start {task}")
    time.sleep(chooser.uniform(0.0, 0.4))  # most builds here take 0.5 s or more: usually lands inside
    running = _running_builds(worker.log_path, task) > 0
    kill_worker(worker)
    return running


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
    chooser = random.Random(3)
    next_id = 0
    killed = {"materialize_shard": 0, "merge_shard": 0}
    for round_no in range(8):
        # New points, updates of old ones and deletes: every materialization writes a segment and deletions.
        ids = np.arange(next_id, next_id + 2000)
        next_id += 2000
        _upload(wshoal, spec, ids, rng)
        _upload(wshoal, spec, rng.choice(next_id, 300, replace=False), rng)
        wshoal.producer(spec.name, "1").delete({"id": rng.choice(next_id, 100, replace=False)})
        if round_no % 2 == 0:
            worker = start_worker(wshoal.settings, beat=True)
            killed["materialize_shard"] += _kill_during(worker, "materialize_shard", chooser)
        else:
            # Let this round's materialization finish, then make every multi-segment shard due for a merge
            # (max_segments=1) and kill the worker in the middle of that merge (beat's sweep_merges queues it).
            worker = start_worker(wshoal.settings, beat=True)
            wait_for(lambda: _caught_up(wshoal, index), 120, "the worker to catch up")
            _upload(wshoal, spec, rng.choice(next_id, 300, replace=False), rng)  # a second segment at least
            wait_for(lambda: _caught_up(wshoal, index), 120, "the worker to catch up again")
            stop_process(worker)
            worker = start_worker(wshoal.settings, beat=True, SHOAL_MAX_SEGMENTS="1")
            killed["merge_shard"] += _kill_during(worker, "merge_shard", chooser)
        _verify_all_versions(wshoal, index)
    worker = start_worker(wshoal.settings, beat=True)
    try:
        wait_for(lambda: _caught_up(wshoal, index), 180, "a fresh worker to catch up after the kills")
    finally:
        stop_process(worker)
    print("kills inside tasks:", killed)
    assert killed["materialize_shard"] >= 2 and killed["merge_shard"] >= 2, killed
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
