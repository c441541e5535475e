"""Enqueueing index work after a commit: coalesced, so a burst of uploads makes one pending task per shard."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import redis
from celery import Celery

from shoal.workers.names import MATERIALIZE_SHARD, MERGE_SHARD, QUEUE

log = logging.getLogger(__name__)

MATERIALIZE = MATERIALIZE_SHARD  # the names triggers always used; spelled in shoal.workers.names
MERGE = MERGE_SHARD
__all__ = ["MATERIALIZE", "MERGE", "QUEUE", "enqueue", "keep_pending", "mark_pending", "notify_indexers", "pending_key",
           "producer_app", "started"]

# A mark kept alive while its task runs (keep_pending) is renewed every third of its expiry, but no more often than
# this: with a tiny SHOAL_PENDING_TTL_S the renewals would otherwise spin.
MIN_RENEW_S = 0.05


def pending_key(task: str, shard_id: int) -> str:
    """The Redis key that marks a task for a shard (or a data source, a reindex job) as queued and not yet
    started (or waiting for Celery's retry, or, for a merge, running)."""
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
    if not mark_pending(client, task, shard_id, pending_ttl_s + (countdown or 0.0)):
        return False
    try:
        celery.send_task(task, args=[shard_id], queue=QUEUE, countdown=countdown)
    except Exception:
        client.delete(pending_key(task, shard_id))  # let the next commit or the sweep try again
        raise
    return True


def mark_pending(client: redis.Redis, task: str, shard_id: int, ttl_s: float) -> bool:
    """Set the task's pending mark for the shard for `ttl_s` seconds unless one is set; True when set now. It
    queues nothing: `enqueue` sets it for the task it sends, and a task that Celery will run again (a retry) sets
    it for itself, so commits and sweeps meanwhile queue no copy of it."""
    return bool(client.set(pending_key(task, shard_id), 1, nx=True, px=max(1, int(ttl_s * 1000))))


def started(client: redis.Redis, task: str, shard_id: int) -> None:
    """Clear the pending mark as the task starts, so commits from now on queue a new run."""
    client.delete(pending_key(task, shard_id))


@contextlib.contextmanager
def keep_pending(client: redis.Redis, task: str, shard_id: int, ttl_s: float) -> Iterator[None]:
    """Keep the task's pending mark for the shard set while the block runs: set now, then renewed every third of
    `ttl_s` from a daemon thread, stopped when the block ends (the caller then clears the mark with `started`).
    For a task that must not get a copy queued while it runs however long it takes (a merge: a copy would build
    the same segments again). If the process dies the renewals stop and the mark expires within `ttl_s`, so the
    next sweep queues the task again. A renewal Redis fails is tried again at the next beat."""
    interval = max(ttl_s / 3, MIN_RENEW_S)
    px = max(1, int(max(ttl_s, 3 * interval) * 1000))
    key = pending_key(task, shard_id)
    stop = threading.Event()

    def renew() -> None:
        # A plain SET, not NX/XX: the mark is this task's while it runs, also after a starting worker cleared
        # every mark (app._forget_pending_marks) or after it expired during a stall.
        while True:
            try:
                client.set(key, 1, px=px)
            except (redis.RedisError, OSError) as exc:
                log.warning("could not renew the pending mark %s: %s", key, type(exc).__name__)
            if stop.wait(interval):
                return

    thread = threading.Thread(target=renew, name=f"shoal-pending-{shard_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        # Joined before the caller clears the mark, so no renewal lands after that (Redis answers or times out
        # within the client's socket timeout).
        thread.join(timeout=max(5.0, interval))


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
