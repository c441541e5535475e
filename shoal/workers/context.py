"""Per-process state of a worker: the runtime (settings, catalog pool, storage, broker) and the shard builder,
made once per process."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from shoal.config.settings import Settings
from shoal.indexing.builder import MergePolicy, ShardBuilder
from shoal.runtime import Runtime
from shoal.searcher.announce import announce_version


@dataclass(frozen=True)
class WorkerContext:
    """What every task of this process shares: the runtime (settings, catalog pool, storage, broker client) and
    the shard builder."""

    runtime: Runtime
    builder: ShardBuilder


_lock = threading.Lock()
_context: WorkerContext | None = None


def get() -> WorkerContext:
    """This process's context, created on first use (after fork, so connections are never shared)."""
    global _context
    with _lock:
        if _context is None:
            runtime = Runtime(Settings())
            broker = runtime.broker_url()
            settings = runtime.settings
            builder = ShardBuilder(
                runtime.engine,
                runtime.storage,
                lease_seconds=settings.lease_seconds,
                policy=MergePolicy(settings.max_segments, settings.max_deleted_ratio),
                on_publish=lambda shard, version: announce_version(broker, shard, version),
            )
            _context = WorkerContext(runtime, builder)
        return _context


def reset() -> None:
    """Forget the context (in a freshly forked process)."""
    global _context
    with _lock:
        _context = None
