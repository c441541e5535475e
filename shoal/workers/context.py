"""What a worker process shares between its tasks: the runtime (settings, catalog pool, storage, broker) and
the shard builder. `ShoalTask` (shoal.workers.base) makes one per process, on first use after the fork."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.config.settings import Settings
from shoal.index.builder import MergePolicy, ShardBuilder
from shoal.runtime import Runtime
from shoal.searcher.announce import announce_version


@dataclass(frozen=True)
class WorkerContext:
    """What every task of this process shares: the runtime (settings, catalog pool, storage, broker client) and
    the shard builder."""

    runtime: Runtime
    builder: ShardBuilder

    @classmethod
    def create(cls, settings: Settings | None = None) -> WorkerContext:
        """A context on `settings` (by default, from the environment): a new runtime and its shard builder,
        which announces every version it publishes on the runtime's broker."""
        runtime = Runtime(settings if settings is not None else Settings())
        broker = runtime.broker_url()
        settings = runtime.settings
        builder = ShardBuilder(
            runtime.engine,
            runtime.storage,
            lease_seconds=settings.lease_seconds,
            # Renewed while a build runs, at least three times per lease: one late beat never loses it.
            heartbeat_s=min(settings.lease_heartbeat_s, settings.lease_seconds / 3),
            policy=MergePolicy(settings.max_segments, settings.max_deleted_ratio, settings.min_merge_segments),
            quick_backlog_seqs=settings.quick_build_backlog_seqs,
            quick_ef_construction=settings.quick_ef_construction,
            quick_window_s=settings.quick_window_s,
            on_publish=lambda shard, version: announce_version(broker, shard, version),
        )
        return cls(runtime, builder)
