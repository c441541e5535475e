"""A Redis cache of dataset catalog entries, best effort: a cache that is down never fails a request.

Keys (DESIGN.md tenants never share a key: the tenant is part of every key):

- `dataset:info:{tenant}:{dataset}`: a string, the dataset's catalog entry as JSON; TTL 1 hour.
- `dataset:list:{tenant}`: a hash, one field `{limit}:{offset}` per cached page holding
  `{"total": n, "datasets": [entries]}`; TTL 5 minutes, set when the hash is created (so no page is older than
  5 minutes however many pages are added later).

Create, update and delete invalidate both the dataset's info key and the tenant's list key, before and after
the catalog change (a reader that read the catalog just before the change cannot leave its stale copy behind
the second invalidation unless it writes after it, which the short list TTL and the next change bound).

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

from shoal.datasets.catalog import DatasetRecord

log = logging.getLogger(__name__)
T = TypeVar("T")

INFO_TTL_S = 3600
LIST_TTL_S = 300


def info_key(tenant: str, name: str) -> str:
    """The key of a dataset's cached catalog entry."""
    return f"dataset:info:{tenant}:{name}"


def list_key(tenant: str) -> str:
    """The key of the tenant's cached list pages (a hash by `{limit}:{offset}`)."""
    return f"dataset:list:{tenant}"


def page_field(limit: int, offset: int) -> str:
    """The hash field of one list page."""
    return f"{limit}:{offset}"


class DatasetCache:
    """Dataset info and list pages in Redis; every failure is logged and treated as a miss."""

    def __init__(self, url: Callable[[], str], *, timeout_s: float = 0.5, retry_after: float = 5.0) -> None:
        self._url = url
        self._timeout = timeout_s
        self._retry_after = retry_after
        self._client: redis.Redis | None = None
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
                    self._client = redis.Redis.from_url(
                        self._url(), socket_connect_timeout=self._timeout, socket_timeout=self._timeout
                    )
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

    def get_info(self, tenant: str, name: str) -> DatasetRecord | None:
        """The cached entry, or None (a miss, a corrupt entry or a cache that is down)."""
        raw = self._run(lambda c: c.get(info_key(tenant, name)))
        if raw is None:
            return None
        try:
            return DatasetRecord.from_json(json.loads(raw))
        except (ValueError, KeyError, TypeError):
            self._run(lambda c: c.delete(info_key(tenant, name)))
            return None

    def set_info(self, tenant: str, record: DatasetRecord) -> None:
        """Cache an entry for an hour."""
        self._run(lambda c: c.set(info_key(tenant, record.name), json.dumps(record.to_json()), ex=INFO_TTL_S))

    # -- list pages ----------------------------------------------------------------------------------------

    def get_list(self, tenant: str, limit: int, offset: int) -> tuple[list[DatasetRecord], int] | None:
        """A cached page and the total, or None."""
        raw = self._run(lambda c: c.hget(list_key(tenant), page_field(limit, offset)))
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            return [DatasetRecord.from_json(d) for d in data["datasets"]], int(data["total"])
        except (ValueError, KeyError, TypeError):
            self._run(lambda c: c.delete(list_key(tenant)))
            return None

    def set_list(self, tenant: str, limit: int, offset: int, records: list[DatasetRecord], total: int) -> None:
        """Cache a page; the hash expires 5 minutes after its first page was cached."""
        value = json.dumps({"total": total, "datasets": [r.to_json() for r in records]})

        def op(c: redis.Redis) -> None:
            key = list_key(tenant)
            pipe = c.pipeline(transaction=True)
            pipe.hset(key, page_field(limit, offset), value)
            pipe.ttl(key)
            _, ttl = pipe.execute()
            if ttl is None or int(ttl) < 0:
                c.expire(key, LIST_TTL_S)

        self._run(op)

    # -- invalidation --------------------------------------------------------------------------------------

    def invalidate(self, tenant: str, name: str) -> None:
        """Forget the dataset's entry and the tenant's list pages (remembered for later if Redis is down)."""
        keys = [info_key(tenant, name), list_key(tenant)]
        done = self._run(lambda c: c.delete(*keys))
        if done is None:
            with self._lock:
                self._pending.update(keys)

    def close(self) -> None:
        """Release the connection pool."""
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
