"""Reindex and shard builds at their edges: a reindex's generation is built at the params asked for (never as a
quick graph), swaps in while ingest goes on, is judged against what each shard reflects, and starts once
however many calls race; a build of a dropped shard ends instead of retrying; bad arguments are 400s."""

from __future__ import annotations

import threading
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
