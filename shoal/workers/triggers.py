"""Enqueueing index work after a commit: coalesced, so a burst of uploads makes one pending task per shard."""

from __future__ import annotations

import logging

import redis
from celery import Celery

from shoal.workers.names import MATERIALIZE_SHARD, MERGE_SHARD, QUEUE

log = logging.getLogger(__name__)

MATERIALIZE = MATERIALIZE_SHARD  # the names triggers always used; spelled in shoal.workers.names
MERGE = MERGE_SHARD
__all__ = ["MATERIALIZE", "MERGE", "QUEUE", "enqueue", "notify_indexers", "pending_key", "producer_app", "started"]


def pending_key(task: str, shard_id: int) -> str:
    """The Redis key that marks a task for a shard (or a data source, a reindex job) as queued and not yet
    started."""
    return f"shoal:pending:{task.rsplit('.', 1)[-1]}:{shard_id}"


def enqueue(
    client: redis.Redis, celery: Celery, task: str, shard_id: int, pending_ttl_s: float = 120.0,
    countdown: float | None = None,
) -> bool:
    """Queue `task` for the shard (or other id) unless one is already queued and not started; True when
    queued now. `countdown`: run it no sooner than that many seconds from now.

    The mark expires after `pending_ttl_s` (plus the countdown), so a task lost with its worker cannot block
    the shard for long: the next commit or beat sweep queues it again. `client` and `celery` must talk to the
    same broker.
    """
    ttl_s = pending_ttl_s + (countdown or 0.0)
    if not client.set(pending_key(task, shard_id), 1, nx=True, px=int(ttl_s * 1000)):
        return False
    try:
        celery.send_task(task, args=[shard_id], queue=QUEUE, countdown=countdown)
    except Exception:
        client.delete(pending_key(task, shard_id))  # let the next commit or the sweep try again
        raise
    return True


def started(client: redis.Redis, task: str, shard_id: int) -> None:
    """Clear the pending mark as the task starts, so commits from now on queue a new run."""
    client.delete(pending_key(task, shard_id))


def producer_app(broker: str) -> Celery:
    """A Celery app that only sends Shoal's tasks to `broker` (ingest processes use one per Shoal)."""
    app = Celery("shoal-producer", broker=broker, set_as_current=False)
    app.conf.update(task_serializer="json", broker_connection_retry=False, broker_connection_max_retries=0)
    return app


def notify_indexers(client: redis.Redis, celery: Celery, shard_ids: list[int], pending_ttl_s: float = 120.0) -> None:
    """After a commit: queue materialization of every shard over the data source (best effort; the beat
    sweep catches up whatever a broker outage drops)."""
    for shard_id in shard_ids:
        try:
            enqueue(client, celery, MATERIALIZE, shard_id, pending_ttl_s)
        except (redis.RedisError, OSError) as exc:
            log.warning("could not queue materialization of shard %s: %s", shard_id, exc)
            return
