"""Backpressure: when an index lags its data source by more than the configured bound, intake slows down.

The bound is on what the indexers have not built yet (head - built watermark), so under overload the lag,
not a process's memory, is what grows: HTTP uploads answer 429 with Retry-After and the message consumer
stops taking messages (they wait in the broker's queue) until the indexers catch up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from shoal.catalog.indexes import ShardCatalog
from shoal.errors import BackpressureError


class Backpressure:
    """Answers "is this data source's intake to be held back?" from the catalog, at most once a second."""

    def __init__(self, shards: ShardCatalog, bound: int, retry_after_s: int, *, ttl_s: float = 1.0) -> None:
        self.shards = shards
        self.bound = bound  # 0: no bound
        self.retry_after_s = retry_after_s
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._checked = -float("inf")
        self._lags: dict[int, int] = {}

    def lags(self) -> dict[int, int]:
        """Data source id -> its largest index lag in seqs (cached for `ttl_s`)."""
        with self._lock:
            if time.monotonic() - self._checked > self.ttl_s:
                self._lags = self.shards.index_lag()
                self._checked = time.monotonic()
            return self._lags

    def over(self, source_ids: Iterable[int]) -> dict[int, int]:
        """The given sources whose lag passes the bound, with their lag; empty when there is no bound."""
        if not self.bound:
            return {}
        lags = self.lags()
        return {sid: lags[sid] for sid in source_ids if lags.get(sid, 0) > self.bound}

    def check(self, source_id: int, name: str) -> None:
        """Raise BackpressureError when the source's indexes lag past the bound (nothing is written then)."""
        over = self.over([source_id])
        if over:
            raise BackpressureError(
                f"indexes of data source {name!r} lag {over[source_id]:,} seqs behind its head "
                f"(bound SHOAL_MAX_INDEX_LAG_SEQS = {self.bound:,}): retry later",
                self.retry_after_s,
            )
