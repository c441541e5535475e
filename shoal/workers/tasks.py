"""Celery tasks: materialize and merge index shards, and the beat sweeps that queue them. Tasks take ids,
are idempotent, acknowledge late and retry only named transient errors."""

from __future__ import annotations

import logging
from typing import Any

import redis
from celery import Task
from sqlalchemy.exc import OperationalError

from shoal.config.celery_app import SWEEP, SWEEP_MERGES, app
from shoal.errors import NotFoundError
from shoal.indexing.builder import LeaseBusyError
from shoal.workers import context
from shoal.workers.triggers import MATERIALIZE, MERGE, enqueue, started

log = logging.getLogger(__name__)

# Errors worth a retry: the catalog, broker or storage was briefly away, or another worker holds the lease.
TRANSIENT = (OperationalError, redis.ConnectionError, redis.TimeoutError, ConnectionError, TimeoutError, LeaseBusyError)


class ShoalTask(Task):
    """Base of every Shoal task: late acks, redelivery on worker loss, retries with backoff on TRANSIENT."""

    acks_late = True
    reject_on_worker_lost = True
    autoretry_for = TRANSIENT
    retry_backoff = 1
    retry_backoff_max = 30
    retry_jitter = True
    max_retries = 50


@app.task(base=ShoalTask, name=MATERIALIZE)
def materialize_shard(shard_id: int) -> dict[str, Any]:
    """Bring one index shard up to its data source's head; queue a merge when the policy asks for one."""
    ctx = context.get()
    started(ctx.redis, MATERIALIZE, shard_id)
    try:
        result = ctx.builder.materialize(shard_id)
    except NotFoundError:
        log.info("shard %s is gone (index dropped); nothing to do", shard_id)
        return {"shard": shard_id, "dropped": True}
    if ctx.builder.needs_merge(shard_id):
        enqueue(ctx.redis, app, MERGE, shard_id, ctx.settings.pending_ttl_s)
    return {"shard": shard_id, "version": result.version_id, "watermark": result.watermark, "changed": result.changed}


@app.task(base=ShoalTask, name=MERGE)
def merge_shard(shard_id: int) -> dict[str, Any]:
    """Merge the segments the policy picks in one index shard."""
    ctx = context.get()
    started(ctx.redis, MERGE, shard_id)
    try:
        result = ctx.builder.merge(shard_id)
    except NotFoundError:
        return {"shard": shard_id, "dropped": True}
    return {"shard": shard_id, "version": result.version_id, "segments": result.segments, "changed": result.changed}


@app.task(base=ShoalTask, name=SWEEP)
def sweep() -> dict[str, int]:
    """Queue materialization of every shard behind its data source's head (beat runs this every
    SHOAL_SWEEP_INTERVAL_S): the safety net for triggers a broker outage dropped. Coalesced by `enqueue`, so
    runs that overlap, with each other or with commits, queue each shard at most once."""
    ctx = context.get()
    lagging = 0
    for shard_id, built, head in ctx.builder.shards.all_shards():
        if built < head and enqueue(ctx.redis, app, MATERIALIZE, shard_id, ctx.settings.pending_ttl_s):
            lagging += 1
    return {"lagging": lagging}


@app.task(base=ShoalTask, name=SWEEP_MERGES)
def sweep_merges() -> dict[str, int]:
    """Queue a merge of every caught-up shard whose segments are due for one (beat runs this every
    SHOAL_MERGE_INTERVAL_S). A lagging shard is left to its materialization, which queues the merge after
    it. Coalesced by `enqueue`, like `sweep`."""
    ctx = context.get()
    merges = 0
    for shard_id, built, head in ctx.builder.shards.all_shards():
        if (
            built >= head
            and ctx.builder.needs_merge(shard_id)
            and enqueue(ctx.redis, app, MERGE, shard_id, ctx.settings.pending_ttl_s)
        ):
            merges += 1
    return {"merges": merges}


@app.task(base=ShoalTask, name="shoal.workers.tasks.purge_trash")
def purge_trash() -> dict[str, Any]:
    """Purge the soft-deleted data sources (datasets) whose retention ended, in every tenant: their rows, then
    their files, through the logged list of `shoal.catalog.trash` (beat runs this every SHOAL_PURGE_INTERVAL_S).
    Takes no arguments; a run killed at any point is finished by the next; every deletion is logged."""
    from shoal.catalog.trash import purge_due

    ctx = context.get()
    result = purge_due(ctx.engine, ctx.storage)
    if result.sources or result.pending:
        log.info("purge_trash: purged %d data sources, deleted %d files and folders (%d left by an earlier run)",
                 len(result.sources), result.files, result.pending)
    return result.to_json()
