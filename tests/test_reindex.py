"""Reindex: a new generation built aside, gated by recall against exact search, swapped atomically (also
under continuous searches), rolled back, cancelled; failed jobs leave the old generation serving."""

from __future__ import annotations

import datetime as dt
import threading
from pathlib import Path

import numpy as np
import pytest

from shoal import DataSourceSpec, Shoal
from shoal.errors import InvalidNameError, NotFoundError, ReindexConflictError
from shoal.index.builder import ShardBuilder
from shoal.index.reindex import drop_expired_generations, start_reindex
from shoal.log.records import AttributeType, IndexSpec
from shoal.upkeep import gc_queue as garbage

DIM = 16
SPEC = DataSourceSpec("docs", "1", DIM, {"id": AttributeType.INT64}, ["id"])
HNSW16 = {"M": 16, "ef_construction": 100, "ef_search": 32}
HNSW32 = {"M": 32, "ef_construction": 100, "ef_search": 32}


def _setup(shoal: Shoal, algorithm: str = "flat", params: dict[str, int] | None = None, n: int = 2_000) -> np.ndarray:
    shoal.create_data_source(SPEC)
    rng = np.random.default_rng(11)
    vectors = rng.normal(size=(n, DIM)).astype(np.float32)
    shoal.producer("docs", "1").upload_columns(vectors, {"id": np.arange(n)})
    shoal.create_index(IndexSpec("ix", "1", "docs", "1", algorithm=algorithm, metric="euclidean",
                                 params=params or {}, id_attributes=["id"]))
    builder = ShardBuilder(shoal.engine, shoal.storage)
    for shard in shoal.get_index("ix", "1").shards:
        builder.materialize(shard.id)
    return rng.normal(size=(50, DIM)).astype(np.float32)


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def _ids(results: list[list[object]]) -> list[tuple[int, ...]]:
    return [tuple(h.attributes["id"] for h in hits) for hits in results]  # type: ignore[attr-defined]


def test_reindex_swaps_rolls_back_and_old_generation_expires(local_shoal: Shoal) -> None:
    queries = _setup(local_shoal)
    searcher = local_shoal.searcher(follow=False)
    try:
        flat = _ids(searcher.search("ix", "1", queries, 10))
        job = local_shoal.reindex("ix", "1", algorithm="hnsw", params=HNSW16, wait=True)
        assert job.state == "swapped", job
        assert job.recall is not None and job.recall >= 0.95
        assert job.gate == 0.95
        assert local_shoal.get_index("ix", "1").spec.algorithm == "hnsw"
        assert [i.spec.version for i in local_shoal.list_indexes()] == ["1"]  # generations stay hidden
        assert "last_reindex_at" in local_shoal.get_data_source("docs", "1").spec.custom_metadata
        searcher.refresh()
        assert searcher.view("ix", "1").index.spec.algorithm == "hnsw"
        hnsw = _ids(searcher.search("ix", "1", queries, 10))
        agree = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(flat, hnsw, strict=True)])
        assert agree >= 0.95

        local_shoal.rollback("ix", "1")
        searcher.refresh()
        assert searcher.view("ix", "1").index.spec.algorithm == "flat"
        assert _ids(searcher.search("ix", "1", queries, 10)) == flat
        assert local_shoal.reindex_jobs("ix", "1")[0].state == "rolled_back"
        with pytest.raises(ReindexConflictError, match="no reindex to roll back"):
            local_shoal.rollback("ix", "1")

        # Past its keep time the generation that does not serve goes, rows and files.
        root = Path(local_shoal.storage.root)
        before = _files(root)
        # Every generation's files lie under the index's own version (DESIGN's layout), the one built aside too
        # (its files were under the hidden version, `1~g2/gen-2/`).
        assert any("/indexes/ix/1/gen-2/" in f for f in before)
        assert not any("~g" in f for f in before)
        tenant_id = local_shoal.catalog.tenant_id
        assert drop_expired_generations(local_shoal.engine, local_shoal.storage, keep_s=0, tenant_id=tenant_id) == 1
        after = _files(root)
        assert not any("/gen-2/" in f for f in after)
        assert _ids(searcher.search("ix", "1", queries, 10)) == flat
    finally:
        searcher.close()


def test_a_reindex_below_its_recall_gate_fails_and_removes_its_files(local_shoal: Shoal) -> None:
    queries = _setup(local_shoal)
    root = Path(local_shoal.storage.root)
    before = _files(root)
    # IVF probing 1 of 64 lists over random vectors: far below an exact gate, whatever the clustering.
    job = local_shoal.reindex("ix", "1", algorithm="ivf", params={"nlist": 64, "nprobe": 1}, gate=1.0, wait=True)
    assert job.state == "failed"
    assert job.recall is not None and job.recall < 1.0
    assert "below the gate" in (job.error or "")
    assert local_shoal.get_index("ix", "1").spec.algorithm == "flat"
    assert _files(root) == before  # its own files are gone, the old generation's are all there
    searcher = local_shoal.searcher(follow=False)
    try:
        assert len(searcher.search("ix", "1", queries, 10)[0]) == 10
    finally:
        searcher.close()


def test_cancel_and_bad_requests(local_shoal: Shoal) -> None:
    _setup(local_shoal, n=300)
    job = start_reindex(local_shoal.catalog, local_shoal.indexes, "ix", "1", algorithm="hnsw", params=HNSW16)
    with pytest.raises(ReindexConflictError, match="being reindexed already"):
        local_shoal.reindex("ix", "1", algorithm="hnsw", params=HNSW32, wait=True)
    cancelled = local_shoal.cancel_reindex("ix", "1")
    assert cancelled.id == job.id and cancelled.state == "cancelled"
    with pytest.raises(NotFoundError):
        local_shoal.cancel_reindex("ix", "1")
    assert local_shoal.get_index("ix", "1").spec.algorithm == "flat"
    with pytest.raises(NotFoundError):
        local_shoal.reindex("nope", "1", wait=True)
    with pytest.raises(InvalidNameError, match="reserved"):
        local_shoal.create_index(IndexSpec("ix", "1~g5", "docs", "1", id_attributes=["id"]))
    with pytest.raises(Exception, match="M"):
        local_shoal.reindex("ix", "1", algorithm="hnsw", params={"M": 1}, wait=True)
    assert local_shoal.reindex_jobs("ix", "1")[0].state == "cancelled"  # bad requests start no job


def test_swap_under_continuous_search_every_answer_from_one_generation(local_shoal: Shoal) -> None:
    """HNSW M=16 -> M=32 while 8 threads search through a following searcher: no failed query, and each
    answer is exactly what one generation answers."""
    queries = _setup(local_shoal, "hnsw", HNSW16, n=3_000)
    searcher = local_shoal.searcher(follow=True, poll_interval=0.05)
    try:
        old = _ids(searcher.search("ix", "1", queries, 10))
        answers: list[tuple[int, tuple[int, ...]]] = []
        errors: list[BaseException] = []
        stop = threading.Event()
        lock = threading.Lock()

        def client(offset: int) -> None:
            i = offset
            while not stop.is_set():
                q = i % len(queries)
                try:
                    got = _ids(searcher.search("ix", "1", queries[q : q + 1], 10))[0]
                except BaseException as exc:  # noqa: BLE001 - every failure is reported
                    errors.append(exc)
                    return
                with lock:
                    answers.append((q, got))
                i += 1

        threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        job = local_shoal.reindex("ix", "1", params=HNSW32, wait=True)
        assert job.state == "swapped", job

        def serves_new() -> bool:
            return searcher.view("ix", "1").index.spec.params["M"] == 32

        from conftest import wait_for

        wait_for(serves_new, 60, "the searcher to serve the new generation")
        seen_new = len(answers)
        wait_for(lambda: len(answers) > seen_new + 200, 60, "searches on the new generation")
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, errors[:3]
        new = _ids(searcher.search("ix", "1", queries, 10))
        assert old != new  # two different graphs
        mixed = [(q, got) for q, got in answers if got not in (old[q], new[q])]
        assert not mixed, mixed[:3]
        assert any(got == old[q] != new[q] for q, got in answers)
        assert any(got == new[q] != old[q] for q, got in answers)
    finally:
        searcher.close()


@pytest.mark.slow
def test_reindex_over_http_runs_in_a_real_worker_and_shows_progress(make_settings, redis_url) -> None:  # type: ignore[no-untyped-def]
    import httpx
    from conftest import serve_api, start_worker, stop_process, wait_for

    settings = make_settings("local", redis_url=redis_url)
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    with Shoal(settings, notify=False) as shoal:
        queries = _setup(shoal, n=1_000)
    worker = start_worker(settings)
    try:
        with serve_api(settings) as base:
            api = f"{base}/api/v1/indexes/ix/1"
            started = httpx.post(f"{api}/reindex", json={"algorithm": "hnsw", "params": HNSW16}, timeout=30)
            assert started.status_code == 202, started.text
            assert started.json()["state"] == "building"
            again = httpx.post(f"{api}/reindex", json={"algorithm": "hnsw", "params": HNSW16}, timeout=30)
            assert again.status_code in (202, 409)  # 409 while the first one still builds

            def swapped() -> bool:
                jobs = httpx.get(f"{api}/reindex", timeout=30).json()
                return any(j["state"] == "swapped" for j in jobs)

            wait_for(swapped, 120, "the worker to swap the new generation in")
            job = next(j for j in httpx.get(f"{api}/reindex", timeout=30).json() if j["state"] == "swapped")
            assert job["progress"] == 1.0 and job["recall"] >= job["gate"] == 0.95
            assert httpx.get(api, timeout=30).json()["algorithm"] == "hnsw"
            back = httpx.post(f"{api}/rollback", timeout=30)
            assert back.status_code == 200, back.text
            assert back.json()["algorithm"] == "flat"
            assert httpx.post(f"{api}/rollback", timeout=30).status_code == 409
            assert httpx.delete(f"{api}/reindex", timeout=30).status_code == 404  # nothing running
            body = {"k": 3, "queryVectors": [{"isSparse": False, "coordinates": queries[0].tolist()}]}
            assert httpx.post(f"{base}/api/v1/search/ix/1", json=body, timeout=30).status_code == 200
    finally:
        stop_process(worker)


def test_a_reindex_task_run_is_one_bounded_step_while_the_new_generation_lags(  # type: ignore[no-untyped-def]
    make_settings, redis_url, monkeypatch
) -> None:
    """The reindex task never waits for the new generation to catch up (that may take longer than the broker's
    visibility timeout, which would redeliver the task while it runs): while the generation lags (here: another
    worker holds its shard's lease, so it cannot be built), each run records progress, queues the shard's
    materialization and its own continuation, and returns within seconds; a later run swaps it in."""
    import time

    from conftest import use_settings_env

    from shoal.catalog.indexes import ShardCatalog
    from shoal.workers import tasks
    from shoal.workers.base import ShoalTask
    from shoal.workers.names import MATERIALIZE_SHARD, REINDEX

    settings = make_settings("local", redis_url=redis_url)
    use_settings_env(monkeypatch, settings)
    queued: list[tuple[str, int, float | None]] = []

    def record(client, celery, task, item_id, pending_ttl_s=120.0, countdown=None) -> bool:  # type: ignore[no-untyped-def]
        queued.append((task, item_id, countdown))
        return True

    monkeypatch.setattr(tasks, "enqueue", record)
    ShoalTask.reset_context()
    with Shoal(settings, notify=False) as shoal:
        _setup(shoal, n=300)
        job = start_reindex(shoal.catalog, shoal.indexes, "ix", "1", algorithm="hnsw", params=HNSW16)
        shards = ShardCatalog(shoal.engine)
        found = shards.index_by_id(job.to_index_id)  # type: ignore[arg-type]
        assert found is not None
        new_shards = [s.id for s in found[1].shards]
        for shard_id in new_shards:
            assert shards.acquire_lease(shard_id, "another-worker", 600)
        try:
            for run in range(3):
                outcome: list[dict[str, object]] = []
                runner = threading.Thread(target=lambda out=outcome: out.append(tasks.reindex(job.id)),
                                          daemon=True)
                began = time.monotonic()
                runner.start()
                runner.join(20)
                took = time.monotonic() - began
                assert not runner.is_alive(), f"run {run} of the reindex task still waits after {took:.0f} s"
                assert outcome[0]["state"] == "building" and outcome[0]["continues"] is True
                assert queued[-1] == (REINDEX, job.id, tasks.REINDEX_STEP_DELAY_S)  # its continuation
                assert 0 < tasks.REINDEX_STEP_DELAY_S <= 30
                assert {(MATERIALIZE_SHARD, s, None) for s in new_shards} <= set(queued)
                now = shoal.reindex_jobs("ix", "1")[0]
                assert now.state == "building" and now.progress < 1.0
            assert sum(1 for q in queued if q[0] == REINDEX) == 3
            # The lease ends and a worker builds the shard: the next run swaps the generation in.
            builder = ShardBuilder(shoal.engine, shoal.storage)
            for shard_id in new_shards:
                shards.release_lease(shard_id, "another-worker")
                builder.materialize(shard_id)
            queued.clear()
            done = tasks.reindex(job.id)
            assert done["state"] == "swapped" and done["continues"] is False
            assert not any(q[0] == REINDEX for q in queued)  # nothing more to run
            assert shoal.reindex_jobs("ix", "1")[0].progress == 1.0
            assert shoal.get_index("ix", "1").spec.algorithm == "hnsw"
        finally:
            if shoal.generations.running(shoal.catalog.tenant_id, "ix", "1") is not None:
                shoal.cancel_reindex("ix", "1")  # ends a run that polls (the code before the continuation)
            ShoalTask.reset_context()


def test_params_given_with_the_algorithm_kept_change_only_those(local_shoal: Shoal) -> None:
    """`shoal reindex NAME VERSION --param M=32`, as the README writes it: HNSW takes its params all or none at
    creation, but a reindex keeping the algorithm changes the ones given and keeps the others."""
    _setup(local_shoal, algorithm="hnsw", params=HNSW16, n=300)
    job = local_shoal.reindex("ix", "1", params={"M": 32}, wait=True)
    assert job.state == "swapped", job
    assert local_shoal.get_index("ix", "1").spec.params == HNSW32


def test_dropping_an_index_drops_its_generations_and_ends_its_reindex(local_shoal: Shoal) -> None:
    """A drop takes every generation of the index with it (one building, one kept for rollback) and ends a
    reindex still building, so an index made again under the name starts clean: no hidden rows, no job that
    blocks its own reindex, and every file queued for GC."""
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    from shoal.catalog.models import Index

    def rows() -> list[str]:
        with Session(local_shoal.engine) as s:
            return sorted(s.scalars(select(Index.version).where(
                Index.tenant_id == local_shoal.catalog.tenant_id, Index.name == "ix")))

    _setup(local_shoal, n=300)
    assert local_shoal.reindex("ix", "1", algorithm="hnsw", params=HNSW16, wait=True).state == "swapped"
    start_reindex(local_shoal.catalog, local_shoal.indexes, "ix", "1", params=HNSW32)  # left building
    assert rows() == ["1", "1~g1", "1~g3"]
    root = Path(local_shoal.storage.root)
    index_files = {f for f in _files(root) if "/indexes/" in f}
    assert {f.split("/gen-")[1].split("/")[0] for f in index_files} == {"1", "2"}  # g3 has built nothing yet
    local_shoal.drop_index("ix", "1")
    assert rows() == []
    far = dt.datetime.now(dt.UTC) + dt.timedelta(days=365)
    queued = {r.path for r in garbage.due(local_shoal.engine, far, tenant=local_shoal.tenant)}
    assert index_files <= queued  # every generation's files, due after the drop's grace
    local_shoal.create_index(IndexSpec("ix", "1", "docs", "1", algorithm="flat", metric="euclidean",
                                       id_attributes=["id"]))
    job = local_shoal.reindex("ix", "1", algorithm="hnsw", params=HNSW16, wait=True)
    assert job.state == "swapped", job
