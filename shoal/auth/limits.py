"""Failed authentications per client address, so a stream of bogus keys cannot turn the KDF into a CPU lever.

Each address gets a fixed window (`window_s`) from its first failure; once it has failed `limit` times in the
window, every authentication from it that would have to hash or query answers 429 until the window ends.
A key already verified still works from that address, cached (it costs nothing, so refusing it protects nothing)
or verified within the window before its verdict expired (shoal.auth.keys._check_limit). The table is bounded: an
attacker spraying addresses evicts the oldest windows first. Counts are per process: under `shoal api --workers
N` an address may fail up to N times the limit before every process refuses it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from shoal.errors import RateLimitedError

MAX_ADDRESSES = 100_000


class FailureLimiter:
    """Counts failed authentications per client address in fixed windows; thread-safe."""

    def __init__(
        self,
        limit: int,
        window_s: float,
        *,
        max_addresses: int = MAX_ADDRESSES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self.max_addresses = max_addresses
        self.clock = clock
        self._windows: dict[str, tuple[float, int]] = {}  # address -> (window start, failures in it)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """False when the limit is 0 (no limit)."""
        return self.limit > 0

    def check(self, address: str) -> None:
        """Return when `address` may try to authenticate; RateLimitedError with the seconds to wait otherwise."""
        if not self.enabled:
            return
        now = self.clock()
        with self._lock:
            found = self._windows.get(address)
            if found is None:
                return
            start, failures = found
            if now - start >= self.window_s:
                del self._windows[address]
                return
        if failures >= self.limit:
            wait = max(1, math.ceil(start + self.window_s - now))
            raise RateLimitedError(
                f"too many failed authentications from this address ({failures} in {self.window_s:g} s): "
                f"retry after {wait} s",
                retry_after=wait,
            )

    def failed(self, address: str) -> None:
        """Count one failed authentication of `address`."""
        if not self.enabled:
            return
        now = self.clock()
        with self._lock:
            found = self._windows.get(address)
            if found is None or now - found[0] >= self.window_s:
                if found is None and len(self._windows) >= self.max_addresses:
                    self._prune(now)
                self._windows[address] = (now, 1)
            else:
                self._windows[address] = (found[0], found[1] + 1)

    def _prune(self, now: float) -> None:
        for address in [a for a, (start, _) in self._windows.items() if now - start >= self.window_s]:
            del self._windows[address]
        if len(self._windows) >= self.max_addresses:  # still full: forget the oldest half of the windows
            oldest = sorted(self._windows, key=lambda a: self._windows[a][0])
            for address in oldest[: len(oldest) // 2]:
                del self._windows[address]
