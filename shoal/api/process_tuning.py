"""The API process's memory management, tuned for request bodies of megabytes: Python's cyclic garbage collector
and glibc's malloc.

The collector.

A JSON upload of 1,000 points makes about ten thousand short-lived dicts and lists. With the collector running,
they outlive the young-generation collections their own allocation sets off, are promoted to the oldest
generation and soon start a full collection, which walks every container object in the process: 85-110 ms in an
API process (measured with gc.callbacks while 1,000-point JSON batches came in), a pause for every request in
flight, and the tail of bench/api.py's upload latency. Two remedies, both with no effect on what is freed:

- the objects a started process holds for good (modules, the app, the runtime) are moved out of the collector's
  sight once startup is done (gc.freeze), so a full collection walks only what came later;
- a decode runs with the collector paused: its objects die by reference counting when it ends, before the
  collector runs again, and garbage cycles made meanwhile wait for the next collection.

malloc. glibc serves a block of 128 KiB or more with a fresh mmap and unmaps it when freed (its threshold only
creeps up as such blocks are freed), so every request body of megabytes, and each copy of it on its way to the
route, is built in fresh pages, each one a page fault to fill (costly in a VM): a 7.5 MB upload answered 404 before
any decode took 10.9 ms, 3.7 ms with blocks up to 32 MiB kept in the heap (the difference is the faults). So the
API keeps such blocks in its heap for reuse; freed memory still goes back to the system past the trim threshold,
and whenever the searcher drops segments (shoal.index.segment_cache.release_free_memory trims the heap).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Iterator
from contextlib import contextmanager

# mallopt's parameters (malloc.h) and the values set: the largest mmap threshold glibc takes on 64-bit systems,
# and a trim threshold that keeps a few such blocks.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 128 << 20


def keep_large_blocks() -> bool:
    """Serve blocks up to MMAP_THRESHOLD_BYTES from the heap and keep up to TRIM_THRESHOLD_BYTES of freed heap
    for reuse; True when set, False where the C library is not glibc (nothing changes there)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD,
                                                                                    TRIM_THRESHOLD_BYTES))


def freeze_startup_objects() -> None:
    """Collect once, then exclude every object alive now from later collections (they stay alive anyway)."""
    gc.collect()
    gc.freeze()


@contextmanager
def collector_paused() -> Iterator[None]:
    """Run the block with automatic collection off, and restore the collector as it was. Callers that may run
    at once must serialise their blocks (one pause and resume pair at a time), since the switch is global."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
