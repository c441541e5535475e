"""Which segments of a shard a merge takes: tiered, smallest first, a few at a time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shoal.index.manifest import SegmentEntry


@dataclass(frozen=True)
class MergePolicy:
    """When segments get merged: too many of them, or one with too many dead rows. A merge the count makes due
    takes at least `min_merge` segments, the smallest: merging just enough to meet the bound (two at a time
    under steady ingest) rewrites each row far more often (bench/merge_policy.py)."""

    max_segments: int = 8
    max_deleted_ratio: float = 0.3
    min_merge: int = 4


def pick(
    policy: MergePolicy, segments: Sequence[SegmentEntry], force: bool = False, *, busy: bool = False
) -> list[int]:
    """Positions of the segments to merge: every segment with too many dead rows, every quickly built one once
    the shard is not `busy` (to rebuild it at the index's own parameters), plus the smallest ones while there are
    too many segments, at least `min_merge` of them then; empty when no merge is due. `force`: all of them."""
    if force:
        return list(range(len(segments)))
    dead = {
        i
        for i, s in enumerate(segments)
        if (s.rows and s.deleted_count / s.rows > policy.max_deleted_ratio) or (s.quick and not busy)
    }
    chosen = set(dead)
    smallest = (i for i in sorted(range(len(segments)), key=lambda i: segments[i].rows) if i not in dead)
    # Merging k segments into one removes k-1; take the smallest until the count is back in bounds ...
    while len(segments) - len(chosen) + (1 if chosen else 0) > policy.max_segments:
        chosen.add(next(smallest))
    # (Taking one more never lowers the count, so that loop takes none or at least two: a lone segment is picked
    # only for its own dead rows or quality.)
    if len(chosen) > len(dead):  # ... and when that made the merge due, at least `min_merge` of them.
        while len(chosen) < min(policy.min_merge, len(segments)):
            chosen.add(next(smallest))
    return sorted(chosen)
