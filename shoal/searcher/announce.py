"""Announcements to searchers on Redis: a shard has a new active version, an index changed whole or is gone.
Best effort: searchers also poll the catalog, so a lost message costs at most a poll interval.

An index changed whole (dropped, swapped by a reindex, rolled back) also gets its data source's index token,
the key `shoal:indexes:<source id>`, set to a fresh value before the change returns. A strong search of a
following searcher reads it with the announced head (one MGET, no catalog round trip) and asks the catalog
whether the index it serves still exists only when the token differs from the one it last checked it under, so
it learns of a drop at once, not when the announcement reaches its poll thread."""

from __future__ import annotations

import json
import logging
import uuid

import redis

from shoal.catalog.indexes import IndexRecord
from shoal.log.heads import SentRead, head_key

log = logging.getLogger(__name__)

VERSIONS_CHANNEL = "shoal:index-versions"


def index_token_key(source_id: int) -> str:
    """The Redis key whose value changes whenever an index over the data source is dropped, swapped or rolled
    back (a random token, never a counter: a Redis flushed or restarted meanwhile cannot bring an old value
    back as the current one)."""
    return f"shoal:indexes:{source_id}"


def announce_version(redis_url: str, shard_id: int, version_id: int) -> None:
    """Tell searchers a shard has a new active version (0: reload the shard whatever it serves)."""
    announce_versions(redis_url, [(shard_id, version_id)])


def announce_versions(redis_url: str, changes: list[tuple[int, int]], token_of: int | None = None) -> None:
    """Tell searchers several shards changed, on one connection (one round trip); `token_of`: a data source
    whose index token is set anew first (`index_token_key`)."""
    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        try:
            pipe = client.pipeline(transaction=False)
            if token_of is not None:
                pipe.set(index_token_key(token_of), uuid.uuid4().hex)
            for shard_id, version_id in changes:
                pipe.publish(VERSIONS_CHANNEL, json.dumps({"shard": shard_id, "version": version_id}))
            pipe.execute()
        finally:
            client.close()
    except redis.RedisError as exc:
        log.warning("could not announce new versions of shards %s: %s", [c[0] for c in changes], exc)


def announce_index(redis_url: str, index: IndexRecord) -> None:
    """Tell searchers an index changed whole (a reindex swap, a rollback) or was dropped: its data source's index
    token changes (strong searches check the index they serve in the catalog), and they reload what they serve
    of it, and stop serving it if it is gone."""
    announce_versions(redis_url, [(shard.id, 0) for shard in index.shards], token_of=index.source_id)


class HeadAndTokenRead(SentRead):
    """A read of a data source's announced head and index token (one MGET), sent at once and answered later
    (shoal.log.heads.SentRead). Raises redis.RedisError (or OSError) when Redis does not answer."""

    def __init__(self, client: redis.Redis, source_id: int) -> None:
        super().__init__(client, "MGET", head_key(source_id), index_token_key(source_id))

    def result(self) -> tuple[int | None, bytes | str | None]:
        """(announced head, index token); each None when Redis holds none. Waits for the answer if need be."""
        head, token = self.answer()
        return (None if head is None else int(head)), token
