"""Per-process state of a worker: settings, catalog engine, storage and the shard builder, made once."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import redis
from sqlalchemy import Engine

from shoal.catalog.db import make_engine, migrate, resolve_database_url
from shoal.config.celery_app import broker_url
from shoal.config.settings import Settings
from shoal.indexing.builder import MergePolicy, ShardBuilder
from shoal.storage import Storage


@dataclass
class WorkerContext:
    """What every task of this process shares."""

    settings: Settings
    engine: Engine
    storage: Storage
    builder: ShardBuilder
    redis: redis.Redis


_lock = threading.Lock()
_context: WorkerContext | None = None


def get() -> WorkerContext:
    """This process's context, created on first use (after fork, so connections are never shared)."""
    global _context
    with _lock:
        if _context is None:
            from shoal.searcher.searcher import announce_version

            settings = Settings()
            url = resolve_database_url(settings)
            migrate(url)
            engine = make_engine(url)
            storage = Storage.from_settings(settings)
            broker = broker_url(settings)
            builder = ShardBuilder(
                engine,
                storage,
                lease_seconds=settings.lease_seconds,
                policy=MergePolicy(settings.max_segments, settings.max_deleted_ratio),
                on_publish=lambda shard, version: announce_version(broker, shard, version),
            )
            _context = WorkerContext(settings, engine, storage, builder, redis.Redis.from_url(broker))
        return _context


def reset() -> None:
    """Forget the context (in a freshly forked process)."""
    global _context
    with _lock:
        _context = None
