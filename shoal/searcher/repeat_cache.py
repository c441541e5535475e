"""A cache for what searches derive per segment and filter (masks, gathered rows): bounded by bytes, least
recently used out, and keeping a value only from the second time it is asked for.

A server sees some filters again and again (a tenant, a section) and others once (a range per request). Kept at
once, every one-off filter would take memory no later search uses and push out the values of the filters that
repeat; remembered by key alone the first time, it costs a few bytes, and a filter that comes back is kept.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class RepeatCache(Generic[V]):
    """Thread-safe. `size(value)` is a value's bytes; `remember` bounds the keys asked for once and not kept."""

    def __init__(self, max_bytes: int, size: Callable[[V], int], remember: int = 8192) -> None:
        self.max_bytes = max_bytes
        self.remember = remember
        self._size = size
        self._items: OrderedDict[Hashable, V] = OrderedDict()
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], V]) -> V:
        """The value under `key`: the kept one, or `make()`'s, which is kept when `key` was asked for before
        (and fits)."""
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
                return found
            again = key in self._seen
            if not again:
                self._seen[key] = None
                if len(self._seen) > self.remember:
                    self._seen.popitem(last=False)
        made = make()
        if not again:
            return made
        nbytes = self._size(made)
        with self._lock:
            self._seen.pop(key, None)
            if key not in self._items and nbytes <= self.max_bytes:
                self._items[key] = made
                self._bytes += nbytes
                while self._bytes > self.max_bytes:
                    _, old = self._items.popitem(last=False)
                    self._bytes -= self._size(old)
        return made

    @property
    def nbytes(self) -> int:
        """Bytes of the values kept."""
        with self._lock:
            return self._bytes

    def clear(self) -> None:
        """Forget every value kept and every key seen."""
        with self._lock:
            self._items.clear()
            self._seen.clear()
            self._bytes = 0
