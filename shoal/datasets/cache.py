"""A Redis cache of dataset catalog entries, best effort: a cache that is down never fails a request.

Keys (DESIGN.md tenants never share a key: the tenant's id is part of every key):

- `dataset:info:{tenant_id}:{dataset}`: a string, the dataset's catalog entry as JSON with the tenant's id
  (`"tenant_id"`); TTL 1 hour.
- `dataset:list:{tenant_id}`: a hash, one field `{limit}:{offset}` per cached page holding
  `{"tenant_id": id, "total": n, "datasets": [entries]}`; TTL 5 minutes, set when the hash is created (so no page
  is older than 5 minutes however many pages are added later).

An entry is trusted only when the tenant id inside it is the reader's (and an info entry's name the one asked
for): anything else, whoever wrote it, is a miss, logged and deleted. The tenant's id, not its name, so a tenant
made again under an old name never reads what the old one cached.

- `dataset:gen:{tenant_id}:{dataset}` and `dataset:gen:{tenant_id}`: generation counters of the dataset's
  entry and of the tenant's list pages, bumped by every invalidation; TTL 1 hour from the last bump.

Create, update and delete invalidate both the dataset's info key and the tenant's list key, before and after
the catalog change. A reader reads the generation before it reads the catalog, and caches what it read only if
the generation is still the one it read (checked and written in one Lua script): a reader that read the catalog
before a change and writes after the change's invalidation writes nothing, so no stale copy outlives a change.

When Redis cannot be reached the cache stays out of the way for `retry_after` seconds (no request waits on a
dead server), reads fall through to the catalog, and invalidations that could not be made are remembered and
made first once Redis answers again (in this process; entries another process cached before the outage
expire with their TTL).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from redis.commands.core import Script

from shoal.datasets.catalog import DatasetRecord

log = logging.getLogger(__name__)
T = TypeVar("T")

INFO_TTL_S = 3600
LIST_TTL_S = 300
GENERATION_TTL_S = 3600  # a counter must outlive a reader's catalog read, not the entries


def info_key(tenant_id: int, name: str) -> str:
    """The key of a dataset's cached catalog entry."""
    return f"dataset:info:{tenant_id}:{name}"


def list_key(tenant_id: int) -> str:
    """The key of the tenant's cached list pages (a hash by `{limit}:{offset}`)."""
    return f"dataset:list:{tenant_id}"


def page_field(limit: int, offset: int) -> str:
    """The hash field of one list page."""
    return f"{limit}:{offset}"


def info_generation_key(tenant_id: int, name: str) -> str:
    """The key of the generation counter of a dataset's cached entry."""
    return f"dataset:gen:{tenant_id}:{name}"


def list_generation_key(tenant_id: int) -> str:
    """The key of the generation counter of the tenant's cached list pages."""
    return f"dataset:gen:{tenant_id}"


# Write an entry only while the generation is the one the writer read before it read the catalog (an absent
# counter reads as ""). KEYS: generation, entry; ARGV: generation read, value, TTL.
_SET_IF_CURRENT = """
if (redis.call('GET', KEYS[1]) or '') ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
return 1
"""
# As above for a list page. KEYS: generation, hash; ARGV: generation read, field, value, TTL (set when the hash
# is created, so no page is older than the TTL however many pages are added later).
_HSET_IF_CURRENT = """
if (redis.call('GET', KEYS[1]) or '') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
if redis.call('TTL', KEYS[2]) < 0 then redis.call('EXPIRE', KEYS[2], ARGV[4]) end
return 1
"""


class DatasetCache:
    """Dataset info and list pages in Redis; every failure is logged and treated as a miss."""

    def __init__(self, url: Callable[[], str], *, timeout_s: float = 0.5, retry_after: float = 5.0) -> None:
        self._url = url
        self._timeout = timeout_s
        self._retry_after = retry_after
        self._client: redis.Redis | None = None
        self._set_if_current: Script  # set with the client
        self._hset_if_current: Script
        self._down_until = 0.0
        self._pending: set[str] = set()  # keys whose invalidation failed
        self._lock = threading.Lock()

    # -- plumbing ------------------------------------------------------------------------------------------

    def _connect(self) -> redis.Redis | None:
        with self._lock:
            if time.monotonic() < self._down_until:
                return None
            if self._client is None:
                try:
                    client = redis.Redis.from_url(
                        self._url(), socket_connect_timeout=self._timeout, socket_timeout=self._timeout
                    )
                    # Sent by their hash (EVALSHA), the body only once per server (redis-py loads it on a miss).
                    self._set_if_current = client.register_script(_SET_IF_CURRENT)
                    self._hset_if_current = client.register_script(_HSET_IF_CURRENT)
                    self._client = client
                except Exception as exc:  # noqa: BLE001 - a bad URL or an embedded server that will not start
                    self._mark_down(exc)
                    return None
            return self._client

    def _mark_down(self, exc: BaseException) -> None:
        if time.monotonic() >= self._down_until:
            log.warning("dataset cache unavailable for %.0fs, serving from the catalog: %s", self._retry_after, exc)
        self._down_until = time.monotonic() + self._retry_after

    def _run(self, op: Callable[[redis.Redis], T]) -> T | None:
        client = self._connect()
        if client is None:
            return None
        try:
            with self._lock:
                pending = sorted(self._pending)
            if pending:
                client.delete(*pending)
                with self._lock:
                    self._pending.difference_update(pending)
            return op(client)
        except (redis.RedisError, OSError) as exc:
            with self._lock:
                self._mark_down(exc)
            return None

    @property
    def available(self) -> bool:
        """False while the cache is considered down."""
        return time.monotonic() >= self._down_until

    # -- dataset info --------------------------------------------------------------------------------------

    def get_info(self, tenant_id: int, name: str) -> DatasetRecord | None:
        """The cached entry of the tenant's dataset, or None (a miss, a corrupt entry, an entry of another tenant
        or dataset, or a cache that is down)."""
        key = info_key(tenant_id, name)
        raw = self._run(lambda c: c.get(key))
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            record = DatasetRecord.from_json(data)
            owner = data.get("tenant_id")
        except (ValueError, KeyError, TypeError, AttributeError):
            self._run(lambda c: c.delete(key))
            return None
        if owner != tenant_id or record.name != name:
            self._distrust(key, owner)
            return None
        return record

    def _generation(self, key: str) -> str | None:
        """The generation counter at `key` ("" when absent), or None when the cache is down."""
        return self._run(lambda c: (c.get(key) or b"").decode())

    def info_generation(self, tenant_id: int, name: str) -> str | None:
        """The generation of the dataset's entry, to read before the catalog and hand to `set_info`; None when
        the cache is down (then nothing is cached)."""
        return self._generation(info_generation_key(tenant_id, name))

    def set_info(self, tenant_id: int, record: DatasetRecord, generation: str) -> bool:
        """Cache an entry of the tenant for an hour, only if the entry's generation is still `generation` (read
        before the catalog was): an invalidation since means the entry may be stale, and it is not written.
        Whether it was written."""
        value = json.dumps(record.to_json() | {"tenant_id": tenant_id})
        keys = (info_generation_key(tenant_id, record.name), info_key(tenant_id, record.name))
        done = self._run(lambda c: self._set_if_current(keys, [generation, value, INFO_TTL_S], client=c))
        return bool(done)

    def _distrust(self, key: str, owner: object) -> None:
        """Delete an entry that does not belong where it was found (a bug or a poisoned cache), saying so."""
        log.warning("dataset cache: ignored and deleted %s, which holds an entry of tenant id %r", key, owner)
        self._run(lambda c: c.delete(key))

    # -- list pages ----------------------------------------------------------------------------------------

    def get_list(self, tenant_id: int, limit: int, offset: int) -> tuple[list[DatasetRecord], int] | None:
        """A cached page of the tenant and the total, or None (as `get_info`)."""
        key = list_key(tenant_id)
        raw = self._run(lambda c: c.hget(key, page_field(limit, offset)))
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            page = [DatasetRecord.from_json(d) for d in data["datasets"]], int(data["total"])
            owner = data.get("tenant_id")
        except (ValueError, KeyError, TypeError, AttributeError):
            self._run(lambda c: c.delete(key))
            return None
        if owner != tenant_id:
            self._distrust(key, owner)
            return None
        return page

    def list_generation(self, tenant_id: int) -> str | None:
        """The generation of the tenant's list pages, to read before the catalog and hand to `set_list`; None
        when the cache is down."""
        return self._generation(list_generation_key(tenant_id))

    def set_list(
        self, tenant_id: int, limit: int, offset: int, records: list[DatasetRecord], total: int, generation: str
    ) -> bool:
        """Cache a page of the tenant, only if the pages' generation is still `generation` (as `set_info`); the
        hash expires 5 minutes after its first page was cached. Whether it was written."""
        value = json.dumps({"tenant_id": tenant_id, "total": total, "datasets": [r.to_json() for r in records]})
        keys = (list_generation_key(tenant_id), list_key(tenant_id))
        args = [generation, page_field(limit, offset), value, LIST_TTL_S]
        done = self._run(lambda c: self._hset_if_current(keys, args, client=c))
        return bool(done)

    # -- invalidation --------------------------------------------------------------------------------------

    def invalidate(self, tenant_id: int, name: str) -> None:
        """Forget the dataset's entry and the tenant's list pages, and bump their generations so that a reader
        who read the catalog before now caches nothing (remembered for later if Redis is down)."""
        keys = [info_key(tenant_id, name), list_key(tenant_id)]
        generations = [info_generation_key(tenant_id, name), list_generation_key(tenant_id)]

        def op(c: redis.Redis) -> bool:
            pipe = c.pipeline(transaction=True)
            pipe.delete(*keys)
            for key in generations:
                pipe.incr(key)
                pipe.expire(key, GENERATION_TTL_S)
            pipe.execute()
            return True

        if self._run(op) is None:
            with self._lock:
                # Deleting a counter changes it as well (from any value a reader may hold but "").
                self._pending.update(keys + generations)

    def close(self) -> None:
        """Release the connection pool."""
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
