"""Reindex as a managed job: build a new generation aside, catch up, check recall, swap atomically.

1. `start_reindex` records the job and creates the new generation (an index row under a hidden version, with
   its own empty shards); commits and the sweep queue its materialization like any other index's.
2. `reindex_step` does one bounded step of the job: it gets the new generation built toward the head (the
   Celery task queues the shards' materialization; `run_reindex`, the in-process driver, builds them
   itself), records progress and ETA, and returns while the generation still lags; the task then queues
   itself again a few seconds later, so no run outlives the broker's visibility timeout. Once every shard's
   watermark reached the head the previous step saw, the step measures recall@k of the new generation against
   exact search (each shard at its own watermark) on a sample of stored vectors and swaps it in only when the
   recall meets the job's gate.
   The swap renames two catalog rows in one transaction; searchers load the new generation whole, then
   replace their view of the index in one step, so every answer comes from one generation.
   Stored vectors a query may not carry (written under the former norm bound) are left out of that sample.
3. A failed or cancelled job leaves the old generation serving and drops its own rows and files; the old
   generation of a swapped job is kept for `rollback` until `drop_expired_generations` removes it. A step that
   fails in a way every later step would repeat (bad input, a damaged file) fails its job, the error recorded.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import numbers
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
from sqlalchemy import Engine, func, insert, select
from sqlalchemy.orm import Session

from shoal.catalog.indexes import IndexCatalog, IndexRecord, ShardCatalog, insert_index_rows
from shoal.catalog.models import DataSource, Index, LogSegment, ReindexJob
from shoal.catalog.repo import Catalog, SourceRecord
from shoal.engines import get_engine
from shoal.engines.metrics import exact_top_k, higher_is_nearer
from shoal.errors import (
    ConflictError,
    CorruptSegmentError,
    IndexDefinitionError,
    NotFoundError,
    ReindexConflictError,
    ValidationError,
)
from shoal.index.builder import LeaseBusyError, ShardBuilder
from shoal.index.generations import HIDDEN, Generations, JobRecord, generation_ids, hidden_version, is_hidden
from shoal.index.segment import vectors_of
from shoal.index.segment_cache import SegmentCache
from shoal.index.sharding import shard_numbers
from shoal.index.spec import resolve_index, vektonn_metric_problem
from shoal.log.reader import fold, read_log
from shoal.log.records import IndexSpec
from shoal.log.validation import SEQ, unfit_rows
from shoal.searcher.execute import execute, prepare_queries
from shoal.searcher.views import IndexView, load_shard
from shoal.storage import Storage
from shoal.upkeep import drops
from shoal.vektonn.algorithms import VEKTONN_TYPES

log = logging.getLogger(__name__)

EXACT_ALGORITHMS = ("flat", "flat_sparse")
# The longest version the catalog holds (indexes.version): a generation's hidden `{version}~g{n}` must fit too.
MAX_VERSION: int = Index.__table__.c.version.type.length  # type: ignore[attr-defined]


def start_reindex(
    catalog: Catalog,
    indexes: IndexCatalog,
    name: str,
    version: str,
    *,
    algorithm: str | None = None,
    metric: str | None = None,
    params: dict[str, Any] | None = None,
    gate: float | None = None,
    ann_gate: float = 0.95,
) -> JobRecord:
    """Record a reindex of the index (name, version) with a new algorithm, metric or params (each defaults to
    the current one) and create its generation; ReindexConflictError if one is running already, also when
    another call starts one at the same moment (exactly one of them starts a job). A metric given beside a
    Vektonn type (FaissIndex.L2) must be the type's own, as on create: any other is refused (IndexDefinitionError,
    nothing started), never replaced by the type's."""
    if algorithm is not None and metric is not None:
        problem = vektonn_metric_problem(algorithm, metric)  # explicit: the caller named this metric
        if problem is not None:
            raise IndexDefinitionError([problem])
    gens = Generations(indexes.engine)
    current = indexes.get_index(name, version)
    if gens.running(indexes.tenant_id, name, version) is not None:  # the usual answer, without a lock
        raise ReindexConflictError(f"index {name!r} version {version!r} is being reindexed already")
    source = catalog.get_data_source(current.spec.source_name, current.spec.source_version)
    changes: dict[str, Any] = {}
    same_algorithm = algorithm is None or algorithm == current.spec.algorithm
    if not same_algorithm:
        changes["algorithm"] = algorithm
        changes["params"] = {}  # the old algorithm's params may not apply to the new one
        if metric is None and isinstance(algorithm, str) and algorithm in VEKTONN_TYPES:
            # A Vektonn type carries its metric (FaissIndex.IP: dot_product): the index's own is not inherited,
            # or resolve_index would refuse the pair as a contradiction the caller never made.
            changes["metric"] = VEKTONN_TYPES[algorithm][1].value
    if metric is not None:
        changes["metric"] = metric
    if params is not None:
        # With the algorithm kept, the params given change those the index has (`--param M=32` changes M alone:
        # HNSW takes its params all or none); a new algorithm takes only what is given, the rest its defaults.
        changes["params"] = {**current.spec.params, **params} if same_algorithm else _over_defaults(algorithm, params)
    resolved = resolve_index(dataclasses.replace(current.spec, **changes), source.spec)
    if gate is None:
        gate = 1.0 if resolved.algorithm in EXACT_ALGORITHMS else ann_gate
    if isinstance(gate, bool) or not isinstance(gate, numbers.Real) or not 0.0 <= gate <= 1.0:
        raise ValidationError(f"recall gate must be a number between 0 and 1 (got gate={gate!r})")
    job_id = _start_job(indexes, current, resolved, float(gate))
    return gens.job(job_id)


def _over_defaults(algorithm: Any, params: Mapping[str, Any]) -> dict[str, Any]:
    """`params` over the defaults of the new `algorithm`, so that a reindex to HNSW with `M=32` alone takes 32 and
    the default ef_construction and ef_search (a definition made with HNSW must give all three or none). A Vektonn
    type keeps Vektonn's rule (its `Hnsw_*` params all or none) and an unknown algorithm is left for resolve_index
    to name: both take `params` as given."""
    if not params or not isinstance(algorithm, str) or algorithm in VEKTONN_TYPES:
        return dict(params)
    try:
        defaults = get_engine(algorithm).normalize_params(None)
    except ValidationError:
        return dict(params)
    return {**defaults, **dict(params)}


def _start_job(indexes: IndexCatalog, current: IndexRecord, resolved: IndexSpec, gate: float) -> int:
    """Create the new generation (index row and shards) and its job in one transaction that holds the serving
    index row's lock (SELECT ... FOR UPDATE), so concurrent starts run one after the other: the first records
    its job, the next finds it building and gets ReindexConflictError (not both a job, nor the hidden name the
    first one took). Returns the job id."""
    name, version = current.spec.name, current.spec.version
    with Session(indexes.engine) as s, s.begin():
        # The source row first (FOR KEY SHARE, what the new index row's foreign key takes anyway), then the
        # index row: the order swaps and soft deletes take them in, so a start racing one waits, not deadlocks.
        s.execute(select(DataSource.id).where(DataSource.id == current.source_id)
                  .with_for_update(read=True, key_share=True))
        row = s.execute(select(Index.id, Index.created_at).where(
            Index.tenant_id == indexes.tenant_id, Index.name == name, Index.version == version,
            Index.deleted_at.is_(None),
        ).with_for_update()).one_or_none()
        if row is None:
            raise NotFoundError(f"index {name!r} version {version!r} not found in tenant {indexes.tenant!r}")
        serving = row.id
        if serving != current.id:  # swapped or dropped and made again since it was read
            raise ReindexConflictError(f"index {name!r} version {version!r} changed meanwhile; try again")
        # A job of this index's generations (not one of a dropped index that had the name: not this one's).
        ids = generation_ids(s, serving)
        if s.scalar(select(ReindexJob.id).where(
            ReindexJob.tenant_id == indexes.tenant_id, ReindexJob.state == "building",
            ReindexJob.from_index_id.in_(ids) | ReindexJob.to_index_id.in_(ids),
        ).limit(1)) is not None:
            raise ReindexConflictError(f"index {name!r} version {version!r} is being reindexed already")
        top = s.scalar(select(func.max(Index.generation)).where(
            Index.tenant_id == indexes.tenant_id, Index.name == name,
            (Index.version == version) | Index.version.startswith(version + HIDDEN, autoescape=True),
        ))
        generation = int(top or 0) + 1
        hidden = hidden_version(version, generation)
        if len(hidden) > MAX_VERSION:  # refused before anything is written: the column cannot hold it
            raise ValidationError(
                f"index {name!r} version {version!r} is too long to reindex: its generation {generation} would "
                f"be kept under the version '<version>{HIDDEN}{generation}', {len(hidden)} characters, over the "
                f"limit of {MAX_VERSION}; a version of at most {MAX_VERSION - len(hidden) + len(version)} "
                f"characters can be reindexed to generation {generation}"
            )
        spec = dataclasses.replace(resolved, version=hidden)
        # The generation keeps the index's creation time (every generation of the index carries it): the jobs of
        # an index dropped before it was made are told from its own by it (generations._of_lineage).
        new_id = insert_index_rows(s, indexes.tenant_id, current.source_id, spec, generation,
                                   created_at=row.created_at)
        if new_id is None:  # a leftover row holds the name: refuse rather than reuse it
            raise ReindexConflictError(f"index {name!r} version {version!r}: generation {generation} exists "
                                       "already; try again once the sweep removed it")
        definition = {"algorithm": spec.algorithm, "metric": spec.metric, "params": dict(spec.params),
                      "generation": generation}
        job_id = s.scalar(insert(ReindexJob).values(
            tenant_id=indexes.tenant_id, index_name=name, index_version=version, from_index_id=current.id,
            to_index_id=new_id, state="building", progress=0.0, gate=gate, definition=definition,
        ).returning(ReindexJob.id))
    return int(job_id)


@dataclasses.dataclass(frozen=True)
class ReindexOutcome:
    """Where a reindex stands after a step, or how it ended."""

    job_id: int
    state: str  # building (not finished: run another step) | swapped | failed | cancelled | rolled_back
    recall: float | None
    error: str | None = None

    @property
    def finished(self) -> bool:
        """Whether the job ended (nothing more to run)."""
        return self.state != "building"


# Errors a reindex step meets again on every run, however long it waits: its job then fails with the error
# recorded (the old generation keeps serving) instead of being stepped again every few seconds for ever, which
# also refused every new reindex of the index (409). Outages (the catalog, storage or broker away, a lost race:
# shoal.workers.base.TRANSIENT) and other OSErrors (a full disk) are not here: a later step may pass. Nor is
# CorruptArtifactError: the generation's own files, which a later build may replace, are carried on as missing
# for a while (tests/test_worker_races.py); a log segment is the data itself, and nothing mends one.
DETERMINISTIC_ERRORS: tuple[type[Exception], ...] = (
    ValidationError,  # the stored data or the definition breaks a rule (a build, a recall query refused)
    CorruptSegmentError,  # a log segment missing or damaged: every build and recall check reads it
    # A bug: the same code on the same data fails the same way.
    TypeError,
    ValueError,
    LookupError,
    ArithmeticError,
    AttributeError,
    NotImplementedError,
)

# How a step gets the new generation's shards built: `materialize_inline` (in this process) or a function that
# queues their materialization for the workers.
Build = Callable[[IndexRecord], None]


def materialize_inline(builder: ShardBuilder) -> Build:
    """Build every shard of the generation in this process, leaving the shards another worker is building
    right now (it holds the lease; commits and the sweep queue them too) for a later step."""

    def build(index: IndexRecord) -> None:
        for shard in index.shards:
            try:
                builder.materialize(shard.id)
            except LeaseBusyError:
                pass
            except NotFoundError:  # the generation is gone (cancelled, index dropped): the step finds out why
                return

    return build


def reindex_step(
    engine: Engine,
    storage: Storage,
    job_id: int,
    *,
    build: Build,
    sample: int = 200,
    k: int = 10,
    timeout_s: float = 24 * 3600,
    on_swap: Callable[[IndexRecord], None] | None = None,
) -> ReindexOutcome:
    """One bounded step of the job: get the new generation built up to the head (`build`), record its
    progress and ETA; once it caught up, check recall and swap it in (or fail, if below the gate). Returns
    state `building` when the generation still lags (run another step later), or how the job ended. Never
    waits. Idempotent: a job that ended returns its outcome; a job older than `timeout_s` that still lags fails.
    An error every later step would meet again (DETERMINISTIC_ERRORS), or any error once the job is older than
    `timeout_s`, fails the job with the error recorded; any other error is raised, the job still building.
    """
    gens = Generations(engine)
    job = gens.job(job_id)
    if job.state != "building":
        return ReindexOutcome(job_id, job.state, job.recall, job.error)
    shards = ShardCatalog(engine)
    try:
        new, source = _generation(engine, job)
        if not _advance(gens, build, job, new, timeout_s):
            return ReindexOutcome(job_id, "building", None)
        if gens.job(job_id).state != "building":
            return _abandon(engine, storage, gens, job, "cancelled", None, "cancelled while building")
        recall = measure_recall(storage, shards, new, source, sample=sample, k=k)
    except ReindexConflictError as exc:
        return _abandon(engine, storage, gens, job, "failed", None, str(exc))
    except Exception as exc:
        if not _ends_the_job(exc, job, timeout_s):
            raise  # transient (the catalog, storage or broker away): the next step or Celery's retry tries again
        return _abandon(engine, storage, gens, job, "failed", None,
                        f"a step failed: {type(exc).__name__}: {exc}; the old generation keeps serving")
    if recall is not None and recall < job.gate:
        return _abandon(engine, storage, gens, job, "failed", recall,
                        f"recall@{k} {recall:.4f} below the gate {job.gate:.4f}: the old generation keeps serving")
    try:
        gens.swap(job_id, recall if recall is not None else 1.0)
    except ConflictError:  # lost the swap's compare-and-swap: the job says why
        now = gens.job(job_id)
        state = now.state
        if state == "swapped":  # another run of this job (a redelivered task) swapped first
            return ReindexOutcome(job_id, "swapped", now.recall)
        if state == "cancelled":
            return _abandon(engine, storage, gens, job, "cancelled", recall, "cancelled before the swap")
        return _abandon(engine, storage, gens, job, "failed", recall,
                        "the index changed while the new generation was built (dropped or reindexed)")
    log.info("reindex %s of %s/%s swapped in generation %s (recall %s)", job_id, job.index_name,
             job.index_version, job.definition.get("generation"), recall)
    refresh_dataset_mirror(engine, storage, source.id)
    if on_swap is not None:
        on_swap(new)
    return ReindexOutcome(job_id, "swapped", recall)


def _ends_the_job(exc: Exception, job: JobRecord, timeout_s: float) -> bool:
    """Whether a step that raised `exc` ends the job as failed: the error is one every later step would meet
    again (DETERMINISTIC_ERRORS), or the job is older than `timeout_s` (a job still building then fails, whatever
    keeps its steps from finishing). Any other error leaves the job building for the next step."""
    if isinstance(exc, DETERMINISTIC_ERRORS):
        return True
    return (dt.datetime.now(dt.UTC) - job.created_at).total_seconds() > timeout_s


def refresh_dataset_mirror(engine: Engine, storage: Storage, source_id: int) -> None:
    """After a swap (or a rollback) of a dataset's index: write its `dataset_metadata.json` again, so the file
    shows the index type and params serving now. Every swap passes through `reindex_step`, whichever process
    runs it (a worker or `Shoal.reindex(wait=True)`), so this is the one place that sees them all. Best effort
    (never raises); nothing happens for a data source that is no dataset."""
    from shoal.datasets.files import refresh_mirror  # the dataset API's own file: loaded only when needed

    refresh_mirror(engine, storage, source_id)


def run_reindex(
    engine: Engine,
    storage: Storage,
    job_id: int,
    *,
    builder: ShardBuilder | None = None,
    sample: int = 200,
    k: int = 10,
    timeout_s: float = 24 * 3600,
    on_swap: Callable[[IndexRecord], None] | None = None,
    poll_s: float = 0.2,
) -> ReindexOutcome:
    """Run the job to its end in this process (`Shoal.reindex(wait=True)`): steps that build the shards here,
    `poll_s` apart while another worker holds a shard's lease (idempotent: a job that ended returns its
    outcome)."""
    build = materialize_inline(builder or ShardBuilder(engine, storage))
    while True:
        outcome = reindex_step(engine, storage, job_id, build=build, sample=sample, k=k, timeout_s=timeout_s,
                               on_swap=on_swap)
        if outcome.finished:
            return outcome
        time.sleep(poll_s)  # another worker holds a shard's lease: check again shortly


def _generation(engine: Engine, job: JobRecord) -> tuple[IndexRecord, SourceRecord]:
    found = ShardCatalog(engine).index_by_id(job.to_index_id) if job.to_index_id is not None else None
    if found is None:
        raise ReindexConflictError("the new generation is gone")
    _, index, source = found
    return index, source


def _advance(gens: Generations, build: Build, job: JobRecord, new: IndexRecord, timeout_s: float) -> bool:
    """Build toward the head once and record progress and ETA (from the job's age); True when the lowest
    built watermark reached the head as it stood when the previous step recorded its progress (the job's
    `updated_at`; at the first step, when the job started), or the job ended meanwhile; False while it lags
    behind that. ReindexConflictError once the job is older than `timeout_s` and still lags."""
    built, head = gens.shard_progress(new.id)
    # Not the head read now: under steady ingest it moves on while the workers build, so a generation they
    # build never reaches the head of the step that judges it. The previous step's head stays put, and a
    # generation that keeps up with the ingest passes it by the next step: it swaps in at most about one
    # step's ingest behind. Nothing acknowledged goes missing by that: searchers answer `strong` and
    # `at_least` with an exact scan of the log past the served watermark, `eventual` from their young tier.
    target = min(head, _head_at(gens.engine, new.source_id, job.updated_at))
    if built < head:
        build(new)
        built, _ = gens.shard_progress(new.id)
    elapsed = max(0.0, (dt.datetime.now(dt.UTC) - job.created_at).total_seconds())
    progress = 1.0 if head == 0 else min(1.0, built / head)
    eta = elapsed / progress * (1 - progress) if progress > 0 else None
    gens.set_progress(job.id, progress, eta)
    if built >= target:
        return True
    if gens.job(job.id).state != "building":
        return True
    if elapsed > timeout_s:
        raise ReindexConflictError(f"the new generation did not catch up within {timeout_s:.0f} s")
    return False


def _head_at(engine: Engine, source_id: int, when: dt.datetime) -> int:
    """The data source's head as it stood at `when`, by the catalog's clock (the one that stamps commits and
    jobs): the last seq of the newest log segment committed by then. Compacted segments keep their oldest
    stamp, which can only make this later (and they lie below every watermark anyway)."""
    with Session(engine) as s:
        top = s.scalar(select(func.max(LogSegment.last_seq)).where(
            LogSegment.data_source_id == source_id, LogSegment.committed_at <= when,
        ))
    return int(top or 0)


def measure_recall(
    storage: Storage, shards: ShardCatalog, index: IndexRecord, source: SourceRecord, *, sample: int, k: int
) -> float | None:
    """recall@k of the index's active versions against exact search over what they reflect (each shard's
    part of the log folded at that shard's watermark: the workers build shards at different heads), on up
    to `sample` stored vectors as queries. A hit counts when its distance is within the exact k-th distance
    (so ties cannot make an exact engine look inexact). None for sparse sources."""
    if source.spec.vectors_are_sparse:
        return None
    cache = SegmentCache(keep_unheld=True)
    views = []
    for shard in index.shards:
        active = shards.active_version(shard.id)
        views.append(load_shard(storage, cache, index, shard.id, shard.shard_no, active))
    view = IndexView(index, source, tuple(views))
    watermarks = {v.shard_no: v.watermark for v in view.shards}
    top = max(watermarks.values(), default=0)
    if top == 0:
        return 1.0
    entries: Iterable[pa.RecordBatch] = read_log(shards.engine, storage, source.id, 0, top)
    if len(set(watermarks.values())) > 1:
        entries = _at_shard_watermarks(entries, index.spec, watermarks)
    state = fold(entries)
    if state.num_rows == 0:
        return 1.0
    vectors = vectors_of(state, False, source.spec.vector_dimension)
    pool = _queryable_rows(vectors)
    if not pool.size:  # no stored vector can be a query: nothing to measure, as for an empty index
        return 1.0
    rng = np.random.default_rng(20261122)
    rows = rng.choice(pool, size=min(sample, pool.size), replace=False)
    queries = prepare_queries(source.spec, vectors[rows])
    kk = min(k, len(vectors))
    exact, nearest = exact_top_k(index.spec.metric, queries, vectors, kk)
    hits = execute(view, queries, kk, lambda values: True, {}, False)
    higher = higher_is_nearer(index.spec.metric)
    scales = _distance_scales(index.spec.metric, np.asarray(queries, dtype=np.float64), vectors, nearest)
    found = 0
    for bound, scale, qhits in zip(exact[:, -1], scales, hits, strict=True):
        # A hit counts when within float32 rounding of the k-th exact distance. Rounding scales with the vectors'
        # magnitudes, not with 1: an absolute floor counted every hit on data of small norms (dot products of
        # 1e-11, where an HNSW graph of recall 0 passed the gate).
        tol = 1e-5 * max(float(scale), abs(float(bound)))
        found += sum(1 for h in qhits if (h.distance >= bound - tol if higher else h.distance <= bound + tol))
    return found / (len(rows) * kk)


def _queryable_rows(vectors: np.ndarray) -> np.ndarray:
    """Positions of the rows of float32 [n, d] `vectors` a query may carry (`unfit_rows`, the query path's own
    check, finds none of them wrong). Rows stored under the former norm bound, past today's (README: they stay
    stored and are built into every index), are searched against but never sampled: the query path refuses them,
    and measuring recall with one failed the reindex step on every run."""
    everything = np.arange(len(vectors))
    unfit = unfit_rows(vectors)
    return np.delete(everything, unfit) if unfit.size else everything


def _distance_scales(metric: str, queries: np.ndarray, vectors: np.ndarray, nearest: np.ndarray) -> np.ndarray:
    """Per query, the magnitude a distance's float32 rounding error is relative to under `metric`: 1 for cosine,
    the product of the norms for a dot product, their squares' sum for l2_squared, and so on; of the query's norm
    and the largest norm among its exact k nearest rows (`nearest`: row positions, -1 for padding), the rows
    whose distances the k-th exact one is compared with."""
    q = np.linalg.norm(queries, axis=1)
    # The query's own neighbours, not the largest norm stored: one vector stored under the former norm bound
    # (8.5e18) made the tolerance of every query some 1e13, and an HNSW graph of recall 0.04 passed the gate.
    wide = vectors.astype(np.float64)
    norms = np.sqrt(np.einsum("ij,ij->i", wide, wide))
    v = np.where(nearest >= 0, norms[np.maximum(nearest, 0)], 0.0).max(axis=1, initial=0.0)
    if metric == "cosine":
        return np.ones_like(q)
    if metric == "dot_product":
        return q * v
    if metric == "l2_squared":
        return q * q + v * v
    return (q + v) * (np.sqrt(queries.shape[1]) if metric == "manhattan" else 1.0)


def _at_shard_watermarks(
    batches: Iterable[pa.RecordBatch], spec: IndexSpec, watermarks: Mapping[int, int]
) -> Iterator[pa.RecordBatch]:
    """The log entries the shards' versions reflect: each entry of shard n up to n's watermark (an entry and
    the tombstone of its key land on one shard, so this folds to every shard's state at its own watermark)."""
    limits = np.array([watermarks.get(n, 0) for n in range(spec.shard_count)], dtype=np.int64)
    for batch in batches:
        table = pa.Table.from_batches([batch])
        shard = shard_numbers(table, spec.shard_attributes, spec.shard_count)
        keep = table[SEQ].to_numpy() <= limits[shard]
        yield from table.filter(pa.array(keep)).to_batches()


def _abandon(
    engine: Engine, storage: Storage, gens: Generations, job: JobRecord, state: str, recall: float | None, error: str
) -> ReindexOutcome:
    """End the job as failed or cancelled and drop its generation (rows, then files)."""
    gens.finish(job.id, state, recall=recall, error=error)
    drop_generation(engine, storage, job.to_index_id)
    log.warning("reindex %s of %s/%s %s: %s", job.id, job.index_name, job.index_version, state, error)
    return ReindexOutcome(job.id, state, recall, error)


def drop_generation(engine: Engine, storage: Storage, index_id: int | None) -> int:
    """Drop a generation that does not serve: its catalog rows go and its files are queued for GC in one
    transaction, then the files are deleted through GC's checked deletion; returns how many files were
    queued. Serving generations are refused. Due at once (`shoal.upkeep.drops`): a failed or cancelled
    generation never served, and a replaced one has not served since its swap, SHOAL_REINDEX_KEEP_S ago."""
    found = ShardCatalog(engine).index_by_id(index_id) if index_id is not None else None
    if found is None:
        return 0
    _, index, _ = found
    if not is_hidden(index.spec.version):
        raise ReindexConflictError(f"generation {index_id} serves index {index.spec.name!r}: not dropped")
    try:
        paths = drops.drop_index(engine, index.id, reason=drops.GENERATION_DROPPED,
                                 delete_after=dt.datetime.now(dt.UTC), version=index.spec.version)
    except NotFoundError:  # dropped meanwhile (a redelivered task, the sweep), or swapped in: not dropped
        return 0
    # A crash from here on leaves the files queued: the next GC run deletes them.
    drops.delete_now(engine, storage, paths, reason=drops.GENERATION_DROPPED)
    log.info("dropped generation %s of index %s (%s, %d files)", index_id, index.spec.name, index.spec.version,
             len(paths))
    return len(paths)


def drop_expired_generations(engine: Engine, storage: Storage, keep_s: float, tenant_id: int | None = None) -> int:
    """Drop generations kept for rollback longer than `keep_s`, and leftovers of failed or cancelled jobs (of
    one tenant when `tenant_id` is given); how many. A generation of an index in the trash stays with it."""
    dropped = 0
    for index_id, *_ in Generations(engine).expired_generations(keep_s, tenant_id):
        drop_generation(engine, storage, index_id)
        dropped += 1
    return dropped
