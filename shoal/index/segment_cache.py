"""The cache of loaded index segments, shared by a process's searchers (and, with its own budget, its
builders), accounted in bytes, and the hand-back of freed memory to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, TypeVar

import pyarrow as pa

from shoal.index.manifest import SegmentEntry
from shoal.index.segment import EntryLike, LoadedSegment, load_keys, load_segment
from shoal.log.records import IndexSpec
from shoal.storage import Storage

_T = TypeVar("_T")


class SegmentCache:
    """Loaded segments by id, accounted in bytes. Segments are immutable, so sharing them is safe.

    A searcher's cache (`keep_unheld=False`) keeps a segment while some holder names it among the segments
    its views serve (`retain`) and drops it as soon as none does: a superseded segment goes with the last view
    that served it. `budget` is what the holders must keep `bytes` under; they unload their least recently used
    views to do so (`over_budget`). A builder's cache (`keep_unheld=True`) has no holders: it keeps the
    segments it loaded, least recently used dropped first, while they fit the budget.
    """

    def __init__(self, budget: int = 1 << 30, *, keep_unheld: bool = False) -> None:
        self.budget = budget
        self.keep_unheld = keep_unheld
        self._items: OrderedDict[str, LoadedSegment] = OrderedDict()
        self._held: dict[int, frozenset[str]] = {}  # holder -> the segment ids its views serve
        self._lock = threading.Lock()
        self.bytes = 0

    def load(self, storage: Storage, entry: EntryLike, index: IndexSpec) -> LoadedSegment:
        """The segment of `entry`, from cache or storage (checksums verified)."""
        entry = SegmentEntry.of(entry)
        hit = _recent(self._lock, self._items, entry.id)
        if hit is not None:
            return hit
        loaded = load_segment(storage, entry, index)
        with self._lock:
            kept = self._items.setdefault(entry.id, loaded)
            if kept is loaded:
                self.bytes += loaded.nbytes
                if self.keep_unheld:
                    self._trim_unheld()
        return kept

    def retain(self, holder: int, segments: Iterable[LoadedSegment]) -> None:
        """Record the segments `holder` serves now and drop every segment no holder serves."""
        with self._lock:
            ids = []
            for seg in segments:  # one a concurrent retain dropped while it loaded comes back
                ids.append(seg.id)
                self._items.setdefault(seg.id, seg)
            self._held[holder] = frozenset(ids)
            self._drop_unheld()

    def release(self, holder: int) -> None:
        """Forget a holder (a closed searcher): the segments only it served go."""
        with self._lock:
            self._held.pop(holder, None)
            self._drop_unheld()

    def trim(self) -> None:
        """Drop segments no holder serves, oldest first, while the cache is over its budget (what a search of
        older versions loaded: kept for the next such search while there is room)."""
        with self._lock:
            before = len(self._items)
            self._trim_unheld()
            if len(self._items) < before:
                release_free_memory()

    def _live(self) -> frozenset[str]:
        return frozenset().union(*self._held.values())

    def _drop_unheld(self) -> None:
        live = self._live()
        gone = [i for i in self._items if i not in live]
        for seg_id in gone:
            del self._items[seg_id]
        self.bytes = sum(seg.nbytes for seg in self._items.values())
        if gone:
            # Called under the lock, but cheap next to the load that replaced them; without it a long-running
            # searcher keeps the freed pages (bench/soak.py: RSS of a following API vs a fresh one).
            release_free_memory()

    def _trim_unheld(self) -> None:
        live = self._live()
        for seg_id in [i for i in self._items if i not in live]:  # oldest first
            if self.bytes <= self.budget or len(self._items) <= 1:
                return
            self.bytes -= self._items.pop(seg_id).nbytes

    def over_budget(self) -> int:
        """How many bytes the loaded segments pass the budget by (0 when within it)."""
        with self._lock:
            return max(0, self.bytes - self.budget)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


# What a cached key list costs beside its Arrow buffers (`keys.nbytes`): the pa.Array and its C++ ArrayData,
# buffer and type objects (outside Arrow's pool), the pool's 64-byte rounding of its two buffers, the segment id
# string and the OrderedDict entry. Measured (/tmp/b30/fx6/measure_keycache.py) as the RSS delta of 30,000
# KeyCache.get calls on real keys files of 1, 10 and 100 rows, minus their nbytes: 861, 869 and 1,065 bytes an
# entry, where nbytes said 15, 146 and 1,553. Rounded up, so the budget bounds real memory for tiny segments.
KEY_ENTRY_OVERHEAD_BYTES = 1 << 10


class KeyCache:
    """The keys of segments by id, in row order, read from their keys file (`load_keys`); least recently used
    dropped past `budget` bytes, each entry charged its Arrow bytes plus KEY_ENTRY_OVERHEAD_BYTES. A build marks
    the rows of its shard's older segments whose keys newer entries replace: it needs their keys, never their
    engines (segments are immutable, so a key list never goes stale)."""

    def __init__(self, budget: int = 256 << 20) -> None:
        self.budget = budget
        self._items: OrderedDict[str, pa.Array] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0

    def get(self, storage: Storage, entry: EntryLike) -> pa.Array:
        """The keys of `entry`'s segment, row by row (checksum verified when read)."""
        entry = SegmentEntry.of(entry)
        hit = _recent(self._lock, self._items, entry.id)
        if hit is not None:
            return hit
        keys = load_keys(storage, entry)
        with self._lock:
            if entry.id not in self._items:
                self._items[entry.id] = keys
                self.bytes += _key_cost(keys)
                while self.bytes > self.budget and len(self._items) > 1:
                    self.bytes -= _key_cost(self._items.popitem(last=False)[1])
        return keys

    def discard(self, segment_ids: Iterable[str]) -> None:
        """Forget the keys of these segments (ones a merge replaced: no later build reads them)."""
        with self._lock:
            for seg_id in segment_ids:
                keys = self._items.pop(seg_id, None)
                if keys is not None:
                    self.bytes -= _key_cost(keys)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


def _key_cost(keys: pa.Array) -> int:
    """What a cached key list is charged: its Arrow bytes and the fixed cost of an entry."""
    return keys.nbytes + KEY_ENTRY_OVERHEAD_BYTES


def _recent(lock: threading.Lock, items: OrderedDict[str, _T], key: str) -> _T | None:
    """The item cached under `key`, now the most recently used; None when there is none."""
    with lock:
        hit = items.get(key)
        if hit is not None:
            items.move_to_end(key)
        return hit


def release_free_memory() -> None:
    """Hand memory freed by dropped segments back to the system: Arrow's pool keeps freed blocks for reuse,
    and glibc's malloc keeps freed heap pages (hnswlib's graphs, NumPy arrays) unless trimmed."""
    pa.default_memory_pool().release_unused()
    if _malloc_trim is not None:
        _malloc_trim(0)


def _find_malloc_trim() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


_malloc_trim = _find_malloc_trim()
