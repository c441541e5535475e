"""Search results: one `Hits` sequence per query, whose `Hit` objects are made when first read.

A search finds row numbers and distances; a hit's attributes (and vector) are values of an immutable table,
a segment's or a log tail's, that outlives the search. So a result keeps the row numbers and builds the k
`Hit` objects only when the caller reads them: a server that returns the ids or serializes the hits pays for
what it reads, once, and a search that nobody reads in full costs little more than the engine's call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, overload

import numpy as np
import pyarrow as pa

from shoal.log.records import SparseVector
from shoal.log.validation import SPARSE_INDICES, SPARSE_VALUES, VECTOR


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
    """The rows hits point into: an immutable table and the attributes a hit carries from it.

    Each attribute is converted once, on first use, into `cache` (a loaded segment passes its own, so the
    conversions outlive a view): a numpy array for numbers and booleans without nulls, a list of Python values
    otherwise. Picking a few rows from a numpy array reads 8 bytes a row; from a list it also touches each
    value's Python object, which costs a cache miss per row when the hits are scattered over a large segment.
    """

    __slots__ = ("cache", "sparse", "stored", "table")

    def __init__(
        self, table: pa.Table, stored: Sequence[str], cache: dict[str, list[Any] | np.ndarray] | None = None
    ) -> None:
        self.table = table
        self.stored = tuple(stored)
        self.cache = {} if cache is None else cache
        self.sparse = SPARSE_INDICES in table.column_names

    def values(self, name: str) -> list[Any] | np.ndarray:
        """All values of a stored attribute, by row; KeyError for an attribute hits do not carry."""
        values = self.cache.get(name)
        if values is None:
            if name not in self.stored:
                raise KeyError(f"hits carry no attribute {name!r} (they carry {', '.join(self.stored)})")
            column = self.table[name]
            kind = column.type
            if column.null_count == 0 and (
                pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
            ):
                values = column.to_numpy()
            else:
                values = column.to_pylist()
            self.cache[name] = values
        return values

    def pick(self, name: str, rows: list[int]) -> list[Any]:
        """The Python values of a stored attribute at `rows`, in that order."""
        values = self.values(name)
        if type(values) is list:
            return list(map(values.__getitem__, rows))
        return values.take(rows).tolist() if rows else []  # type: ignore[union-attr]

    def attributes(self, rows: list[int]) -> list[dict[str, Any]]:
        """The attributes dict of each row."""
        stored = self.stored  # never empty: an index's id attributes are stored
        columns = [self.pick(a, rows) for a in stored]
        return [dict(zip(stored, values, strict=True)) for values in zip(*columns, strict=True)]

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
        if self._owners is None:
            if not self._sources:
                return []
            # RowSource.pick inlined: this runs once per query, and each Python call costs there.
            source = self._sources[0]
            values = source.cache.get(name) if name in source.stored else None
            if values is None:
                values = source.values(name)  # converts on first use; KeyError for an attribute not carried
            if type(values) is list:
                return list(map(values.__getitem__, self.rows))
            return values.take(self.rows).tolist() if self.rows else []  # type: ignore[union-attr]
        return self._by_source(lambda source, rows: source.pick(name, rows))

    def _by_source(self, read: Callable[[RowSource, list[int]], list[Any]]) -> list[Any]:
        """`read` applied to each source's rows at once, the results put back in hit order."""
        out: list[Any] = [None] * len(self.rows)
        owners = self._owners
        assert owners is not None
        for o, source in enumerate(self._sources):
            where = [i for i, owner in enumerate(owners) if owner == o]
            if where:
                for i, value in zip(where, read(source, [self.rows[i] for i in where]), strict=True):
                    out[i] = value
        return out

    def _all(self) -> list[Hit]:
        hits = self._hits
        if hits is None:
            if not self.rows:
                hits = []
            else:
                if self._owners is None:
                    attributes = self._sources[0].attributes(self.rows)
                else:
                    attributes = self._by_source(RowSource.attributes)
                if self._vectors:
                    sources, owners = self._sources, self._owners or [0] * len(self.rows)
                    vectors = [sources[o].vector(r) for r, o in zip(self.rows, owners, strict=True)]
                else:
                    vectors = [None] * len(self.rows)
                hits = [
                    _new_hit(Hit, fields) for fields in zip(attributes, self.distances, vectors, strict=True)
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
