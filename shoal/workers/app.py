"""The Celery app: broker from settings (the embedded Valkey by default), tasks, routes and beat schedule."""

from __future__ import annotations

import logging
from typing import Any

import redis
from celery import Celery
from celery.signals import worker_ready
from kombu import Exchange, Queue
from kombu.utils.objects import cached_property

from shoal.config.settings import Settings
from shoal.servers.broker import broker_url
from shoal.workers.names import (
    APPLY_RETENTION,
    COLLECT_GARBAGE,
    COMPACT_LOG,
    PURGE_TRASH,
    QUEUE,
    QUEUES,
    SWEEP,
    SWEEP_COMPACTION,
    SWEEP_GENERATIONS,
    SWEEP_MERGES,
    UPKEEP,
    UPKEEP_QUEUE,
)

# The task names are spelled in shoal.workers.names; those this module always exported stay importable here.
__all__ = ["APPLY_RETENTION", "COLLECT_GARBAGE", "COMPACT_LOG", "PURGE_TRASH", "SWEEP", "SWEEP_COMPACTION",
           "SWEEP_GENERATIONS", "SWEEP_MERGES", "app", "beat_schedule", "broker_url"]

log = logging.getLogger(__name__)


class ShoalCelery(Celery):  # type: ignore[misc]
    """Celery whose `celery worker` runs shoal.workers.process.Worker: one that exits after an error it
    cannot recover from instead of hanging in a warm shutdown (see that module)."""

    @cached_property
    def Worker(self) -> Any:  # noqa: N802 - Celery's attribute name
        return self.subclass_with_self("shoal.workers.process:Worker")


app = ShoalCelery("shoal", include=["shoal.workers.tasks"])


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """Beat's entries for these settings: the materialization sweep and, unless its interval is 0, the
    merge sweep. Tasks of the schedule take no arguments and coalesce, so overlapping runs are harmless.

    Each entry's task expires after its own interval: while no worker is free to take them, beat's runs would
    pile up in the queue, and a returning worker would run every stale one ahead of the index work queued after
    them. A run dropped that way is harmless, since the next run does the same work. The runs go to
    UPKEEP_QUEUE (the app's task_routes), not behind the builds in QUEUE: there a backlog of builds longer
    than an interval expired every run, and the upkeep never ran while the backlog lasted.

    Later periodic work (log retention and compaction, artifact GC) gets its own entry here, each with its
    own SHOAL_*_INTERVAL_S setting.
    """
    intervals: dict[str, tuple[str, float]] = {"sweep-lagging-shards": (SWEEP, settings.sweep_interval_s)}
    if settings.merge_interval_s > 0:
        intervals["sweep-due-merges"] = (SWEEP_MERGES, settings.merge_interval_s)
    if settings.generations_interval_s > 0:  # generations kept for rollback past SHOAL_REINDEX_KEEP_S
        intervals["sweep-generations"] = (SWEEP_GENERATIONS, settings.generations_interval_s)
    if settings.purge_interval_s > 0:  # the trash: purge soft-deleted datasets whose retention ended
        intervals["purge-trash"] = (PURGE_TRASH, settings.purge_interval_s)
    # The log's upkeep: compaction of logs worth it, expiry past retention_days, deletion of unreferenced files.
    for key, task, interval in (
        ("sweep-compaction", SWEEP_COMPACTION, settings.compaction_interval_s),
        ("apply-retention", APPLY_RETENTION, settings.retention_interval_s),
        ("collect-garbage", COLLECT_GARBAGE, settings.gc_interval_s),
    ):
        if interval > 0:
            intervals[key] = (task, interval)
    unrouted = sorted({task for task, _ in intervals.values()} - set(UPKEEP))
    if unrouted:  # it would expire behind the builds in QUEUE (see above): a bug of this module
        raise RuntimeError(f"beat tasks {unrouted} are not routed to {UPKEEP_QUEUE!r}: list them in names.UPKEEP")
    return {
        key: {"task": task, "schedule": interval, "options": {"expires": interval}}
        for key, (task, interval) in intervals.items()
    }


def task_queues() -> list[Queue]:
    """The queues every worker consumes unless started with -Q: QUEUE (index work, the default) and
    UPKEEP_QUEUE (beat's runs), each on a direct exchange and routing key of its name, as Celery declares
    its default queue."""
    return [Queue(name, Exchange(name, type="direct"), routing_key=name) for name in QUEUES]


def task_routes() -> dict[str, dict[str, str]]:
    """Routes of beat's tasks to UPKEEP_QUEUE. A sender's explicit queue= still wins (Celery merges the
    route under the call's options)."""
    return {task: {"queue": UPKEEP_QUEUE} for task in UPKEEP}


@app.on_configure.connect
def _configure(sender: Celery, **_: Any) -> None:
    settings = Settings()
    sender.conf.update(
        broker_url=broker_url(settings),
        # Tasks take ids and are idempotent: acknowledge after the work, redeliver if the worker dies.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        task_default_queue=QUEUE,
        # A worker started without -Q consumes every declared queue: builds and beat's runs. Kombu's Redis
        # transport sends one BRPOP over all of them and moves the queue it just took a message from to the
        # end of its order, so with both queues full a worker takes from each in turn.
        task_queues=task_queues(),
        task_routes=task_routes(),
        # A broker restart must not end the worker: reconnect at start and after every loss, for as long as it
        # takes (Celery gives up after 100 attempts by default), on channel errors too. `shoal up` restarts a
        # worker that dies anyway (kombu's Redis transport can still fail while it tears a connection down).
        broker_connection_retry=True,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        broker_channel_error_retry=True,
        # ... through kombu's Redis transport, whose use of a closed connection no longer ends the worker.
        broker_transport="shoal.workers.transport:Transport",
        # A task running when the connection drops is let finish (its work is kept: a build publishes); should
        # its late ack be lost with the connection, the broker redelivers it later and the rerun finds nothing to do.
        worker_cancel_long_running_tasks_on_connection_loss=False,
        broker_transport_options={
            # A materialization of a big shard may take minutes: redeliver only after a long silence.
            "visibility_timeout": settings.task_visibility_timeout_s,
            # Notice a dead broker connection (a restart, a half-open socket) instead of waiting on it.
            "socket_connect_timeout": 5,
            "socket_keepalive": True,
        },
        beat_schedule=beat_schedule(settings),
        # Task events for Flower (and `celery events`): every worker sends them, and so does every sender.
        worker_send_task_events=True,
        task_send_sent_event=True,
        worker_hijack_root_logger=False,
        # Beat's schedule state belongs with the rest of Shoal's files, not in whatever directory it ran from.
        beat_schedule_filename=str(settings.data_dir / "celerybeat-schedule"),
    )


@worker_ready.connect
def _forget_pending_marks(sender: Any = None, **_: Any) -> None:
    """A starting worker forgets every "queued, not started" mark (workers/triggers.py): a worker that died
    (killed, or ended by its broker connection) leaves the marks of the tasks it had taken, and until they
    expire no commit or sweep would queue those shards again. A mark forgotten too early only lets a duplicate
    task be queued, which the shard's lease makes harmless."""
    try:
        client = redis.Redis.from_url(app.conf.broker_url, socket_timeout=5)
        try:
            keys = list(client.scan_iter(match="shoal:pending:*", count=1000))
            if keys:
                client.delete(*keys)
        finally:
            client.close()
    except (redis.RedisError, OSError) as exc:  # the marks expire anyway; the worker must still start
        log.warning("could not clear the pending marks at worker start: %s", exc)
