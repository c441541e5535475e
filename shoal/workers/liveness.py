"""Is anything indexing? Which Celery workers answer on Shoal's broker, how far index shards lag behind
their logs, and the report that puts the two together (`/healthz`, `shoal status`, the API's log).

A process that only ingests (`shoal api`, `shoal consume`) commits uploads and queues index work, but only a
worker builds indexes. Without one the work waits in the queue and searches never see the uploads; this
module says so in words. It asks Celery itself (a broadcast ping over the broker's control channel) and the
catalog; nothing new runs in the workers.

Everything here is safe to show to an unauthenticated caller: counts only, never a tenant or index name,
never an exception's text (which may hold hosts, socket paths or credentials).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import Celery
from kombu.exceptions import OperationalError
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from shoal.catalog.indexes import freshness_rows
from shoal.catalog.models import DataSource, Index, IndexShard
from shoal.workers.names import QUEUE

log = logging.getLogger(__name__)

OK = "ok"
DEGRADED = "degraded"

# Problem kinds: a report's state is its set of kinds, so the counts in its sentences may change while the
# state stays the same (the health monitor logs once per change of state, not once per new count).
NO_WORKER = "no_worker"
BROKER_UNREACHABLE = "broker_unreachable"
CATALOG_UNREACHABLE = "catalog_unreachable"
STORAGE_UNREACHABLE = "storage_unreachable"

_apps: dict[str, Celery] = {}
_apps_lock = threading.Lock()


class BrokerUnreachableError(ConnectionError):
    """The broker did not accept a connection, so no worker could be asked."""


def _control_app(broker_url: str) -> Celery:
    """One Celery app per broker for the control calls of this process (made once: apps are not cheap)."""
    with _apps_lock:
        app = _apps.get(broker_url)
        if app is None:
            from shoal.workers.triggers import producer_app

            app = _apps[broker_url] = producer_app(broker_url)
        return app


def alive_workers(broker_url: str, timeout: float = 1.0) -> list[str]:
    """The hostnames of the Celery workers on `broker_url` that consume Shoal's index queue (QUEUE) and say so
    within `timeout` seconds, sorted; BrokerUnreachableError when the broker refuses the connection. A worker
    that answers but consumes other queues only (`-Q`, or another application's worker on the same broker)
    builds nothing: counted by a ping, it hid a stall from /healthz and `shoal status`.

    A worker answers from its consumer loop, so one with the solo pool busy with a long build answers only
    once the build ends: `lag_summary` counts the shards under a live build lease for that reason.
    """
    app = _control_app(broker_url)
    try:
        with app.connection_for_write(connect_timeout=timeout) as conn:
            # Fail at once: kombu would otherwise retry the connection for seconds before giving up.
            conn.ensure_connection(max_retries=0)
            queues: dict[str, Any] = app.control.inspect(timeout=timeout, connection=conn).active_queues() or {}
    except (OperationalError, redis.RedisError, OSError) as exc:
        raise BrokerUnreachableError("the broker did not accept a connection") from exc
    return sorted(host for host, consumed in queues.items()
                  if any(isinstance(q, dict) and q.get("name") == QUEUE for q in consumed or ()))


@dataclass(frozen=True)
class LagSummary:
    """How far the index shards of every tenant are behind their logs: counts only, no names."""

    shards: int  # index shards of live data sources
    lagging_shards: int  # shards whose log head is above their built watermark
    max_lag_seqs: int  # the largest head minus built watermark, in seqs (0 when none lags)
    building_shards: int = 0  # shards under an unexpired build lease: something is indexing them right now


def summarize(head_and_built: Iterable[tuple[int, int]], building_shards: int = 0) -> LagSummary:
    """The LagSummary of shards given as (log head, built watermark) pairs."""
    lags = [max(0, head - built) for head, built in head_and_built]
    lagging = [lag for lag in lags if lag > 0]
    return LagSummary(len(lags), len(lagging), max(lagging, default=0), building_shards)


def building_shards(engine: Engine) -> int:
    """How many index shards of live data sources are under an unexpired build lease right now."""
    with Session(engine) as s:
        found = s.scalar(
            select(func.count())
            .select_from(IndexShard)
            .join(Index, Index.id == IndexShard.index_id)
            .join(DataSource, DataSource.id == Index.data_source_id)
            .where(
                DataSource.deleted_at.is_(None),
                IndexShard.lease_owner.is_not(None),
                IndexShard.lease_expires_at > func.clock_timestamp(),
            )
        )
    return int(found or 0)


def lag_summary(engine: Engine) -> LagSummary:
    """The lag of every index shard over all tenants, from the catalog (raises if it is unreachable): the
    shards of every index's serving generation and of a generation a running reindex builds (work the workers
    owe: with none alive the reindex never ends), not those of generations kept for rollback or a tag."""
    rows = freshness_rows(engine)  # (tenant, index, version, shard, head, built, served, building)
    return summarize(((row[4], row[5]) for row in rows), building_shards(engine))


def _shards(n: int) -> str:
    return f"{n:,} index shard lags" if n == 1 else f"{n:,} index shards lag"


def no_worker_sentence(lag: LagSummary) -> str:
    """What to tell a user whose index shards lag while no worker is alive, and what to do about it."""
    them = "it" if lag.lagging_shards == 1 else "them"
    return (
        f"no indexer worker is alive: {_shards(lag.lagging_shards)} (up to {lag.max_lag_seqs:,} seqs) and "
        f"nothing will index {them}; start one with `shoal worker` (or run everything with `shoal up`)"
    )


BROKER_SENTENCE = (
    "cannot reach the broker: uploads cannot queue index work and no worker can be asked whether it is alive"
)
CATALOG_SENTENCE = "cannot reach the catalog: how far the indexes lag is unknown"
STORAGE_SENTENCE = (
    "cannot reach the storage: uploads, strong searches and first loads of an index answer 503, and workers "
    "cannot build"
)


@dataclass(frozen=True)
class HealthReport:
    """Whether indexing keeps up: the workers that answered, the shards' lag, and the problems in words."""

    status: str  # OK or DEGRADED
    workers: int  # Celery workers that answered a ping (0 when the broker is unreachable)
    shards: int
    lagging_shards: int
    max_lag_seqs: int
    problems: tuple[str, ...] = ()
    kinds: frozenset[str] = field(default_factory=frozenset)  # the problems' kinds: the report's state

    def as_json(self) -> dict[str, Any]:
        """The report as `/healthz` answers it (its kinds stay internal)."""
        return {
            "status": self.status,
            "workers": self.workers,
            "shards": self.shards,
            "lagging_shards": self.lagging_shards,
            "max_lag_seqs": self.max_lag_seqs,
            "problems": list(self.problems),
        }


def health_report(
    engine: Engine,
    broker_url: Callable[[], str],
    timeout: float = 1.0,
    storage_check: Callable[[], object] | None = None,
) -> HealthReport:
    """Ask the catalog and the workers; "degraded", with a sentence per problem, when shards lag and nothing
    will index them, or when the broker or the catalog cannot be reached. Never raises for either; the
    reason of a failure goes to this module's log only (it may name hosts), never into the report.

    `broker_url` is called only here, so an embedded broker that fails to start is reported, not raised.
    `storage_check` (one cheap read of the storage) adds the storage's reachability to the report.
    """
    problems: dict[str, str] = {}
    lag: LagSummary | None = None
    try:
        lag = lag_summary(engine)
    except Exception as exc:  # any failure of the catalog: the probe must answer anyway
        log.debug("health: catalog check failed: %s", type(exc).__name__, exc_info=True)
        problems[CATALOG_UNREACHABLE] = CATALOG_SENTENCE
    workers: list[str] | None = None
    try:
        workers = alive_workers(broker_url(), timeout)
    except Exception as exc:  # unreachable, refused, or the embedded broker would not start
        log.debug("health: broker check failed: %s", type(exc).__name__, exc_info=True)
        problems[BROKER_UNREACHABLE] = BROKER_SENTENCE
    if storage_check is not None:
        try:
            storage_check()
        except Exception as exc:  # unreachable, refused, throttled: every write and first load fails meanwhile
            log.debug("health: storage check failed: %s", type(exc).__name__, exc_info=True)
            problems[STORAGE_UNREACHABLE] = STORAGE_SENTENCE
    # A shard under a live lease is being built: its worker may be too busy to answer (solo pool).
    if lag is not None and workers == [] and lag.lagging_shards > 0 and lag.building_shards == 0:
        problems[NO_WORKER] = no_worker_sentence(lag)
    lag = lag or LagSummary(0, 0, 0)
    return HealthReport(
        status=DEGRADED if problems else OK,
        workers=len(workers or []),
        shards=lag.shards,
        lagging_shards=lag.lagging_shards,
        max_lag_seqs=lag.max_lag_seqs,
        problems=tuple(problems.values()),
        kinds=frozenset(problems),
    )
