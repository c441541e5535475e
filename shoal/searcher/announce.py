"""Announcements to searchers on a Redis channel: a shard has a new active version, an index changed whole or
is gone. Best effort: searchers also poll the catalog, so a lost message costs at most a poll interval."""

from __future__ import annotations

import json
import logging

import redis

from shoal.catalog.indexes import IndexRecord

log = logging.getLogger(__name__)

VERSIONS_CHANNEL = "shoal:index-versions"


def announce_version(redis_url: str, shard_id: int, version_id: int) -> None:
    """Tell searchers a shard has a new active version (0: reload the shard whatever it serves)."""
    announce_versions(redis_url, [(shard_id, version_id)])


def announce_versions(redis_url: str, changes: list[tuple[int, int]]) -> None:
    """Tell searchers several shards changed, on one connection."""
    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        try:
            for shard_id, version_id in changes:
                client.publish(VERSIONS_CHANNEL, json.dumps({"shard": shard_id, "version": version_id}))
        finally:
            client.close()
    except redis.RedisError as exc:
        log.warning("could not announce new versions of shards %s: %s", [c[0] for c in changes], exc)


def announce_index(redis_url: str, index: IndexRecord) -> None:
    """Tell searchers an index changed whole (a reindex swap, a rollback) or was dropped: they reload what
    they serve of it, and stop serving it if it is gone."""
    announce_versions(redis_url, [(shard.id, 0) for shard in index.shards])
