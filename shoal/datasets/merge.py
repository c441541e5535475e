"""Merging the per-dataset result lists of a multi-dataset search (pure functions, no I/O).

Every list is in its own dataset's order, nearest first. With datasets D0..Dn-1 in the order the request
lists them and `r` a rank (position within a dataset's list, 0 = nearest):

- `score`: all results ordered by score in the metrics' common direction (ascending distances for cosine,
  euclidean and manhattan; descending for dot_product), ties by dataset order and then rank. Datasets whose
  metrics rank in opposite directions cannot be merged this way (the caller refuses them). Scores of different
  metrics with the same direction are compared as they are.
- `interleave`: rank by rank; within a rank, datasets in request order: D0[0], D1[0], ..., D0[1], D1[1], ...
- `round_robin`: rank by rank, but the dataset that goes first rotates: rank r starts at D(r mod n), so
  rank 0 is D0, D1, ..., rank 1 is D1, D2, ..., D0, and so on. No dataset is always first at a rank, so when
  `top_k` cuts a rank short the cut falls on a different dataset each time.

In every strategy a dataset with fewer results simply has no entry at the ranks it lacks, and the merged
list is cut at `top_k`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")

STRATEGIES = ("interleave", "score", "round_robin")


def by_score(lists: Sequence[Sequence[T]], scores: Sequence[Sequence[float]], higher_is_better: bool,
             top_k: int) -> list[tuple[int, int, T]]:
    """(dataset position, rank, item) of the best `top_k` items over all lists by score."""
    entries = [
        ((-s if higher_is_better else s), d, r, item)
        for d, (items, ss) in enumerate(zip(lists, scores, strict=True))
        for r, (item, s) in enumerate(zip(items, ss, strict=True))
    ]
    entries.sort(key=lambda e: (e[0], e[1], e[2]))
    return [(d, r, item) for _, d, r, item in entries[:top_k]]


def interleave(lists: Sequence[Sequence[T]], top_k: int) -> list[tuple[int, int, T]]:
    """(dataset position, rank, item): rank by rank, datasets in order within a rank."""
    return _by_rank(lists, top_k, rotate=False)


def round_robin(lists: Sequence[Sequence[T]], top_k: int) -> list[tuple[int, int, T]]:
    """(dataset position, rank, item): rank by rank, rank r starting at dataset r mod n."""
    return _by_rank(lists, top_k, rotate=True)


def _by_rank(lists: Sequence[Sequence[T]], top_k: int, *, rotate: bool) -> list[tuple[int, int, T]]:
    n = len(lists)
    out: list[tuple[int, int, T]] = []
    deepest = max((len(items) for items in lists), default=0)
    for r in range(deepest):
        start = r % n if rotate else 0
        for i in range(n):
            d = (start + i) % n
            if r < len(lists[d]):
                out.append((d, r, lists[d][r]))
                if len(out) == top_k:
                    return out
    return out


def merge(strategy: str, lists: Sequence[Sequence[Any]], scores: Sequence[Sequence[float]],
          higher_is_better: bool, top_k: int) -> list[tuple[int, int, Any]]:
    """Dispatch on the strategy's name (one of `STRATEGIES`)."""
    if strategy == "score":
        return by_score(lists, scores, higher_is_better, top_k)
    if strategy == "interleave":
        return interleave(lists, top_k)
    if strategy == "round_robin":
        return round_robin(lists, top_k)
    raise ValueError(f"unknown merge strategy {strategy!r}")
