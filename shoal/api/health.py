"""`GET /healthz` and the API's health monitor: say when uploads are accepted but nothing indexes them.

`shoal api` alone commits uploads and queues index work; only a worker (`shoal worker`, `shoal up`) builds
indexes. The probe answers 200 whatever it finds (it is a liveness probe: the process serves), and its body
says "degraded", with the problems in words, when shards lag and no worker answers, or when the broker, the
catalog or the storage cannot be reached. The monitor writes the same to the API's log, so an operator who reads only
the log learns why searches never show new data. The report holds counts only: the probe needs no key.

A process that fans searches out to placed nodes (shoal.api.fanout) also says "degraded" while some node has
failed the search parts asked of it and answered none since: from what its searches saw (no node is probed
here), so it is current at every probe (not cached with the rest), and it is cleared by the node's next answer.
It counts the nodes and says their last failures in a few words, naming none (/metrics does, by node).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel

from shoal.api.fanout import FanOut
from shoal.runtime import Runtime
from shoal.storage.identity import MARKER
from shoal.workers.liveness import DEGRADED, HealthReport, health_report

log = logging.getLogger(__name__)

# A probe hit every second must not ping Celery every time: a ping waits its whole timeout for replies.
CACHE_S = 5.0
PING_TIMEOUT_S = 1.0
MONITOR_INTERVAL_S = 30.0
REPEAT_WARNING_S = 300.0  # while degraded, the monitor repeats its warning this often
NOT_READY = "the service is starting: its catalog and broker are not open yet"

router = APIRouter()


class Health(BaseModel):
    """The body of `GET /healthz`."""

    status: Literal["ok", "degraded"]
    workers: int  # Celery workers that answered a ping on the broker
    shards: int  # index shards over all tenants
    lagging_shards: int  # shards whose log head is above their built watermark
    max_lag_seqs: int
    problems: list[str]  # one sentence per problem; empty when "ok"


class _CachedReport:
    """The report of one runtime, computed at most once per `max_age_s` however many threads ask."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._lock = threading.Lock()
        self._report: HealthReport | None = None
        self._at = 0.0

    def get(self, max_age_s: float) -> HealthReport:
        # Callers wait for a computation under way rather than starting their own: one ping at a time.
        with self._lock:
            if self._report is None or time.monotonic() - self._at >= max_age_s:
                self._report = health_report(self._runtime.engine, self._runtime.broker_url, PING_TIMEOUT_S,
                                             storage_check=self._storage_check)
                self._at = time.monotonic()
            return self._report

    def _storage_check(self) -> bool:
        # One HEAD of the catalog's marker, which every storage in use holds (a storage the process could not
        # open at start never got this far).
        return self._runtime.storage.exists(MARKER)


# Keyed weakly: the probe and the monitor of one runtime share a cache, which goes with the runtime.
_caches: weakref.WeakKeyDictionary[Runtime, _CachedReport] = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def current_report(runtime: Runtime, max_age_s: float = CACHE_S) -> HealthReport:
    """The runtime's health report, no older than `max_age_s` seconds. Blocks up to about a second (the
    ping) when it computes one; never raises for an unreachable broker or catalog."""
    with _caches_lock:
        cache = _caches.get(runtime)
        if cache is None:
            cache = _caches[runtime] = _CachedReport(runtime)
    return cache.get(max_age_s)


@router.get("/healthz", tags=["ops"], response_model=Health)
def healthz(request: Request) -> Health:
    """Liveness: 200 while the service answers. The body says whether indexing keeps up ("ok") or not
    ("degraded", with the problems in words: no live worker while shards lag, broker or catalog down, placed nodes
    failing this process's searches)."""
    # A sync endpoint: FastAPI runs it in its thread pool, so the ping never blocks the event loop.
    runtime: Runtime | None = getattr(request.app.state, "runtime", None)
    if runtime is None:
        return Health(status="degraded", workers=0, shards=0, lagging_shards=0, max_lag_seqs=0, problems=[NOT_READY])
    body = current_report(runtime).as_json()
    placed = placed_node_problems(getattr(request.app.state, "fanout", None))
    if placed:
        body["status"] = DEGRADED
        body["problems"] = [*body["problems"], *placed]
    return Health(**body)


def placed_node_problems(fanout: FanOut | None) -> list[str]:
    """The problems of the placed nodes this process's searches found failing (none without a placement)."""
    return fanout.health.problems() if fanout is not None else []


class HealthMonitor:
    """Checks the runtime's health every `interval_s` seconds in a daemon thread and logs a WARNING (logger
    `shoal.api.health`) while it is degraded: when it becomes so or its problems change, then again every
    `repeat_s` seconds while they last; an INFO line when it recovers."""

    def __init__(
        self, runtime: Runtime, interval_s: float = MONITOR_INTERVAL_S, repeat_s: float = REPEAT_WARNING_S
    ) -> None:
        self.runtime = runtime
        self.interval_s = interval_s
        self.repeat_s = repeat_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state: frozenset[str] = frozenset()  # the problem kinds of the last check
        self._warned_at: float | None = None

    def start(self) -> None:
        """Start checking (the first check at once); a second call while running does nothing."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="shoal-health-monitor", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop checking and wait up to `timeout` seconds for a check under way to end."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)

    def check(self) -> HealthReport:
        """One check: compute the report (or reuse one fresher than the interval) and log as promised."""
        report = current_report(self.runtime, max_age_s=min(CACHE_S, self.interval_s))
        now = time.monotonic()
        if report.status == DEGRADED:
            changed = report.kinds != self._state
            if changed or self._warned_at is None or now - self._warned_at >= self.repeat_s:
                log.warning("indexing is degraded: %s", "; ".join(report.problems))
                self._warned_at = now
        elif self._state:
            log.info("indexing is healthy again: %d worker(s) alive, %d of %d index shards lag",
                     report.workers, report.lagging_shards, report.shards)
            self._warned_at = None
        self._state = report.kinds
        return report

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
            except Exception:  # a bug here must not end the monitor, nor the API
                log.exception("health check failed")
            self._stop.wait(self.interval_s)
