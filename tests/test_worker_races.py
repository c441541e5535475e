"""Workers racing drops and failures. A build whose shard is dropped meanwhile (the index dropped, a reindex
cancelled, the data source dropped, a generation swept) ends as "dropped", never in an IntegrityError; a reindex
task of a job that is gone answers "dropped"; a reindex step that raises is carried on (by Celery's retry when the
error is transient, else by a queued next step) instead of waiting for sweep_generations' 10-minute stall check.

The interleavings are made deterministic with catalog locks held by the test: a statement of the process under
test waits on them at a known point, and the test acts while it waits."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from conftest import start_worker, stop_process, wait_for
from sqlalchemy import Engine, text

from shoal import DataSourceSpec, Shoal
from shoal.catalog.indexes import IndexRecord, ShardCatalog
from shoal.config.settings import Settings
from shoal.errors import NotFoundError
from shoal.index.builder import ShardBuilder, shard_dir
from shoal.index.reindex import start_reindex
from shoal.log.records import IndexSpec
from shoal.workers.names import MATERIALIZE_SHARD, QUEUE, REINDEX
from shoal.workers.triggers import producer_app

DIM = 8
SPEC = DataSourceSpec("docs", "1", DIM, {"id": "int64"}, ["id"])
HNSW = {"M": 16, "ef_construction": 100, "ef_search": 64}


@pytest.fixture
def wsettings(make_settings: Callable[..., Settings], redis_url: str, worker_catalog: str) -> Settings:
    """Settings on a catalog of the test's own (the test locks whole tables of it) with the real broker, and a
    lease whose heartbeat never ticks during a test: the publish itself must notice a drop, not the heartbeat."""
    return make_settings("local", database_url=worker_catalog, redis_url=redis_url, lease_seconds=600.0,
                         lease_heartbeat_s=200.0)


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    """Threads for the statements that must wait on the test's locks while the test goes on."""
    with ThreadPoolExecutor(max_workers=2) as executor:
        yield executor


def _index(shoal: Shoal, *, n: int = 200, build: bool = True) -> int:
    """A source of `n` random points with a flat index `ix`/`1` over it (built in this process when `build`);
    returns its shard's id."""
    shoal.create_data_source(SPEC)
    vectors = np.random.default_rng(3).normal(size=(n, DIM)).astype(np.float32)
    shoal.producer("docs", "1").upload_columns(vectors, {"id": np.arange(n)})
    index = shoal.create_index(IndexSpec("ix", "1", "docs", "1", algorithm="flat", metric="euclidean",
                                         id_attributes=["id"]))
    if build:
        ShardBuilder(shoal.engine, shoal.storage).materialize(index.shards[0].id)
    return index.shards[0].id


def _lock_waiters(engine: Engine) -> int:
    """How many sessions of this database wait for a lock right now."""
    with engine.connect() as conn:
        return int(conn.scalar(text(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )) or 0)


def _started(settings: Settings) -> subprocess.Popen[str]:
    """A real worker, returned once it takes tasks."""
    worker = start_worker(settings)
    wait_for(lambda: " ready." in _log(worker) or worker.poll() is not None, 60, "the worker to start")
    assert worker.poll() is None, _log(worker)[-3000:]
    return worker


def _log(worker: subprocess.Popen[str]) -> str:
    """The worker's log so far."""
    return Path(worker.log_path).read_text()  # type: ignore[attr-defined]


def _outcomes(worker: subprocess.Popen[str], task: str) -> list[str]:
    """The worker's log lines that end a run of `task` (succeeded, failed, or retried)."""
    return [line for line in _log(worker).splitlines()
            if f"{task}[" in line and any(w in line for w in (" succeeded in ", " raised ", " retry: "))]


def _send(shoal: Shoal, task: str, item_id: int) -> None:
    producer_app(shoal.broker_url()).send_task(task, args=[item_id], queue=QUEUE)


# -- a drop while a build runs (its publish used to fail on the version row's foreign key) ----------------------


def test_a_publish_waiting_for_a_drop_of_its_shard_raises_not_found(
    make_shoal: Callable[..., Shoal], worker_catalog: str, pool: ThreadPoolExecutor
) -> None:
    """A publish that reaches the shard while a drop holds it (rows locked and deleted, not committed yet) waits
    for the drop and then finds the shard gone: NotFoundError, which the tasks answer as "dropped" (it was an
    IntegrityError from the version row's foreign key). The drop lists the files of every version it removed."""
    shoal = make_shoal(database_url=worker_catalog)
    shard_id = _index(shoal)
    shards = ShardCatalog(shoal.engine)
    active = shards.active_version(shard_id)
    assert active is not None
    with shoal.engine.connect() as blocker:
        # The drop locks and deletes the shard rows, then waits here to queue the files: inside its transaction.
        blocker.execute(text("LOCK TABLE garbage_files IN SHARE MODE"))
        drop: Future[int] = pool.submit(shoal.drop_index, "ix", "1")
        wait_for(lambda: _lock_waiters(shoal.engine) == 1, 30, "the drop to hold the shard rows and wait")
        publish: Future[int | None] = pool.submit(
            shards.publish_version, shard_id, active.id, active.generation, active.watermark, active.manifest,
            files=[],
        )
        wait_for(lambda: _lock_waiters(shoal.engine) == 2, 30, "the publish to wait for the drop")
        blocker.rollback()
    assert drop.result(30) > 0
    with pytest.raises(NotFoundError, match=f"index shard {shard_id} not found"):
        publish.result(30)
    with shoal.engine.connect() as conn:
        assert conn.scalar(text("SELECT count(*) FROM index_versions WHERE shard_id = :s"), {"s": shard_id}) == 0


def test_a_worker_whose_index_is_dropped_while_it_builds_answers_dropped(wsettings: Settings) -> None:
    """The report's case: a real worker builds a shard (it holds the lease and reads the log) when the index is
    dropped. The task ends as "nothing to do" ({'shard': N, 'dropped': True}), not in a ForeignKeyViolation."""
    with Shoal(wsettings, notify=False) as shoal:
        shard_id = _index(shoal, build=False)
        worker = _started(wsettings)
        try:
            with shoal.engine.connect() as blocker:
                # The build takes its lease, then waits here to read the log: the drop lands in the middle of it.
                blocker.execute(text("LOCK TABLE log_segments IN ACCESS EXCLUSIVE MODE"))
                _send(shoal, MATERIALIZE_SHARD, shard_id)
                wait_for(
                    lambda: shoal.shards.lease_holder(shard_id)[0] is not None and _lock_waiters(shoal.engine) == 1,
                    60, "the worker to take the shard's lease and wait to read the log",
                )
                shoal.drop_index("ix", "1")
                blocker.rollback()
            wait_for(lambda: bool(_outcomes(worker, MATERIALIZE_SHARD)), 60, "the build to end")
            outcome = _outcomes(worker, MATERIALIZE_SHARD)
            assert len(outcome) == 1 and f"{{'shard': {shard_id}, 'dropped': True}}" in outcome[0], outcome
            assert "IntegrityError" not in _log(worker)
        finally:
            stop_process(worker)


# -- reindex tasks ----------------------------------------------------------------------------------------


def test_a_reindex_task_of_a_job_that_is_gone_answers_dropped(wsettings: Settings) -> None:
    """Like every task given the id of something that no longer exists: "dropped", not a NotFoundError."""
    with Shoal(wsettings, notify=False) as shoal:
        worker = _started(wsettings)
        try:
            _send(shoal, REINDEX, 987654)
            wait_for(lambda: bool(_outcomes(worker, REINDEX)), 60, "the reindex task to end")
            outcome = _outcomes(worker, REINDEX)
            assert len(outcome) == 1 and "succeeded" in outcome[0], outcome
            assert "{'job': 987654, 'dropped': True}" in outcome[0]
        finally:
            stop_process(worker)


def _caught_up_reindex(shoal: Shoal) -> tuple[int, IndexRecord]:
    """A reindex of `ix`/`1` to HNSW whose new generation is built (in this process) up to the head, so its next
    step checks recall and swaps; (job id, the generation)."""
    _index(shoal)
    job = start_reindex(shoal.catalog, shoal.indexes, "ix", "1", algorithm="hnsw", params=HNSW)
    found = shoal.shards.index_by_id(job.to_index_id)  # type: ignore[arg-type]
    assert found is not None
    generation = found[1]
    builder = ShardBuilder(shoal.engine, shoal.storage)
    for shard in generation.shards:
        builder.materialize(shard.id)
    return job.id, generation


def test_a_reindex_step_that_fails_is_followed_by_another_soon(wsettings: Settings) -> None:
    """A step fails on an error Celery does not retry (here the new generation's files are missing for a while,
    as they were when an S3 outage read as a corrupt artifact): the task still queues the job's next step, which
    swaps the generation in once the files are back. Before, nothing ran until sweep_generations found the job
    stalled: 10 minutes without progress, checked every 10 minutes."""
    with Shoal(wsettings, notify=False) as shoal:
        job_id, generation = _caught_up_reindex(shoal)
        folder = Path(wsettings.resolved_storage_uri) / shard_dir(generation, generation.shards[0],
                                                                   generation.generation)
        assert folder.is_dir(), folder
        hidden = folder.with_name(folder.name + ".away")
        folder.rename(hidden)
        worker = _started(wsettings)
        try:
            _send(shoal, REINDEX, job_id)
            wait_for(lambda: bool(_outcomes(worker, REINDEX)), 60, "the reindex step to fail")
            first = _outcomes(worker, REINDEX)[0]
            assert " raised " in first, first
            assert shoal.generations.job(job_id).state == "building"
            hidden.rename(folder)
            wait_for(lambda: shoal.generations.job(job_id).state == "swapped", 60,
                     "the job's next step to swap the generation in")
            assert shoal.get_index("ix", "1").spec.algorithm == "hnsw"
        finally:
            stop_process(worker)


def test_a_reindex_step_that_celery_retries_queues_no_second_run(wsettings: Settings) -> None:
    """A step fails on a transient error (its catalog connection is cut): Celery's retry runs the step again
    and swaps the generation in. The task queues no continuation of its own beside that retry, so the job never
    has two runs in flight."""
    with Shoal(wsettings, notify=False) as shoal:
        job_id, _ = _caught_up_reindex(shoal)
        worker = _started(wsettings)
        try:
            with shoal.engine.connect() as blocker:
                blocker.execute(text("LOCK TABLE log_segments IN ACCESS EXCLUSIVE MODE"))  # the step reads the log
                _send(shoal, REINDEX, job_id)
                wait_for(lambda: _lock_waiters(shoal.engine) == 1, 60, "the reindex step to wait to read the log")
                cut = blocker.scalar(text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                ))
                assert cut == 1
                blocker.rollback()
            wait_for(lambda: shoal.generations.job(job_id).state == "swapped", 60, "the retry to swap the job in")
            wait_for(lambda: any(" succeeded " in line for line in _outcomes(worker, REINDEX)), 30,
                     "the retry to end")
            outcomes = _outcomes(worker, REINDEX)
            assert [(" retry: " in line, " succeeded " in line) for line in outcomes] == [(True, False), (False, True)]
            received = [line for line in _log(worker).splitlines() if f"{REINDEX}[" in line and " received" in line]
            assert len(received) == 2, received  # the task and Celery's retry of it, nothing more
        finally:
            stop_process(worker)
