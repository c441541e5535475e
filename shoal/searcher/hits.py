"""Search results: one `Hits` sequence per query, whose `Hit` objects are made when first read.

A search finds row numbers and distances; a hit's attributes (and vector) are values of an immutable table,
a segment's or a log tail's, that outlives the search. So a result keeps the row numbers and builds the k
`Hit` objects only when the caller reads them: a server that returns the ids or serializes the hits pays for
what it reads, once, and a search that nobody reads in full costs little more than the engine's call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, overload

import pyarrow as pa

from shoal.ingest.batch import SPARSE_INDICES, SPARSE_VALUES, VECTOR
from shoal.records import SparseVector


class Hit(NamedTuple):
    """One nearest data point: its id, split and payload attributes, its distance and (on request) its vector.

    A named tuple rather than a dataclass: a search builds k of them per query, and a tuple is built several
    times faster than a frozen dataclass (which sets each field through object.__setattr__).
    """

    attributes: dict[str, Any]
    distance: float
    vector: list[float] | SparseVector | None = None


# Builds a Hit from its three fields without the named tuple's keyword-handling __new__ (k times a query).
_new_hit = tuple.__new__


class RowSource:
    """The rows hits point into: an immutable table, its columns as Python lists (by name, converted once by
    whoever owns the table: a loaded segment keeps them across versions), and the attributes a hit carries."""

    __slots__ = ("column", "sparse", "stored", "table")

    def __init__(self, table: pa.Table, column: Callable[[str], list[Any]], stored: Sequence[str]) -> None:
        self.table = table
        self.column = column
        self.stored = tuple(stored)
        self.sparse = SPARSE_INDICES in table.column_names

    def hits(self, rows: Sequence[int], distances: Sequence[float], vectors: bool) -> list[Hit]:
        """The Hit of each (row, distance)."""
        pairs = [(a, self.column(a)) for a in self.stored]
        return [
            _new_hit(Hit, ({a: c[row] for a, c in pairs}, d, self.vector(row) if vectors else None))
            for row, d in zip(rows, distances, strict=True)
        ]

    def vector(self, row: int) -> list[float] | SparseVector:
        """The stored vector of a row."""
        if self.sparse:
            return SparseVector(self.table[SPARSE_INDICES][row].as_py(), self.table[SPARSE_VALUES][row].as_py())
        return self.table[VECTOR][row].as_py()


class Hits(Sequence[Hit]):
    """The hits of one query, nearest first: a read-only sequence of `Hit`.

    `distances` and `column(name)` read the results without making Hit objects; indexing or iterating makes
    all of them once. Equal to any sequence of equal hits (a list of Hit compares equal).
    """

    __slots__ = ("_hits", "_owners", "_sources", "_vectors", "distances", "rows")

    def __init__(
        self,
        rows: list[int],
        distances: list[float],
        sources: tuple[RowSource, ...],
        owners: list[int] | None = None,
        vectors: bool = False,
    ) -> None:
        # rows[i] is a row of sources[owners[i]] (of sources[0] when owners is None); all lists nearest first.
        self.rows = rows
        self.distances = distances
        self._sources = sources
        self._owners = owners
        self._vectors = vectors
        self._hits: list[Hit] | None = None

    def column(self, name: str) -> list[Any]:
        """The value of attribute `name` of each hit, nearest first (e.g. `hits.column("id")`)."""
        for source in self._sources:
            if name not in source.stored:
                raise KeyError(f"hits carry no attribute {name!r} (they carry {', '.join(source.stored)})")
        if self._owners is None:
            if not self.rows:
                return []
            return list(map(self._sources[0].column(name).__getitem__, self.rows))
        columns = [s.column(name) for s in self._sources]
        return [columns[o][r] for r, o in zip(self.rows, self._owners, strict=True)]

    def _all(self) -> list[Hit]:
        hits = self._hits
        if hits is None:
            if not self.rows:
                hits = []
            elif self._owners is None:
                hits = self._sources[0].hits(self.rows, self.distances, self._vectors)
            else:
                sources = self._sources
                pairs = [[(a, s.column(a)) for a in s.stored] for s in sources]
                hits = [
                    _new_hit(
                        Hit, ({a: c[r] for a, c in pairs[o]}, d, sources[o].vector(r) if self._vectors else None)
                    )
                    for r, d, o in zip(self.rows, self.distances, self._owners, strict=True)
                ]
            self._hits = hits
        return hits

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, i: int) -> Hit: ...

    @overload
    def __getitem__(self, i: slice) -> list[Hit]: ...

    def __getitem__(self, i: int | slice) -> Hit | list[Hit]:
        return self._all()[i]

    def __iter__(self) -> Iterator[Hit]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return self._all() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compares by content, like a list

    def __repr__(self) -> str:
        return f"Hits({self._all()!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickles as the plain list of hits: the rows it points into are not worth shipping.
        return (list, (self._all(),))


def attributes_of(hits: Sequence[Hit]) -> list[dict[str, Any]]:
    """Just the attributes of each hit (handy in tests and the CLI)."""
    return [h.attributes for h in hits]
