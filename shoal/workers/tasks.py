"""Celery tasks: materialize and merge index shards, the beat sweeps that queue them, the log's upkeep and
reindex jobs. Tasks take ids, are idempotent, acknowledge late and retry only named transient errors (see
ShoalTask, their base, which also holds the process's context); their names are in shoal.workers.names."""

from __future__ import annotations

import logging
from typing import Any

from shoal.errors import CommitError, LeaseBusyError, NotFoundError
from shoal.log import compaction, retention
from shoal.upkeep import gc
from shoal.workers.app import app
from shoal.workers.base import LEASE_RETRY_MARGIN_S, ShoalTask
from shoal.workers.context import WorkerContext
from shoal.workers.names import (
    APPLY_RETENTION,
    CHECK_REBUILD,
    COLLECT_GARBAGE,
    COMPACT_LOG,
    MATERIALIZE_SHARD,
    MERGE_SHARD,
    PURGE_TRASH,
    REINDEX,
    SWEEP,
    SWEEP_COMPACTION,
    SWEEP_GENERATIONS,
    SWEEP_MERGES,
)
from shoal.workers.triggers import enqueue, keep_pending, mark_pending, notify_indexers, started

log = logging.getLogger(__name__)

# A reindex job's task runs one bounded step, then queues the next this many seconds later while it lags.
REINDEX_STEP_DELAY_S = 2.0
# After a step that raised an error Celery does not retry (one that is neither transient nor deterministic, such as a
# full disk, or a transient one past the retries; a deterministic one fails the job instead, in reindex_step),
# the next step runs this many seconds later: soon enough that the job does not wait for sweep_generations' stall
# detection (10 minutes), late enough that a fault that persists does not fail a step every REINDEX_STEP_DELAY_S.
REINDEX_FAILED_STEP_DELAY_S = 10.0


@app.task(base=ShoalTask, bind=True, name=MATERIALIZE_SHARD)
def materialize_shard(self: ShoalTask, shard_id: int) -> dict[str, Any]:
    """Bring one index shard up to its data source's head; queue a merge when the policy asks for one.

    While another live process holds the shard's lease (builds it), at most one materialization of the shard waits
    for it: the first to find it busy keeps the shard's pending mark until Celery's retry runs it again, so
    commits and sweeps meanwhile queue nothing; any other ends at once as `{'shard': N, 'busy': True}`."""
    ctx = self.context
    rt = ctx.runtime
    started(rt.redis(), MATERIALIZE_SHARD, shard_id)
    try:
        result = ctx.builder.materialize(shard_id)
    except NotFoundError:
        log.info("shard %s is gone (index dropped); nothing to do", shard_id)
        return {"shard": shard_id, "dropped": True}
    except LeaseBusyError as exc:
        # The holder is alive (a dead process's lease is taken over at once) and may have read the head before
        # the commit this task is for, so the shard is built again after it: by this task's retry when this task
        # sets the mark; else by the task that set it (queued, or retrying as this one would), which runs after
        # this moment. A task Celery will not retry (out of retries) fails as before and sets no mark: the next
        # commit or sweep queues the shard again.
        if _celery_retries(self, exc) and not mark_pending(
            rt.redis(), MATERIALIZE_SHARD, shard_id, rt.settings.pending_ttl_s + _retry_wait_bound(self, exc)
        ):
            log.info("index shard %s is being built elsewhere and another task is pending for it; this one ends",
                     shard_id)
            return {"shard": shard_id, "busy": True}
        raise
    _queue_merge_if_due(ctx, shard_id)
    return {"shard": shard_id, "version": result.version_id, "watermark": result.watermark, "changed": result.changed}


def _retry_wait_bound(task: ShoalTask, exc: LeaseBusyError) -> float:
    """The longest Celery's retry of `task` after `exc` waits before it runs: the backoff's cap, or less when the
    holder's lease ends sooner (ShoalTask.retry). A retry's pending mark lasts this much longer than a queued
    task's, as `enqueue`'s does with a countdown."""
    wait = float(task.retry_backoff_max)
    if exc.retry_in is not None:
        wait = min(wait, max(exc.retry_in, 0.0) + LEASE_RETRY_MARGIN_S)
    return wait


def _queue_merge_if_due(ctx: WorkerContext, shard_id: int) -> bool:
    """Queue a merge of the shard when the policy asks for one now (True), else a rebuild check for later."""
    if ctx.builder.needs_merge(shard_id):
        enqueue(ctx.runtime.redis(), app, MERGE_SHARD, shard_id, ctx.runtime.settings.pending_ttl_s)
        return True
    _look_again_for_rebuild(ctx, shard_id)
    return False


def _look_again_for_rebuild(ctx: WorkerContext, shard_id: int) -> None:
    """Queue a rebuild check `quick_window_s` from now when the shard holds quick segments (coalesced: one per
    shard): once ingest slows, no build runs to notice that they are due."""
    rt = ctx.runtime
    if rt.settings.quick_window_s > 0 and ctx.builder.owes_rebuild(shard_id):
        enqueue(rt.redis(), app, CHECK_REBUILD, shard_id, rt.settings.pending_ttl_s,
                countdown=rt.settings.quick_window_s)


@app.task(base=ShoalTask, bind=True, name=CHECK_REBUILD)
def check_rebuild(self: ShoalTask, shard_id: int) -> dict[str, Any]:
    """Queue the merge that rebuilds the shard's quick segments at full quality once they are due (ingest
    slowed below the quick window's rate); while they are not, look again a window later. Without it the
    rebuild would wait for beat's merge sweep."""
    ctx = self.context
    rt = ctx.runtime
    started(rt.redis(), CHECK_REBUILD, shard_id)
    try:
        return {"shard": shard_id, "merge": _queue_merge_if_due(ctx, shard_id)}
    except NotFoundError:
        return {"shard": shard_id, "dropped": True}


@app.task(base=ShoalTask, bind=True, name=MERGE_SHARD)
def merge_shard(self: ShoalTask, shard_id: int) -> dict[str, Any]:
    """Merge the segments the policy picks in one index shard; queue the next merge if one is due after it."""
    ctx = self.context
    rt = ctx.runtime
    # The pending mark stays set until the merge ends (not cleared as it starts, as other tasks do): a merge
    # queued meanwhile would build the same segments again, only to lose the publish. So this task queues
    # what is due after it itself. The merge builds without the shard's lease and may outlast the mark's expiry
    # (SHOAL_PENDING_TTL_S): the mark is renewed while it runs, and expires soon after its worker dies.
    try:
        with keep_pending(rt.redis(), MERGE_SHARD, shard_id, rt.settings.pending_ttl_s):
            result = ctx.builder.merge(shard_id)
    except NotFoundError:
        return {"shard": shard_id, "dropped": True}
    finally:
        started(rt.redis(), MERGE_SHARD, shard_id)
    if result.changed and ctx.builder.needs_merge(shard_id):
        enqueue(rt.redis(), app, MERGE_SHARD, shard_id, rt.settings.pending_ttl_s)
    _look_again_for_rebuild(ctx, shard_id)  # a quick merge under ingest: the rebuild is still owed
    return {"shard": shard_id, "version": result.version_id, "segments": result.segments, "changed": result.changed}


@app.task(base=ShoalTask, bind=True, name=SWEEP)
def sweep(self: ShoalTask) -> dict[str, int]:
    """Queue materialization of every shard behind its data source's head (beat runs this every
    SHOAL_SWEEP_INTERVAL_S): the safety net for triggers a broker outage dropped. Coalesced by `enqueue`, so
    runs that overlap, with each other or with commits, queue each shard at most once."""
    ctx = self.context
    rt = ctx.runtime
    lagging = 0
    for shard_id, built, head in ctx.builder.shards.all_shards():
        if built < head and enqueue(rt.redis(), app, MATERIALIZE_SHARD, shard_id, rt.settings.pending_ttl_s):
            lagging += 1
    return {"lagging": lagging}


@app.task(base=ShoalTask, bind=True, name=SWEEP_MERGES)
def sweep_merges(self: ShoalTask) -> dict[str, int]:
    """Queue a merge of every caught-up shard whose segments are due for one (beat runs this every
    SHOAL_MERGE_INTERVAL_S). A lagging shard is left to its materialization, which queues the merge after
    it. Coalesced by `enqueue`, like `sweep`."""
    ctx = self.context
    rt = ctx.runtime
    merges = 0
    for shard_id, built, head in ctx.builder.shards.all_shards():
        if (
            built >= head
            and ctx.builder.needs_merge(shard_id)
            and enqueue(rt.redis(), app, MERGE_SHARD, shard_id, rt.settings.pending_ttl_s)
        ):
            merges += 1
    return {"merges": merges}


@app.task(base=ShoalTask, bind=True, name=PURGE_TRASH)
def purge_trash(self: ShoalTask) -> dict[str, Any]:
    """Purge the soft-deleted data sources (datasets) whose retention ended, in every tenant: their rows go and
    their files are queued for GC in one transaction, then deleted (`shoal.upkeep.trash`; beat runs this every
    SHOAL_PURGE_INTERVAL_S). Takes no arguments; a run killed at any point is finished by the next (or by GC);
    every deletion is logged. Also the backstop of what sources and indexes deleted for good leave behind: their
    Redis keys and, 7 days on, their reindex jobs (`shoal.upkeep.leftovers`)."""
    from shoal.upkeep.trash import purge_due

    ctx = self.context
    rt = ctx.runtime
    result = purge_due(rt.engine, rt.storage, redis_client=rt.redis_if_any())
    if result.sources or result.pending or result.keys or result.jobs:
        log.info("purge_trash: purged %d data sources, deleted %d files (%d left by an earlier run), %d Redis keys "
                 "and %d reindex jobs of deleted sources and indexes",
                 len(result.sources), result.files, result.pending, result.keys, result.jobs)
    return result.to_json()


# -- the log's upkeep: compaction, retention, garbage collection ---------------------------------------------


@app.task(base=ShoalTask, bind=True, name=COMPACT_LOG)
def compact_log(self: ShoalTask, source_id: int) -> dict[str, Any]:
    """Compact one data source's log below the lowest watermark of its indexes. Idempotent: a second run
    finds nothing to rewrite; one overlapping it loses the swap and discards its files."""
    ctx = self.context
    rt = ctx.runtime
    started(rt.redis(), COMPACT_LOG, source_id)
    try:
        result = compaction.compact_log(
            rt.engine, rt.storage, source_id, compaction.CompactionPolicy.from_settings(rt.settings)
        )
    except NotFoundError:
        return {"source": source_id, "dropped": True}
    return result.to_json()


@app.task(base=ShoalTask, bind=True, name=SWEEP_COMPACTION)
def sweep_compaction(self: ShoalTask) -> dict[str, int]:
    """Queue a compaction of every data source whose log is worth compacting (beat runs this every
    SHOAL_COMPACTION_INTERVAL_S). Coalesced by `enqueue`: at most one pending compaction per source."""
    ctx = self.context
    rt = ctx.runtime
    queued = 0
    due = compaction.due_for_compaction(
        rt.engine, min_seqs=rt.settings.compaction_min_seqs, tombstone_retention_s=rt.settings.tombstone_retention_s
    )
    for source_id in due:
        if enqueue(rt.redis(), app, COMPACT_LOG, source_id, rt.settings.pending_ttl_s):
            queued += 1
    return {"due": len(due), "queued": queued}


@app.task(base=ShoalTask, bind=True, name=APPLY_RETENTION)
def apply_retention(self: ShoalTask) -> dict[str, int]:
    """Expire the points past their data source's `retention_days` by appending tombstones, in every tenant
    (beat runs this every SHOAL_RETENTION_INTERVAL_S), then queue the indexes' materialization. Idempotent:
    what one run expired the next finds deleted; an overlapping run's commit is refused under the lock."""
    ctx = self.context
    rt = ctx.runtime
    sources = expired = failed = 0
    for record in retention.sources_with_retention(rt.engine):
        sources += 1
        try:
            result = retention.apply_retention(
                rt.engine,
                rt.storage,
                record,
                max_batch_points=rt.settings.max_batch_points,
                lock_timeout_ms=rt.settings.lock_timeout_ms,
                commit_retries=rt.settings.commit_retries,
                announce_head=rt.announce_head,
            )
        except (NotFoundError, CommitError) as exc:  # dropped meanwhile, or too busy: the next run retries
            failed += 1
            log.warning("retention of data source %s skipped this run: %s", record.id, exc)
            continue
        except Exception:  # noqa: BLE001 - one source's trouble (a missing file, ...) must not stop the others
            failed += 1
            log.exception("retention of data source %s failed; the next run retries", record.id)
            continue
        if result.expired:
            expired += result.expired
            notify_indexers(rt.redis(), app, ctx.builder.shards.shards_of_source(record.id), rt.settings.pending_ttl_s)
    return {"sources": sources, "expired": expired, "skipped": failed}


@app.task(base=ShoalTask, bind=True, name=COLLECT_GARBAGE)
def collect_garbage(self: ShoalTask) -> dict[str, int]:
    """Delete the files no catalog row references once their grace period (SHOAL_GC_GRACE_S) ended, in every
    tenant, logging each (beat runs this every SHOAL_GC_INTERVAL_S). Safe to overlap with itself."""
    ctx = self.context
    rt = ctx.runtime
    result = gc.collect_garbage(
        rt.engine, rt.storage, grace_s=rt.settings.gc_grace_s, lock_timeout_ms=rt.settings.lock_timeout_ms
    )
    return result.to_json()


@app.task(base=ShoalTask, bind=True, name=REINDEX)
def reindex(self: ShoalTask, job_id: int) -> dict[str, Any]:
    """One bounded step of a reindex job (see shoal.index.reindex): queue the materialization of the new
    generation's lagging shards and record its progress, or, once it caught up, check recall and swap it in.
    While the job still builds, the task queues itself again REINDEX_STEP_DELAY_S later instead of waiting,
    so no run comes near the broker's visibility timeout (coalesced: one pending continuation per job). A step
    that meets an error every later step would meet again (bad input, a damaged file: `reindex_step`'s
    DETERMINISTIC_ERRORS) ends the job as failed with the error recorded, and answers `failed`; one that raises
    another error is carried on: by Celery's retry when the error is transient, else by a continuation
    REINDEX_FAILED_STEP_DELAY_S later. A job that no longer exists (its tenant was deleted) answers `dropped`."""
    from shoal.index.generations import Generations
    from shoal.index.reindex import reindex_step
    from shoal.searcher.announce import announce_index
    from shoal.servers.broker import broker_url

    ctx = self.context
    rt = ctx.runtime
    started(rt.redis(), REINDEX, job_id)
    broker = broker_url(rt.settings)
    try:
        Generations(rt.engine).job(job_id)
    except NotFoundError:
        log.info("reindex job %s is gone; nothing to do", job_id)
        return {"job": job_id, "dropped": True}

    def build(index: Any) -> None:  # the workers build the shards, like any index's (coalesced per shard)
        for shard in index.shards:
            enqueue(rt.redis(), app, MATERIALIZE_SHARD, shard.id, rt.settings.pending_ttl_s)

    try:
        outcome = reindex_step(rt.engine, rt.storage, job_id, build=build,
                               on_swap=lambda index: announce_index(broker, index))
    except Exception as exc:
        if not _celery_retries(self, exc):
            _continue_after_failure(ctx, job_id, exc)
        raise
    if not outcome.finished:
        enqueue(rt.redis(), app, REINDEX, job_id, rt.settings.pending_ttl_s, countdown=REINDEX_STEP_DELAY_S)
    return {"job": job_id, "state": outcome.state, "recall": outcome.recall, "error": outcome.error,
            "continues": not outcome.finished}


def _celery_retries(task: ShoalTask, exc: BaseException) -> bool:
    """Whether Celery's autoretry runs the task again after `exc` propagates: a transient error (the retry map,
    ShoalTask.autoretry_for) while retries are left, in a worker (a direct call re-raises instead)."""
    if not isinstance(exc, tuple(task.autoretry_for)):
        return False
    if task.request.called_directly:
        return False
    return task.max_retries is None or task.request.retries < task.max_retries


def _continue_after_failure(ctx: WorkerContext, job_id: int, exc: BaseException) -> None:
    """Queue the job's next step after a step that raised an error Celery will not retry (coalesced, as the
    continuation of a normal step): without it the job would wait for sweep_generations to find it stalled.
    Best effort: when the broker is away too, that sweep is the safety net."""
    rt = ctx.runtime
    try:
        queued = enqueue(rt.redis(), app, REINDEX, job_id, rt.settings.pending_ttl_s,
                         countdown=REINDEX_FAILED_STEP_DELAY_S)
    except Exception as queue_exc:  # noqa: BLE001 - the step's own error is the one to report
        log.warning("reindex job %s: a step failed (%r) and its next step could not be queued: %s", job_id, exc,
                    queue_exc)
        return
    log.warning("reindex job %s: a step failed (%r); %s", job_id, exc,
                f"the next step runs in {REINDEX_FAILED_STEP_DELAY_S:.0f} s" if queued else "a next step is queued")


@app.task(base=ShoalTask, bind=True, name=SWEEP_GENERATIONS)
def sweep_generations(self: ShoalTask) -> dict[str, int]:
    """Drop generations kept for rollback past SHOAL_REINDEX_KEEP_S and leftovers of failed reindexes; prune
    index versions older than SHOAL_VERSION_KEEP_S that nothing serves, tags or may travel back to."""
    from shoal.index.generations import Generations
    from shoal.index.history import prune_versions
    from shoal.index.reindex import drop_expired_generations

    ctx = self.context
    rt = ctx.runtime
    # Jobs no task is stepping (their task was never queued, or was lost): queue them again.
    for job_id in Generations(rt.engine).stalled(600.0):
        enqueue(rt.redis(), app, REINDEX, job_id, rt.settings.pending_ttl_s)
    dropped = drop_expired_generations(rt.engine, rt.storage, rt.settings.reindex_keep_s)
    pruned = prune_versions(rt.engine, rt.settings.version_keep_s, rt.settings.gc_grace_s)
    return {"dropped": dropped, "pruned": pruned}
