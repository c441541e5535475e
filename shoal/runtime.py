"""One runtime per process: the catalog pool, storage, the broker and Redis clients, log writers and the
searchers' segment cache, shared by every tenant the process serves (DESIGN.md, "Processes").

A tenant is a cheap scope over it (`Runtime.scope`): a tenant id and the repositories filtered by it, no
connection of its own. So one API process serving many tenants holds one pool of catalog connections, sized
by SHOAL_DB_POOL_SIZE and SHOAL_DB_MAX_OVERFLOW, however many tenants call it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import redis

from shoal.catalog.db import close_engine, ensure_schema, make_engine, resolve_database_url
from shoal.catalog.indexes import AliasCatalog, IndexCatalog, ShardCatalog
from shoal.catalog.repo import Catalog, SourceRecord, tenant_exists
from shoal.config.settings import Settings
from shoal.errors import ConfigurationError, NotFoundError
from shoal.index.segment_cache import SegmentCache
from shoal.intake.backpressure import Backpressure
from shoal.log.heads import HeadAnnouncer
from shoal.log.records import check_tenant_name
from shoal.log.writer import LogWriter
from shoal.servers.broker import broker_url
from shoal.storage import Storage
from shoal.storage.identity import ensure_storage_identity

log = logging.getLogger(__name__)

# Index definitions change rarely: a commit looks up the shards to notify at most this often per source.
SHARDS_OF_TTL_S = 2.0
# How long an upload route may reuse a data source's definition instead of reading it per request. Safe: the
# commit re-reads the source under its row lock and refuses a dropped or trashed one.
SOURCE_TTL_S = 2.0
# What the runtime keeps per data source (its writer, definition and shard list) is forgotten after this long
# without a write to it: kept for ever, one entry per data source ever written to, it grew without bound in a
# long-running API or consumer (3-5 KB each) when sources are made, written and dropped elsewhere. Checked on
# the write path at most every IDLE_FORGET_S / 4 seconds. A module constant so tests can lower it.
IDLE_FORGET_S = 600.0


# Every open runtime of the process, held weakly (a runtime dropped unclosed is not kept alive by this), so that
# a forked child can make each its own (`Runtime._after_fork_in_child`).
_RUNTIMES: weakref.WeakSet[Runtime] = weakref.WeakSet()

CLOSED = "this Shoal is closed"


def _runtimes_after_fork_in_child() -> None:
    for runtime in list(_RUNTIMES):
        runtime._after_fork_in_child()


os.register_at_fork(after_in_child=_runtimes_after_fork_in_child)


@dataclass(frozen=True)
class Scope:
    """One tenant over a runtime: its id and the repositories that filter by it. Cheap: no connection."""

    runtime: Runtime
    tenant: str
    tenant_id: int
    catalog: Catalog
    indexes: IndexCatalog
    aliases: AliasCatalog


class Runtime:
    """What every tenant of this process shares. Thread-safe; `close()` releases connections and clients, for
    good: a closed runtime refuses every later use (ConfigurationError). Safe across `os.fork()`: a forked child
    opens connections of its own on first use, and the parent's stay the parent's."""

    def __init__(self, settings: Settings | None = None, *, notify: bool = True) -> None:
        self.closed = False
        self.settings = settings or Settings()
        self.notify = notify  # queue index materialization after each commit
        self.database_url = resolve_database_url(self.settings)
        self.engine = make_engine(
            self.database_url, pool_size=self.settings.db_pool_size, max_overflow=self.settings.db_max_overflow
        )
        try:
            # The embedded default migrates on first start; a configured catalog is migrated by `shoal migrate`.
            # A catalog away, a migration's lock timeout ...: a ConfigurationError naming it (catalog_error).
            ensure_schema(self.engine, self.database_url, auto_migrate=self.settings.database_url is None)
            self.storage = Storage.from_settings(self.settings)
            # The storage must be this catalog's (its marker names the catalog; written on first use): on another
            # deployment's storage every file looks unreferenced, and GC would delete that deployment's data.
            self.catalog_id = ensure_storage_identity(self.engine, self.storage, self.settings)
        except BaseException:
            self.engine.dispose()
            raise
        self.shards = ShardCatalog(self.engine)
        self.backpressure = Backpressure(
            self.shards, self.settings.max_index_lag_seqs, self.settings.backpressure_retry_after_s
        )
        self.segment_cache = SegmentCache(self.settings.searcher_cache_bytes)
        self._lock = threading.Lock()
        self._scopes: dict[str, Scope] = {}
        self._writers: dict[int, LogWriter] = {}
        self._shards_of: dict[int, tuple[float, list[int]]] = {}
        self._sources: dict[tuple[int, str, str], tuple[float, SourceRecord]] = {}
        self._written: dict[int, float] = {}  # source id -> when a writer was last asked for or committed
        self._swept_at = time.monotonic()
        # Every writer made, held weakly: one forgotten while idle may still serve a producer, which `close`
        # must refuse like the others.
        self._made_writers: weakref.WeakValueDictionary[int, LogWriter] = weakref.WeakValueDictionary()
        self._broker_url: str | None = None
        self._redis: redis.Redis | None = None
        self._celery: Any = None
        self.heads = HeadAnnouncer(self.redis)
        _RUNTIMES.add(self)

    def check_open(self) -> None:
        """Raise ConfigurationError when this runtime was closed."""
        if self.closed:
            raise ConfigurationError(f"{CLOSED}: its connections were released (make a new Shoal)")

    # -- tenants ------------------------------------------------------------------------------------------

    def scope(self, tenant: str, *, create: bool = True) -> Scope:
        """The tenant's scope (its catalog row is created on first use, then remembered). With `create` False a
        tenant the catalog does not hold is NotFoundError, and nothing is created or remembered (a message or
        command naming a tenant that does not exist must not make one)."""
        self.check_open()
        with self._lock:
            found = self._scopes.get(tenant)
        if found is not None:
            return found
        if not create and not tenant_exists(self.engine, check_tenant_name(tenant)):
            raise NotFoundError(f"tenant {tenant!r} not found")
        catalog = Catalog(self.engine, tenant)  # validates the name, creates the tenant row if needed
        made = Scope(
            self,
            catalog.tenant,
            catalog.tenant_id,
            catalog,
            IndexCatalog(self.engine, catalog.tenant_id, catalog.tenant),
            AliasCatalog(self.engine, catalog.tenant_id, catalog.tenant),
        )
        with self._lock:
            return self._scopes.setdefault(tenant, made)

    # -- the broker -----------------------------------------------------------------------------------------

    def broker_url(self) -> str:
        """The Redis URL of the broker: configured, or the embedded Valkey (started on first call)."""
        self.check_open()
        if self._broker_url is None:
            self._broker_url = broker_url(self.settings)
        return self._broker_url

    def redis(self) -> redis.Redis:
        """The process's Redis client on the broker (a pooled, thread-safe client; short timeouts)."""
        url = self.broker_url()  # outside the lock: it may start the embedded Valkey
        with self._lock:
            self.check_open()  # again under the lock: a close meanwhile must not be followed by a new client
            if self._redis is None:
                self._redis = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
            return self._redis

    def redis_if_any(self) -> redis.Redis | None:
        """The Redis client of `redis()`, or None (logged) when the broker cannot be had (a configuration error,
        an embedded Valkey that will not start): for best-effort work such as deleting a purged source's keys."""
        try:
            return self.redis()
        except Exception as exc:  # noqa: BLE001 - best effort by contract: whatever keeps the broker away
            log.warning("no Redis client for best-effort work: %s", exc)
            return None

    def celery(self) -> Any:
        """A Celery app that only sends Shoal's tasks to the broker."""
        from shoal.workers.triggers import producer_app

        url = self.broker_url()
        with self._lock:
            self.check_open()
            if self._celery is None:
                self._celery = producer_app(url)
            return self._celery

    # -- writing ------------------------------------------------------------------------------------------

    def writer(self, source: SourceRecord) -> LogWriter:
        """The process's log writer of a data source: every upload to it in this process shares its group
        commits, whichever tenant scope or thread sends it."""
        with self._lock:
            self.check_open()
            # A writer forgotten while idle that a producer still holds is this source's writer again: two would
            # each lead group commits of their own.
            writer = self._writers.get(source.id)
            if writer is None:
                writer = self._made_writers.get(source.id)
            if writer is None:
                writer = LogWriter(
                    self.engine,
                    self.storage,
                    source,
                    group_max_points=self.settings.group_commit_max_points,
                    retries=self.settings.commit_retries,
                    lock_timeout_ms=self.settings.lock_timeout_ms,
                )
                writer.after_commit = self.after_commit
                writer.announce_head = self.announce_head
                self._made_writers[source.id] = writer
            self._writers[source.id] = writer
            self._written[source.id] = time.monotonic()
        self._forget_idle_now_and_then()
        return writer

    def source(self, scope: Scope, name: str, version: str) -> SourceRecord:
        """The data source's definition, read from the catalog at most every SOURCE_TTL_S per process (the
        upload routes ask on every request). NotFoundError if absent."""
        self.check_open()
        key = (scope.tenant_id, name, version)
        found = self._sources.get(key)
        if found is not None and time.monotonic() - found[0] < SOURCE_TTL_S:
            return found[1]
        record = scope.catalog.get_data_source(name, version)
        with self._lock:  # forget_source walks the dict under the lock: a write beside it broke its walk
            self._sources[key] = (time.monotonic(), record)
        self._forget_idle_now_and_then()
        return record

    def forget_source(self, source_id: int) -> None:
        """Drop what the runtime keeps for a data source that is gone (its writer, its shard list, its
        definition)."""
        with self._lock:
            self._writers.pop(source_id, None)
            self._shards_of.pop(source_id, None)
            self._written.pop(source_id, None)
            for key in [k for k, (_, r) in self._sources.items() if r.id == source_id]:
                del self._sources[key]

    def forget_shards(self, source_id: int) -> None:
        """Look the data source's shards up again at the next commit (an index over it was created)."""
        with self._lock:
            self._shards_of.pop(source_id, None)

    def announce_head(self, source_id: int, head: int) -> None:
        """Announce a data source's new head to searchers (every commit, whatever `notify` says: searchers
        answer `strong` from it). Best effort: what fails is retried in the background."""
        self._written[source_id] = time.monotonic()  # a commit: the source's writer is in use
        self.heads.announce(source_id, head)
        self._forget_idle_now_and_then()

    def _forget_idle_now_and_then(self) -> None:
        """Forget the data sources idle past IDLE_FORGET_S (`forget_idle`), at most every IDLE_FORGET_S / 4:
        called on the write path, where it costs one clock read otherwise."""
        now = time.monotonic()
        if now - self._swept_at >= IDLE_FORGET_S / 4:
            self._swept_at = now
            self.forget_idle(now)

    def forget_idle(self, now: float | None = None) -> None:
        """Drop the writers, definitions and shard lists of data sources not written to (nor asked for) for
        IDLE_FORGET_S: a later upload reads and makes them again. A writer with a commit in flight or batches
        queued is kept. Writers are dropped, not closed: closing only refuses later submits (a writer has no
        thread or buffer of its own; its callers lead the group commits), and a producer holding one may upload
        again; `close` still refuses them (`_made_writers`)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            # list(...) in one step: `announce_head` notes writes without the lock (a walk of the dict itself would
            # fail should one land in the middle of it).
            for source_id in [s for s, at in list(self._written.items()) if now - at > IDLE_FORGET_S]:
                writer = self._writers.get(source_id)
                if writer is not None and _in_flight(writer):
                    continue
                self._writers.pop(source_id, None)
                self._written.pop(source_id, None)
            for source_id in [s for s, (at, _) in self._shards_of.items() if now - at > IDLE_FORGET_S]:
                del self._shards_of[source_id]
            for key in [k for k, (at, _) in self._sources.items() if now - at > IDLE_FORGET_S]:
                del self._sources[key]

    def after_commit(self, source_id: int) -> None:
        """After a commit (never before): queue materialization of every shard over the data source."""
        if not self.notify or self.closed:  # closed meanwhile: the indexers' sweep finds the commit
            return
        cached = self._shards_of.get(source_id)
        if cached is None or time.monotonic() - cached[0] > SHARDS_OF_TTL_S:
            cached = (time.monotonic(), self.shards.shards_of_source(source_id))
            with self._lock:
                self._shards_of[source_id] = cached
        if not cached[1]:
            return
        from shoal.workers.triggers import notify_indexers

        notify_indexers(self.redis(), self.celery(), cached[1], self.settings.pending_ttl_s)

    # -- life -----------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the catalog connections and the broker clients, for good: every later use of this runtime, of
        its producers' writers and of its catalog pool raises ConfigurationError. A second close does nothing."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            client, self._redis = self._redis, None
            self._celery = None
            self._scopes.clear()
            writers = list(self._made_writers.values())
            self._writers.clear()
            self._written.clear()
        _RUNTIMES.discard(self)
        self.heads.close()
        for writer in writers:  # producers made before the close hold them: their uploads are refused now
            writer.close()
        if client is not None:
            client.close()
        close_engine(self.engine)

    def _after_fork_in_child(self) -> None:
        """Called in a forked child only (no other thread runs): make what the parent shares with it the child's.
        The pool forgets the parent's connections without closing them (SQLAlchemy's recipe: closing, or using,
        them from here would break the parent's sessions on the same sockets); the child connects anew. Locks
        a parent thread held at the fork would never be released here: fresh ones. The Redis client checks the
        pid itself (redis-py resets its pool in a child); Celery's app is made again; owed head announcements
        are the parent's to retry. Writers reset themselves (shoal.log.writer)."""
        self._lock = threading.Lock()
        self.engine.dispose(close=False)
        self._celery = None
        self.heads = HeadAnnouncer(self.redis)
        self.backpressure = Backpressure(
            self.shards, self.settings.max_index_lag_seqs, self.settings.backpressure_retry_after_s
        )
        self.segment_cache._lock = threading.Lock()  # its segments are immutable, so shared safely; its lock not

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _in_flight(writer: LogWriter) -> bool:
    """Whether a writer has a commit running or batches queued (read without its lock: a writer found idle
    that takes a batch right after is only forgotten by the runtime, its caller commits through it as ever)."""
    return writer._busy or bool(writer._queue)
