"""Log tails: the entries a shard's served version does not reflect yet, as a search uses them.

A tail is the keys its entries touch (they hide those keys' rows in the built segments) and its live upserts,
searched exactly. The live upserts are kept in chunks whose keys are disjoint: a tail extended by newer entries
keeps its chunks (and the exact engines built over them) and only drops from them the keys the new entries touch,
so a searcher following a busy log pays per extension for what is new, not for everything it holds. Chunks of
similar size are merged (as a binary counter carries), so a tail of n rows has O(log n) chunks and each row is
copied O(log n) times.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shoal.engines import Engine, get_engine
from shoal.index.segment import (
    ATTRIBUTE_OVERHEAD_BYTES,
    ROW_OVERHEAD_BYTES,
    LoadedSegment,
    engine_overhead,
    json_value,
    vectors_of,
)
from shoal.index.sharding import shard_numbers, split_keys
from shoal.log.reader import fold
from shoal.log.records import DataSourceSpec, IndexSpec
from shoal.log.validation import KEY, SEQ
from shoal.searcher.hits import RowSource
from shoal.searcher.views import IndexView

_GROUP_IDS = itertools.count()  # never reused within a process, unlike id()

# The key -> row index of a segment, kept in its py_columns cache under a name no attribute can have.
_KEY_ROWS = " key rows"

# What a young tier costs however few its rows, beside the per-row counts (as a loaded segment's, see
# shoal.index.segment): per shard's tail, its Python objects (the Tail, its touched set and derived dicts) and
# its share of the young tier's (the TailCache, its entries table's schema and columns, the view); per chunk, its
# upserts table's. Measured as the RSS delta of loading 400 unbuilt indexes of 10 rows (16-d, two stored
# attributes; one tail, chunk and group each) in one following searcher, divided: about 30 KB each where the
# per-row counts said 5 KB. Each group counts its exact engine's own (`engine_overhead`).
TAIL_OVERHEAD_BYTES = 16 << 10
CHUNK_OVERHEAD_BYTES = 4 << 10


def array_bytes(*objects: Any) -> int:
    """Bytes of the arrays among `objects` and their attributes, one level deep (an engine's vectors and norms,
    a filter's derived columns): an estimate of what they hold in memory, not an exact count."""
    total = 0
    for obj in objects:
        size = getattr(obj, "nbytes", None)
        if isinstance(size, int):
            total += size
            continue
        members = [getattr(obj, name, None) for name in getattr(obj, "__slots__", ())]
        members += list(getattr(obj, "__dict__", {}).values())
        total += sum(m.nbytes for m in members if isinstance(getattr(m, "nbytes", None), int))
    return total


@dataclass(frozen=True)
class TailGroup:
    """One split's live upserts of one chunk, with an exact engine over them."""

    values: dict[str, Any]  # the split's attribute values
    source: RowSource  # the upserts
    engine: Engine  # exact: the tail is small and must be answered exactly
    # What filters derive from the upserts' columns (numpy values, string ranks), kept with the group: its
    # chunk outlives many extensions of the tail.
    filter_columns: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    # Names the group in the searcher's caches of filter masks and subsets, as a segment id does a segment.
    cache_id: str = field(default_factory=lambda: f"young-{next(_GROUP_IDS)}", compare=False, repr=False)

    def nbytes(self, upserts: pa.Table) -> int:
        """Estimated bytes the group holds beside its chunk's `upserts`: the split's rows (none of their own when
        the index has no split attributes: the group's rows are then the upserts themselves), its engine's arrays
        and what filters derived from them."""
        own_rows = 0 if self.source.table is upserts else self.source.table.nbytes
        fixed = engine_overhead(self.engine.algorithm)
        return fixed + own_rows + array_bytes(self.engine, *self.filter_columns.values())


@dataclass(frozen=True)
class TailChunk:
    """Live upserts of a tail, one row per key, none of them touched by a newer entry of the tail."""

    upserts: pa.Table
    _groups: list[TailGroup] = field(default_factory=list, compare=False, repr=False)

    def groups(self, spec: IndexSpec, source: DataSourceSpec) -> list[TailGroup]:
        """The chunk's upserts per split (combination of split values), each with an exact engine; built once."""
        if not self._groups and self.upserts.num_rows:
            table = self.upserts
            keys = split_keys(table, spec.split_attributes).to_numpy(zero_copy_only=False)
            engine_cls = get_engine("flat_sparse" if source.vectors_are_sparse else "flat")
            for key in dict.fromkeys(keys.tolist()):
                part = table.filter(pa.array(keys == key)) if spec.split_attributes else table
                first = part.slice(0, 1).to_pylist()[0]
                vectors = vectors_of(part, source.vectors_are_sparse, source.vector_dimension)
                self._groups.append(TailGroup({a: json_value(first[a]) for a in spec.split_attributes},
                                              RowSource(part, spec.stored_attributes()),
                                              engine_cls.build(vectors, spec.metric, None)))
        return self._groups

    def nbytes(self, stored_attributes: int) -> int:
        """Estimated bytes the chunk holds: its upserts (with what a search converts of each row, counted up
        front for `stored_attributes` attributes as a segment's are) and the groups built over them."""
        rows = self.upserts.num_rows
        per_row = ROW_OVERHEAD_BYTES + ATTRIBUTE_OVERHEAD_BYTES * stored_attributes
        groups = sum(g.nbytes(self.upserts) for g in self._groups)
        return CHUNK_OVERHEAD_BYTES + self.upserts.nbytes + rows * per_row + groups


@dataclass(frozen=True)
class Tail:
    """Log entries a shard's served version does not reflect yet: keys they touch, and their live upserts.

    What queries derive from it (the segment rows it hides, exact engines over its upserts) is built on first
    use and kept with it, so a searcher that reuses a tail pays for that once, not per query; a tail extended
    from another (`extended`) starts from what that one derived.
    """

    touched: frozenset[str]
    chunks: tuple[TailChunk, ...]
    _derived: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    # An older tail's masks (segment id -> mask or None) and the keys touched since: hidden_rows starts there.
    _since: tuple[dict[str, np.ndarray | None], list[str]] | None = field(default=None, compare=False, repr=False)
    # Estimated bytes of `touched` (`_keys_bytes`), carried over as the tail is extended: the searcher checks its
    # budget after every extension, and summing 20,000 keys again took a third of the extension's time.
    key_bytes: int = field(default=0, compare=False, repr=False)

    @classmethod
    def of(cls, entries: pa.Table) -> Tail:
        """The tail of some log entries of one shard."""
        keys = pc.unique(entries[KEY])
        return cls(frozenset(keys.to_pylist()), _chunks([TailChunk(fold(entries.to_batches()))]),
                   key_bytes=_keys_bytes(keys))

    @property
    def upserts(self) -> pa.Table:
        """Every live upsert of the tail (one row per key)."""
        tables = [c.upserts for c in self.chunks]
        return tables[0] if len(tables) == 1 else pa.concat_tables(tables)

    def hidden_rows(self, seg: LoadedSegment) -> np.ndarray | None:
        """Bool per row of `seg`, true where the tail updates or deletes the row's key; None when none is."""
        key = ("hidden", seg.id)
        if key not in self._derived:
            if self._since is not None and seg.id in self._since[0]:
                before, new_keys = self._since[0][seg.id], self._since[1]
                mask = _rows_of(seg, new_keys)
                if before is not None:
                    mask = mask | before if mask is not None else before
            else:
                mask = _rows_of(seg, sorted(self.touched))
            self._derived[key] = mask
        return self._derived[key]

    def nbytes(self, stored_attributes: int) -> int:
        """Estimated bytes the tail holds: its own objects (TAIL_OVERHEAD_BYTES), its chunks (`TailChunk.nbytes`),
        the keys it touches and the masks of segment rows it hides."""
        masks = sum(m.nbytes for m in self._masks().values() if m is not None)
        chunks = sum(c.nbytes(stored_attributes) for c in self.chunks)
        return TAIL_OVERHEAD_BYTES + chunks + masks + self.key_bytes

    def groups(self, spec: IndexSpec, source: DataSourceSpec) -> list[TailGroup]:
        """The live upserts per split and chunk, each with an exact engine."""
        if "groups" not in self._derived:
            self._derived["groups"] = [g for c in self.chunks for g in c.groups(spec, source)]
        return self._derived["groups"]

    def _masks(self) -> dict[str, np.ndarray | None]:
        """The hidden-row masks derived so far, by segment id: a tail made from this one starts from them."""
        # A copy first: searches add masks meanwhile, and iterating the dict itself would fail as it grows.
        return {k[1]: v for k, v in list(self._derived.items()) if type(k) is tuple and k[0] == "hidden"}

    def extended(self, entries: pa.Table) -> Tail:
        """This tail followed by newer entries of the same shard (all above every seq this tail holds)."""
        new_keys = pc.unique(entries[KEY])
        chunks = []
        for chunk in self.chunks:
            gone = pc.is_in(chunk.upserts[KEY], value_set=new_keys)
            if pc.any(gone).as_py():
                chunk = TailChunk(chunk.upserts.filter(pc.invert(gone)))
            chunks.append(chunk)
        chunks.append(TailChunk(fold(entries.to_batches())))
        keys = new_keys.to_pylist()
        key_bytes = self.key_bytes + _keys_bytes([k for k in keys if k not in self.touched])
        return Tail(self.touched.union(keys), _chunks(chunks), {}, (self._masks(), keys), key_bytes)

    def cut(self, watermark: int, entries: pa.Table) -> Tail:
        """This tail without what a newly served version of its shard reflects, the entries up to `watermark`:
        `entries` are the shard's entries above it, all of them held by this tail. What `Tail.of(entries)`
        gives, reusing this tail's work: its chunks above the watermark keep their engines, and segments it
        hid rows of keep those masks. A mask may now hide more than the remaining entries touch; those rows'
        keys were rewritten at or below the watermark, so the new version deletes those rows anyway."""
        keep = [TailChunk(c.upserts.filter(pc.greater(c.upserts[SEQ], watermark)))
                if pc.min(c.upserts[SEQ]).as_py() <= watermark else c
                for c in self.chunks if c.upserts.num_rows]
        chunks = _chunks(keep) if keep else (TailChunk(self.chunks[-1].upserts.slice(0, 0)),)
        keys = pc.unique(entries[KEY])
        return Tail(frozenset(keys.to_pylist()), chunks, {}, (self._masks(), []), _keys_bytes(keys))


def _keys_bytes(keys: pa.Array | Collection[str]) -> int:
    """Estimated bytes of these keys held as Python strings in a tail's touched set (ROW_OVERHEAD_BYTES each
    beside its characters; its UTF-8 bytes for an Arrow array)."""
    if isinstance(keys, pa.Array):
        length = pc.sum(pc.binary_length(keys)).as_py() or 0
    else:
        length = sum(map(len, keys))
    return len(keys) * ROW_OVERHEAD_BYTES + length


def _chunks(chunks: list[TailChunk]) -> tuple[TailChunk, ...]:
    """Drop empty chunks (keeping one when all are: it carries the table's schema); merge the newest two while the
    older is at most twice the newer (a binary counter)."""
    out = [c for c in chunks if c.upserts.num_rows] or chunks[-1:]
    while len(out) >= 2 and out[-2].upserts.num_rows <= 2 * out[-1].upserts.num_rows:
        newer = out.pop()
        older = out.pop()
        out.append(TailChunk(pa.concat_tables([older.upserts, newer.upserts]).combine_chunks()))
    return tuple(out)


def _rows_of(seg: LoadedSegment, keys: list[str]) -> np.ndarray | None:
    """Bool per row of `seg`, true where the row's key is one of `keys`; None when none is."""
    if not keys:
        return None
    index = seg.py_columns.get(_KEY_ROWS)
    if index is None:
        listed = seg.keys.tolist()
        index = dict(zip(listed, range(len(listed)), strict=True))
        # A key twice in one segment (never written so, but not this function's to assume): scan instead.
        seg.py_columns[_KEY_ROWS] = index = index if len(index) == len(listed) else False
    if index is False or len(keys) * 8 > seg.rows.num_rows:
        mask = pc.is_in(seg.rows[KEY], value_set=pa.array(keys, pa.string())).to_numpy(zero_copy_only=False)
        return mask if mask.any() else None
    rows = [r for r in map(index.get, keys) if r is not None]
    if not rows:
        return None
    mask = np.zeros(seg.rows.num_rows, dtype=bool)
    mask[rows] = True
    return mask


def per_shard(view: IndexView, entries: pa.Table, only: Collection[int] | None = None,
               ) -> Iterable[tuple[int, pa.Table]]:
    """The entries of each shard of the view (of `only` these) above that shard's own watermark (shards without
    any left out)."""
    spec = view.index.spec
    shard_of = shard_numbers(entries, spec.shard_attributes, spec.shard_count)
    seqs = entries[SEQ].to_numpy()
    for shard in view.shards:
        if only is not None and shard.shard_no not in only:
            continue
        mine = entries.filter(pa.array((shard_of == shard.shard_no) & (seqs > shard.watermark)))
        if mine.num_rows:
            yield shard.shard_no, mine


def build_tails(view: IndexView, entries: pa.Table, only: Collection[int] | None = None) -> dict[int, Tail]:
    """Split the log entries (served watermark, required seq] by shard (of `only` these shards), keeping for
    each shard only the entries above that shard's own watermark; fold them."""
    if not entries.num_rows:
        return {}
    return {shard_no: Tail.of(mine) for shard_no, mine in per_shard(view, entries, only)}


def extend_tails(view: IndexView, tails: dict[int, Tail], entries: pa.Table, only: Collection[int] | None = None,
                 ) -> dict[int, Tail]:
    """`tails` (derived for `view`'s shards, or those of `only`) followed by newer log entries: what
    `build_tails` gives for the old entries and these together, reusing what the old tails built."""
    out = dict(tails)
    if not entries.num_rows:
        return out
    for shard_no, mine in per_shard(view, entries, only):
        old = out.get(shard_no)
        out[shard_no] = Tail.of(mine) if old is None else old.extended(mine)
    return out
