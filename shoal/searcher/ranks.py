"""Strings of a column compared through their ranks: each row holds the rank of its string among the column's
distinct strings in Python's order (code points, which is also UTF-8's byte order, arrow's), so equality is one
bisection and an integer comparison per row, a range two bisections, whatever the strings' number or length."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

__all__ = ["Ranked"]

_RANK = np.int32  # half the bytes of int64 to compare: a table's rows are far fewer than 2^31
_FEW = 6  # `among` compares per value up to this many values (about 4 us a pass over 59,000 rows), else looks up
# Distinct strings up to this many bytes are bisected as Python strings; more (a column of texts) stay in arrow
# and are read one string per bisection step, rather than copied into Python objects for good.
_PYTHON_BYTES = 4 << 20


class _ArrowStrings(Sequence[str]):
    """Sorted strings held by an arrow array, as a sequence that bisections read one item at a time."""

    def __init__(self, array: pa.Array) -> None:
        self._array = array

    def __len__(self) -> int:
        return len(self._array)

    def __getitem__(self, i: Any) -> Any:
        return self._array[i].as_py()


class Ranked:
    """Per row the rank of its string in `distinct` (sorted); a row without a string holds len(distinct)."""

    __slots__ = ("distinct", "ranks")

    def __init__(self, ranks: np.ndarray, distinct: Sequence[str]) -> None:
        self.ranks = ranks
        self.distinct = distinct

    @classmethod
    def of_codes(cls, codes: np.ndarray, dictionary: pa.Array) -> Ranked:
        """From dictionary codes into `dictionary` (distinct strings, any order); a code len(dictionary) is no
        string. Arrow sorts them: UTF-8 bytes sort in code point order, as Python's strings do."""
        order = pc.array_sort_indices(dictionary).to_numpy()
        rank_of = np.empty(len(dictionary) + 1, dtype=_RANK)
        rank_of[order] = np.arange(len(dictionary))
        rank_of[-1] = len(dictionary)
        ordered = dictionary.take(order)
        distinct = ordered.to_pylist() if ordered.nbytes <= _PYTHON_BYTES else _ArrowStrings(ordered)
        return cls(rank_of[codes], distinct)

    @classmethod
    def of_values(cls, values: list[Any]) -> Ranked:
        """From Python values, of which only the strings count."""
        distinct = sorted({v for v in values if type(v) is str})
        rank = {s: i for i, s in enumerate(distinct)}
        none = len(distinct)
        ranks = np.fromiter((rank[v] if type(v) is str else none for v in values), dtype=_RANK, count=len(values))
        return cls(ranks, distinct)

    def present(self) -> np.ndarray:
        """True where the row holds a string."""
        return self.ranks < len(self.distinct)

    def equal(self, value: str) -> np.ndarray:
        """True where the row's string is `value`."""
        at = self._rank(value)
        return np.zeros(len(self.ranks), dtype=bool) if at is None else self.ranks == at

    def among(self, values: Iterable[str]) -> np.ndarray:
        """True where the row's string is one of `values`."""
        found = {at for value in values if (at := self._rank(value)) is not None}
        if len(found) > _FEW:  # one lookup per row beats a comparison pass per value
            table = np.zeros(len(self.distinct) + 1, dtype=bool)
            table[list(found)] = True
            return table[self.ranks]
        hit = np.zeros(len(self.ranks), dtype=bool)
        for at in found:
            hit |= self.ranks == at
        return hit

    def _rank(self, value: str) -> int | None:
        at = bisect_left(self.distinct, value)
        return at if at < len(self.distinct) and self.distinct[at] == value else None

    def order(self, op: str, value: str) -> np.ndarray:
        """True where the row's string is `op` ($gt, $gte, $lt, $lte) `value`."""
        # The strings above `value` (or at least it) are the ranks from a bisection on; those below, up to one.
        cut = (bisect_right if op in ("$gt", "$lte") else bisect_left)(self.distinct, value)
        if op in ("$gt", "$gte"):
            return (self.ranks >= cut) & self.present()
        return self.ranks < cut
