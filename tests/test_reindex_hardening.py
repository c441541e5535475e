"""Reindex and shard builds at their edges: a reindex's generation is built at the params asked for (never as a
quick graph), swaps in while ingest goes on, is judged against what each shard reflects, and starts once
however many calls race; a build of a dropped shard ends instead of retrying; bad arguments are 400s."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from shoal import DataPoint, DataSourceSpec, Shoal, Tombstone
from shoal.catalog.indexes import IndexRecord, ShardCatalog
from shoal.catalog.models import DataSource, Index
from shoal.errors import NotFoundError, ReindexConflictError, ValidationError
from shoal.index.builder import ShardBuilder
from shoal.index.generations import JobRecord
from shoal.index.manifest import Manifest
from shoal.index.reindex import reindex_step, run_reindex, start_reindex
from shoal.index.sharding import shard_numbers
from shoal.log.records import AttributeType, IndexSpec
from shoal.log.validation import VECTOR, columns_to_table, vector_problem
from shoal.searcher.consistency import Consistency

DIM = 8
SPEC = DataSourceSpec("docs", "1", DIM, {"id": AttributeType.INT64}, ["id"])
HNSW = {"M": 16, "ef_construction": 100, "ef_search": 32}


def _setup(shoal: Shoal, *, n: int, algorithm: str = "hnsw", shards: int = 1, seed: int = 7) -> dict[int, np.ndarray]:
    """A source with `n` random points, an index `ix`/`1` over it, built in process; returns id -> vector."""
    shoal.create_data_source(SPEC)
    rng = np.random.default_rng(seed)
    vectors = rng.normal(size=(n, DIM)).astype(np.float32)
    shoal.producer("docs", "1").upload_columns(vectors, {"id": np.arange(n)})
    shoal.create_index(IndexSpec("ix", "1", "docs", "1", algorithm=algorithm, metric="euclidean",
                                 params=HNSW if algorithm == "hnsw" else {}, id_attributes=["id"],
                                 shard_count=shards))
    builder = ShardBuilder(shoal.engine, shoal.storage)
    for shard in shoal.get_index("ix", "1").shards:
        builder.materialize(shard.id)
    return dict(enumerate(vectors))


def _generation(shoal: Shoal, job: JobRecord) -> IndexRecord:
    found = ShardCatalog(shoal.engine).index_by_id(job.to_index_id)  # type: ignore[arg-type]
    assert found is not None
    return found[1]


def _quick_segments(shoal: Shoal, index: IndexRecord) -> list[bool]:
    shards = ShardCatalog(shoal.engine)
    flags = []
    for shard in index.shards:
        active = shards.active_version(shard.id)
        assert active is not None
        flags += [s.quick for s in Manifest.of(active.manifest).segments]
    return flags


def test_a_reindex_generation_is_built_and_gated_at_the_params_asked_for(local_shoal: Shoal) -> None:
    """A worker's builder builds a quick graph (ef_construction 40) for a shard with a backlog; the first build
    of a reindex's generation has the whole log as backlog, yet it must be built at the params asked for: the
    recall gate judges that graph, and the swap serves it."""
    _setup(local_shoal, n=600)
    # As a worker under ingest: any backlog gets a quick graph.
    builder = ShardBuilder(local_shoal.engine, local_shoal.storage, quick_backlog_seqs=1, quick_ef_construction=40)
    local_shoal.producer("docs", "1").upload([DataPoint({"id": 10_000}, [0.5] * DIM)])
    serving = local_shoal.get_index("ix", "1")
    builder.materialize(serving.shards[0].id)
    assert any(_quick_segments(local_shoal, serving))  # the serving index does get quick segments

    job = start_reindex(local_shoal.catalog, local_shoal.indexes, "ix", "1", params={"M": 24})
    outcome = run_reindex(local_shoal.engine, local_shoal.storage, job.id, builder=builder)
    assert outcome.state == "swapped", outcome
    swapped = local_shoal.get_index("ix", "1")
    assert swapped.spec.params["M"] == 24
    assert _quick_segments(local_shoal, swapped) == [False]  # built at ef_construction 100, as asked


def test_a_reindex_swaps_while_ingest_goes_on_and_loses_no_write(local_shoal: Shoal) -> None:
    """Workers build the new generation between the job's steps while a producer keeps committing, so the head
    a step reads is always ahead of what was built. The job still swaps (it is judged against the head of the
    step before), and the serving index then answers `strong` exactly, the writes past its watermark included."""
    points = _setup(local_shoal, n=400, shards=2)
    producer = local_shoal.producer("docs", "1")
    builder = ShardBuilder(local_shoal.engine, local_shoal.storage)
    job = start_reindex(local_shoal.catalog, local_shoal.indexes, "ix", "1", algorithm="flat")
    new = _generation(local_shoal, job)
    rng = np.random.default_rng(3)

    def queue(index: IndexRecord) -> None:  # the task only queues the builds: the workers run them later
        pass

    outcome = None
    for _ in range(4):
        outcome = reindex_step(local_shoal.engine, local_shoal.storage, job.id, build=queue)
        if outcome.finished:
            break
        for shard in new.shards:  # the workers build every shard up to the head ...
            builder.materialize(shard.id)
        ids = rng.choice(len(points) + 50, size=20, replace=False)  # ... while ingest goes on
        batch = {int(i): rng.normal(size=DIM).astype(np.float32) for i in ids}
        producer.upload([DataPoint({"id": i}, v.tolist()) for i, v in batch.items()])
        points.update(batch)
    assert outcome is not None and outcome.state == "swapped", outcome
    assert local_shoal.get_index("ix", "1").spec.algorithm == "flat"

    ids = np.array(sorted(points))
    matrix = np.stack([points[i] for i in ids])
    queries = rng.normal(size=(20, DIM)).astype(np.float32)
    searcher = local_shoal.searcher(follow=False)
    try:
        hits = searcher.search("ix", "1", queries, 10, consistency=Consistency.strong())
    finally:
        searcher.close()
    for query, found in zip(queries, hits, strict=True):
        exact = ids[np.argsort(np.linalg.norm(matrix - query, axis=1), kind="stable")[:10]]
        assert [h.attributes["id"] for h in found] == exact.tolist()


def test_recall_is_judged_against_each_shard_at_its_own_watermark(local_shoal: Shoal) -> None:
    """Two workers build the shards at different heads: shard 0, then every key of shard 1 is deleted, then
    shard 1. An exact reindex (gate 1.0) must still pass: each shard is exact at its own watermark."""
    _setup(local_shoal, n=60, shards=2)
    producer = local_shoal.producer("docs", "1")
    builder = ShardBuilder(local_shoal.engine, local_shoal.storage)
    job = start_reindex(local_shoal.catalog, local_shoal.indexes, "ix", "1", algorithm="flat")
    assert job.gate == 1.0
    shard_of = shard_numbers(pa.table({"id": list(range(60))}), ["id"], 2)
    in_shard_1 = [i for i in range(60) if shard_of[i] == 1]

    def build(index: IndexRecord) -> None:
        first, second = index.shards
        builder.materialize(first.id)
        producer.upload([Tombstone({"id": i}) for i in in_shard_1])
        builder.materialize(second.id)

    outcome = reindex_step(local_shoal.engine, local_shoal.storage, job.id, build=build)
    assert outcome.state == "swapped", outcome
    assert outcome.recall == 1.0


def test_concurrent_reindex_calls_start_one_job_and_the_other_gets_a_conflict(local_shoal: Shoal) -> None:
    """Two reindex calls at the same moment (held at the same point by a lock on the data source row, then let
    go together): exactly one starts a job, the other gets ReindexConflictError (409), never a second job or
    the hidden generation name the first one took."""
    _setup(local_shoal, n=50)
    source_id = local_shoal.get_index("ix", "1").source_id
    results: list[JobRecord] = []
    errors: list[BaseException] = []

    def call(m: int) -> None:
        try:
            results.append(start_reindex(local_shoal.catalog, local_shoal.indexes, "ix", "1", params={"M": m}))
        except BaseException as exc:  # noqa: BLE001 - every outcome is checked below
            errors.append(exc)

    with local_shoal.engine.connect() as holder:
        holder.execute(select(DataSource.id).where(DataSource.id == source_id).with_for_update())
        pid = holder.execute(text("SELECT pg_backend_pid()")).scalar_one()
        threads = [threading.Thread(target=call, args=(m,)) for m in (20, 24)]
        for t in threads:
            t.start()

        def both_wait() -> bool:  # on the row, or (as both once did) one on the other
            with local_shoal.engine.connect() as c:
                return c.execute(text(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> :pid"
                    " AND cardinality(pg_blocking_pids(pid)) > 0"
                ), {"pid": pid}).scalar_one() == 2

        from conftest import wait_for

        wait_for(both_wait, 30, "both reindex calls to wait on the data source row")
        holder.rollback()
    for t in threads:
        t.join(60)
    assert len(results) == 1, (results, errors)
    assert len(errors) == 1 and isinstance(errors[0], ReindexConflictError), errors
    assert "being reindexed already" in str(errors[0])
    jobs = local_shoal.reindex_jobs("ix", "1")
    assert [j.id for j in jobs if j.state == "building"] == [results[0].id]
    with Session(local_shoal.engine) as s:
        versions = sorted(s.scalars(select(Index.version).where(Index.tenant_id == local_shoal.catalog.tenant_id)))
    assert versions == ["1", "1~g2"]
    assert local_shoal.cancel_reindex("ix", "1").id == results[0].id
    assert not any(j.state == "building" for j in local_shoal.reindex_jobs("ix", "1"))


def test_building_a_shard_of_a_dropped_index_ends_instead_of_retrying(  # type: ignore[no-untyped-def]
    make_settings, redis_url, monkeypatch
) -> None:
    """A materialization queued before its index was dropped finds no shard: NotFoundError, which the task
    answers as "nothing to do" (a LeaseBusyError, as before, made it retry for minutes), as a merge does."""
    from conftest import use_settings_env

    from shoal.workers import tasks
    from shoal.workers.base import ShoalTask

    settings = make_settings("local", redis_url=redis_url)
    use_settings_env(monkeypatch, settings)
    ShoalTask.reset_context()
    try:
        with Shoal(settings, notify=False) as shoal:
            _setup(shoal, n=20, algorithm="flat")
            shard_id = shoal.get_index("ix", "1").shards[0].id
            shoal.producer("docs", "1").upload([DataPoint({"id": 99}, [1.0] * DIM)])
            shoal.drop_index("ix", "1")
            builder = ShardBuilder(shoal.engine, shoal.storage)
            with pytest.raises(NotFoundError, match=f"index shard {shard_id} not found"):
                builder.materialize(shard_id)
            with pytest.raises(NotFoundError):
                builder.merge(shard_id)
            result: dict[str, Any] = tasks.materialize_shard(shard_id)  # a direct call raises what it would retry
            assert result == {"shard": shard_id, "dropped": True}
    finally:
        ShoalTask.reset_context()


def test_bad_search_params_and_gate_are_validation_errors_naming_them(local_shoal: Shoal) -> None:
    """search_params given as a list of pairs or a bare name, and a gate that is no number: a ValidationError
    (HTTP 400) naming the argument, not an AttributeError or TypeError (500); no job starts."""
    _setup(local_shoal, n=50)
    searcher = local_shoal.searcher(follow=False)
    try:
        query = np.zeros((1, DIM), dtype=np.float32)
        assert len(searcher.search("ix", "1", query, 3, search_params={"ef_search": 16})[0]) == 3
        for bad in ([("ef_search", 5)], "ef_search"):
            with pytest.raises(ValidationError, match="search_params must be a mapping"):
                searcher.search("ix", "1", query, 3, search_params=bad)
    finally:
        searcher.close()
    for gate in ("x", [0.9], True, float("nan"), 1.5):
        with pytest.raises(ValidationError, match="gate"):
            local_shoal.reindex("ix", "1", params={"M": 24}, gate=gate)  # type: ignore[arg-type]
    assert local_shoal.reindex_jobs("ix", "1") == []


def test_the_recall_gate_judges_small_norm_data_by_its_own_scale(local_shoal: Shoal) -> None:
    """The gate counted a hit within 1e-5 of the k-th exact distance, absolutely: on dot products of about 1e-11
    every hit passed, and an HNSW generation of real recall 0 was swapped in with recall 1.0. The tolerance now
    follows the vectors' magnitudes, so that reindex fails its gate; the same data at unit scale still passes."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal((2000, 16))
    for scale, expected in ((1e-6, "failed"), (1.0, "swapped")):
        name = f"G{int(scale == 1.0)}"
        local_shoal.create_data_source(DataSourceSpec(name, "1", 16, {"id": "int64"}, ["id"]))
        vectors = (base * scale).astype(np.float32)
        local_shoal.producer(name, "1").upload_columns(vectors, {"id": np.arange(2000)})
        local_shoal.create_index(IndexSpec(f"{name}I", "1", name, "1", algorithm="flat", metric="dot_product"))
        job = local_shoal.reindex(f"{name}I", "1", algorithm="hnsw", wait=True)
        assert job.state == expected, job


# -- vectors stored under the former norm bound (sqrt(float32 max) / 2, about 9.22e18) -----------------------------

# Past today's bound (MAX_NORM, about 6.52e18) and within the former one: a vector an earlier release stored.
FORMER = 8.5e18


def _store_unchecked(shoal: Shoal, name: str, rows: dict[int, np.ndarray]) -> None:
    """Commit `rows` (id -> vector) to the data source's log as an earlier release did: a validated batch whose
    vectors are then replaced, handed to the log writer (which appends batches validated before it), so the
    norm check of today's release never sees them."""
    record = shoal.get_data_source(name, "1")
    ids = np.array(sorted(rows), dtype=np.int64)
    vectors = np.stack([rows[i] for i in ids]).astype(np.float32)
    table = columns_to_table(record.spec, np.zeros_like(vectors), {"id": ids}, len(ids))
    flat = pa.array(vectors.reshape(-1), pa.float32())
    column = pa.FixedSizeListArray.from_arrays(flat, record.spec.vector_dimension)
    table = table.set_column(table.schema.get_field_index(VECTOR), table.schema.field(VECTOR), column)
    shoal.runtime.writer(record).submit(table)


def _former_bound_source(shoal: Shoal, algorithm: str) -> np.ndarray:
    """`_setup`'s source and index `ix`/`1` (built), plus point 10 at norm FORMER, stored unchecked and built
    into the index; returns that vector."""
    _setup(shoal, n=300, algorithm=algorithm)
    big = np.zeros(DIM, dtype=np.float32)
    big[0] = FORMER
    assert vector_problem(big, big) is not None  # no upload or query takes it today
    _store_unchecked(shoal, "docs", {10: big})
    builder = ShardBuilder(shoal.engine, shoal.storage)
    for shard in shoal.get_index("ix", "1").shards:
        builder.materialize(shard.id)
    return big


@pytest.mark.parametrize(("algorithm", "change"), [("flat", {"algorithm": "hnsw"}),
                                                   ("hnsw", {"params": {"M": 24, "ef_search": 64}})])
def test_a_reindex_over_a_vector_stored_under_the_former_bound_swaps_and_serves_it(
    local_shoal: Shoal, algorithm: str, change: dict[str, Any]
) -> None:
    """README: vectors stored under the former norm bound "stay stored and are still built into every index". The
    recall check sampled them as queries, which the query path refuses: the reindex raised ValidationError and its
    job stayed `building` for ever. Such a vector is left out of the sample (it cannot be a query); the reindex
    swaps, and the new generation serves the point."""
    big = _former_bound_source(local_shoal, algorithm)
    job = local_shoal.reindex("ix", "1", wait=True, **change)
    assert job.state == "swapped", job
    assert job.recall is not None and job.recall >= job.gate, job
    index = local_shoal.get_index("ix", "1")
    assert index.spec.algorithm == "hnsw" and index.spec.params["M"] == (24 if algorithm == "hnsw" else 16)
    near = big * np.float32(0.7)  # a query within today's bound, nearest to point 10
    searcher = local_shoal.searcher(follow=False)
    try:
        # Every other point is about 5.95e18 from the query, one float32 value: a walk of the graph sees them all
        # tied, so ef_search past the point count makes it visit every node rather than stop among the ties.
        hits = searcher.search("ix", "1", near[None, :], 3, search_params={"ef_search": 1024})[0]
    finally:
        searcher.close()
    assert hits[0].attributes["id"] == 10, list(hits)
    assert hits[0].distance == pytest.approx(FORMER * 0.3, rel=1e-6)


def test_a_vector_stored_under_the_former_bound_does_not_loosen_the_recall_gate(local_shoal: Shoal) -> None:
    """The gate's tolerance followed the largest norm stored: one vector of norm 8.5e18 made it about 1e13 for
    every query, and an HNSW graph of real recall about 0.2 passed as 1.0. It follows each query's own nearest
    rows now: the same graph fails the gate with or without that vector."""
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((4000, 64)).astype(np.float32)
    big = np.zeros(64, dtype=np.float32)
    big[0] = FORMER
    # A poor graph, yet connected enough that every search finds k rows (else hnsw answers by an exact scan).
    weak = {"M": 4, "ef_construction": 8, "ef_search": 10}
    for name, stored in (("Plain", {}), ("Former", {5000: big})):
        local_shoal.create_data_source(DataSourceSpec(name, "1", 64, {"id": "int64"}, ["id"]))
        local_shoal.producer(name, "1").upload_columns(vectors, {"id": np.arange(4000)})
        if stored:
            _store_unchecked(local_shoal, name, stored)
        local_shoal.create_index(IndexSpec(f"{name}I", "1", name, "1", algorithm="flat", metric="euclidean"))
        job = local_shoal.reindex(f"{name}I", "1", algorithm="hnsw", params=weak, wait=True)
        assert job.state == "failed" and job.recall is not None and job.recall < 0.5, (name, job)


def test_a_reindex_whose_build_refuses_the_data_fails_its_job_and_a_new_one_starts(local_shoal: Shoal) -> None:
    """`reindex(..., wait=True)` to IVF over a row faiss's k-means cannot take (norm 1e19, past even the former
    bound; it stands for any input a step refuses the same way every time): the ValidationError escaped, the job
    stayed `building` and every later reindex of the index was a 409. The job now fails with the error recorded,
    the old generation serving; once the row is re-uploaded scaled down, a new reindex is accepted and swaps."""
    _setup(local_shoal, n=200, algorithm="flat")
    past = np.zeros(DIM, dtype=np.float32)
    past[0] = 1e19
    _store_unchecked(local_shoal, "docs", {10: past})
    job = local_shoal.reindex("ix", "1", algorithm="ivf", wait=True)
    assert job.state == "failed", job
    assert job.error is not None and "ValidationError" in job.error and "vector norm 1e+19" in job.error, job
    assert local_shoal.get_index("ix", "1").spec.algorithm == "flat"  # the old generation serves
    assert [j.state for j in local_shoal.reindex_jobs("ix", "1")] == ["failed"]

    local_shoal.producer("docs", "1").upload([DataPoint({"id": 10}, (past / np.float32(1e10)).tolist())])
    again = local_shoal.reindex("ix", "1", algorithm="ivf", wait=True)
    assert again.state == "swapped", again
    assert local_shoal.get_index("ix", "1").spec.algorithm == "ivf"


def _damage_segments(shoal: Shoal) -> dict[str, bytes]:
    """Flip a byte in the middle of each of the data source's log segment files; their paths and good bytes."""
    saved = {}
    for segment in shoal.log_segments("docs", "1"):
        path = shoal.storage.path(segment.path)
        with open(path, "rb") as f:
            saved[path] = f.read()
        data = bytearray(saved[path])
        data[len(data) // 2] ^= 0xFF
        with open(path, "wb") as f:
            f.write(bytes(data))
    return saved


def test_a_reindex_step_failing_the_same_way_every_time_fails_its_job_in_a_worker(  # type: ignore[no-untyped-def]
    make_settings, redis_url
) -> None:
    """A worker steps a job whose generation is built, while the log it checks recall against is damaged
    (CorruptSegmentError on every read): the step was retried every 10 s for ever, the job `building` with no
    error and every new reindex a 409. The job now fails with the error recorded, the old generation serving;
    once the log is repaired, a new reindex is accepted and the worker swaps it in."""
    from conftest import start_worker, stop_process, wait_for

    from shoal.workers.names import QUEUE, REINDEX
    from shoal.workers.triggers import producer_app

    settings = make_settings("local", redis_url=redis_url)
    with Shoal(settings, notify=False) as shoal:
        _setup(shoal, n=200)
        job = start_reindex(shoal.catalog, shoal.indexes, "ix", "1", params={"M": 24})
        builder = ShardBuilder(shoal.engine, shoal.storage)
        for shard in _generation(shoal, job).shards:  # built: the worker's step goes on to check recall
            builder.materialize(shard.id)
        saved = _damage_segments(shoal)
        worker = start_worker(settings)
        try:
            producer_app(shoal.broker_url()).send_task(REINDEX, args=[job.id], queue=QUEUE)

            def ended() -> bool:
                return shoal.generations.job(job.id).state != "building"

            wait_for(ended, 60, "the worker to end the reindex job")
            failed = shoal.generations.job(job.id)
            assert failed.state == "failed", failed
            assert failed.error is not None and "CorruptSegmentError" in failed.error, failed
            assert "is corrupt" in failed.error, failed
            assert shoal.get_index("ix", "1").spec.params["M"] == 16  # the old generation serves

            for path, data in saved.items():  # the operator restores the log
                with open(path, "wb") as f:
                    f.write(data)
            second = shoal.reindex("ix", "1", params={"M": 24})  # accepted: no 409
            assert second.id != job.id and second.state == "building", second

            def swapped() -> bool:
                return shoal.generations.job(second.id).state != "building"

            wait_for(swapped, 120, "the worker to end the second reindex job")
            assert shoal.generations.job(second.id).state == "swapped", shoal.generations.job(second.id)
            assert shoal.get_index("ix", "1").spec.params["M"] == 24
        finally:
            stop_process(worker)


def test_a_job_whose_steps_keep_failing_fails_once_past_its_timeout(local_shoal: Shoal) -> None:
    """README: "A job still building 24 h after it started fails". The timeout was checked only while the new
    generation lagged: a built one whose recall check raised (here its files are missing, an error a later step
    may not meet) was stepped for ever. Such an error leaves the job building; past the timeout it fails the job,
    the error recorded, and a new reindex starts."""
    from shoal.errors import CorruptArtifactError
    from shoal.index.builder import shard_dir

    _setup(local_shoal, n=100)
    job = start_reindex(local_shoal.catalog, local_shoal.indexes, "ix", "1", params={"M": 24})
    generation = _generation(local_shoal, job)
    builder = ShardBuilder(local_shoal.engine, local_shoal.storage)
    for shard in generation.shards:
        builder.materialize(shard.id)
    folder = Path(local_shoal.storage.path(shard_dir(generation, generation.shards[0], generation.generation)))
    folder.rename(folder.with_name(folder.name + ".away"))

    def queue(index: IndexRecord) -> None:  # built already: nothing to queue
        pass

    with pytest.raises(CorruptArtifactError):
        reindex_step(local_shoal.engine, local_shoal.storage, job.id, build=queue)
    assert local_shoal.reindex_jobs("ix", "1")[0].state == "building"  # carried on: the files may come back
    outcome = reindex_step(local_shoal.engine, local_shoal.storage, job.id, build=queue, timeout_s=0.0)
    assert outcome.state == "failed", outcome
    assert outcome.error is not None and "CorruptArtifactError" in outcome.error, outcome
    assert [(j.state, j.error) for j in local_shoal.reindex_jobs("ix", "1")] == [("failed", outcome.error)]
    assert local_shoal.reindex("ix", "1", params={"M": 32}, wait=True).state == "swapped"
