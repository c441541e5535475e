"""Running one kNN search over an index view: per segment and split, minus deletions, plus an exact scan of
the log tail when the consistency level needs it, k-way merged by the metric's direction."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shoal.engines import Engine, get_engine
from shoal.engines.sparse import SparseRows
from shoal.errors import Problem, ValidationError
from shoal.index.segment import LoadedSegment, json_value, vectors_of
from shoal.index.sharding import shard_numbers, split_keys
from shoal.log.reader import fold
from shoal.log.records import DataSourceSpec, IndexSpec, SparseVector
from shoal.log.validation import KEY, SEQ, check_value
from shoal.searcher.hits import Hit, Hits, RowSource, attributes_of
from shoal.searcher.views import IndexView

__all__ = ["Hit", "Hits", "Tail", "attributes_of", "build_tails", "execute", "prepare_queries", "split_matcher"]


@dataclass(frozen=True)
class Tail:
    """Log entries a shard's served version does not reflect yet: keys they touch, and their live upserts.

    What queries derive from it (the segment rows it hides, exact engines over its upserts) is built on first
    use and kept with it, so a searcher that reuses a tail pays for that once, not per query.
    """

    touched: frozenset[str]
    upserts: pa.Table
    _derived: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    def hidden_rows(self, seg: LoadedSegment) -> np.ndarray | None:
        """Bool per row of `seg`, true where the tail updates or deletes the row's key; None when none is."""
        key = ("hidden", seg.id)
        if key not in self._derived:
            touched = pa.array(sorted(self.touched), pa.string())
            mask = pc.is_in(seg.rows[KEY], value_set=touched).to_numpy(zero_copy_only=False)
            self._derived[key] = mask if mask.any() else None
        return self._derived[key]

    def groups(self, spec: IndexSpec, source: DataSourceSpec) -> list[_TailGroup]:
        """The live upserts per split (combination of split values), each with an exact engine."""
        if "groups" not in self._derived:
            table, groups = self.upserts, []
            if table.num_rows:
                keys = split_keys(table, spec.split_attributes).to_numpy(zero_copy_only=False)
                engine_cls = get_engine("flat_sparse" if source.vectors_are_sparse else "flat")
                for key in dict.fromkeys(keys.tolist()):
                    part = table.filter(pa.array(keys == key)) if spec.split_attributes else table
                    first = part.slice(0, 1).to_pylist()[0]
                    vectors = vectors_of(part, source.vectors_are_sparse, source.vector_dimension)
                    groups.append(
                        _TailGroup(
                            {a: json_value(first[a]) for a in spec.split_attributes},
                            RowSource(part, spec.stored_attributes()),
                            engine_cls.build(vectors, spec.metric, None),
                        )
                    )
            self._derived["groups"] = groups
        return self._derived["groups"]


@dataclass(frozen=True)
class _TailGroup:
    values: dict[str, Any]  # the split's attribute values
    source: RowSource  # the upserts
    engine: Engine  # exact: the tail is small and must be answered exactly


_F32 = np.dtype(np.float32)


def prepare_queries(source: DataSourceSpec, queries: Any) -> np.ndarray | SparseRows:
    """Query vectors checked against the data source: count, dimension, dense or sparse, finite."""
    if (
        type(queries) is np.ndarray
        and queries.dtype is _F32
        and queries.shape[-1:] == (source.vector_dimension,)
        and queries.ndim == 2
        and queries.size
        and queries.flags.c_contiguous
        and not source.vectors_are_sparse
    ):
        # The usual call, checked in a few attribute reads and one dot product: a finite sum of squares means
        # every coordinate is finite (NaN and inf propagate); one that overflowed takes the full check below.
        squares = float(np.vdot(queries, queries))
        if squares - squares == 0.0:
            return queries
    if source.vectors_are_sparse:
        items = list(queries)
        if not items:
            raise ValidationError(Problem("at least one query vector is required", attribute="queryVectors"))
        if not all(isinstance(q, SparseVector) for q in items):
            raise ValidationError(
                Problem("the index holds sparse vectors: query with sparse vectors", attribute="queryVectors")
            )
        for i, q in enumerate(items):
            idx = np.asarray(q.indices, dtype=np.int64)
            if idx.size and (idx.min() < 0 or idx.max() >= source.vector_dimension):
                raise ValidationError(
                    Problem(f"sparse index out of range 0..{source.vector_dimension - 1}", i, "queryVectors")
                )
            if np.unique(idx).size != idx.size:
                raise ValidationError(Problem("sparse query vector repeats an index", i, "queryVectors"))
        return SparseRows.from_lists(
            [list(q.indices) for q in items], [list(q.values) for q in items], source.vector_dimension
        )
    if isinstance(queries, np.ndarray):
        arr = queries
    else:
        items = list(queries)
        if any(isinstance(q, SparseVector) for q in items):
            raise ValidationError(
                Problem("the index holds dense vectors: query with dense vectors", attribute="queryVectors")
            )
        try:
            arr = np.asarray(items, dtype=np.float32)
        except ValueError:
            raise ValidationError(
                Problem("query vectors must all have the same dimension", attribute="queryVectors")
            ) from None
    if arr.ndim == 1 and arr.size:
        arr = arr[None, :]
    if arr.size == 0 or arr.shape[0] == 0:
        raise ValidationError(Problem("at least one query vector is required", attribute="queryVectors"))
    if arr.ndim != 2 or arr.shape[1] != source.vector_dimension:
        raise ValidationError(
            Problem(
                f"wrong query dimension: expected {source.vector_dimension}, got {arr.shape[-1]}",
                attribute="queryVectors",
            )
        )
    if not np.isfinite(arr).all():
        raise ValidationError(Problem("query coordinates must be finite", attribute="queryVectors"))
    return np.ascontiguousarray(arr, dtype=np.float32)


def split_matcher(
    index: IndexSpec, source: DataSourceSpec, split_filter: Mapping[str, Any] | None
) -> Callable[[dict[str, Any]], bool]:
    """A predicate over a split's values: Vektonn semantics, a full filter names one split, a partial or
    missing one matches every split agreeing on the attributes it names."""
    if not split_filter:
        return lambda values: True
    wanted: dict[str, Any] = {}
    for name, raw in split_filter.items():
        if name not in index.split_attributes:
            raise ValidationError(Problem("split filter key is not a split attribute of the index", attribute=name))
        value, err = check_value(source.attribute_types[name], raw)
        if err:
            raise ValidationError(Problem(err, attribute=name))
        wanted[name] = json_value(value)
    return lambda values: all(values.get(k) == v for k, v in wanted.items())


def build_tails(view: IndexView, entries: pa.Table) -> dict[int, Tail]:
    """Split the log entries (served watermark, required seq] by shard, keeping for each shard only the
    entries above that shard's own watermark; fold them."""
    spec = view.index.spec
    shard_of = (
        shard_numbers(entries, spec.shard_attributes, spec.shard_count)
        if entries.num_rows
        else np.zeros(0, dtype=np.int64)
    )
    tails: dict[int, Tail] = {}
    seqs = entries[SEQ].to_numpy() if entries.num_rows else np.zeros(0, dtype=np.int64)
    for shard in view.shards:
        mine = entries.filter(pa.array((shard_of == shard.shard_no) & (seqs > shard.watermark)))
        if mine.num_rows:
            tails[shard.shard_no] = Tail(frozenset(pc.unique(mine[KEY]).to_pylist()), fold(mine.to_batches()))
    return tails


@dataclass
class _Block:
    distances: np.ndarray  # [q, m]
    rows: np.ndarray  # [q, m], -1 for none
    source: RowSource  # the rows `rows` points into


def execute(
    view: IndexView,
    queries: np.ndarray | SparseRows,
    k: int,
    matches: Callable[[dict[str, Any]], bool],
    tails: dict[int, Tail],
    retrieve_vectors: bool,
    params: Mapping[str, int] | None = None,
) -> list[Hits]:
    """The k nearest live data points per query over every matching split of every shard, plus the tails."""
    spec, source = view.index.spec, view.source.spec
    nq = len(queries)
    blocks: list[_Block] = []
    for shard in view.shards:
        tail = tails.get(shard.shard_no)
        for seg_view in shard.segments:
            seg = seg_view.segment
            # Rows deleted by this version, or whose key the log tail updates or deletes (the tail's answer wins).
            hidden = tail.hidden_rows(seg) if tail else None
            if seg_view.deleted_count:
                hidden = seg_view.deleted if hidden is None else hidden | seg_view.deleted
            for split in seg.splits:
                if not matches(split.values):
                    continue
                size = split.end - split.start
                gone = int(hidden[split.start : split.end].sum()) if hidden is not None else 0
                # Over-fetch by every row of this split that is filtered out, so an exact engine stays exact.
                want = min(size, k + gone)
                if want <= 0:
                    continue
                dist, labels = split.engine.search(queries, want, checked=True, params=params)
                # Labels are split-local; -1 (an engine that found fewer, like IVF over few lists) stays -1.
                rows = np.where(labels >= 0, labels + split.start, -1) if split.start else labels
                if hidden is not None:
                    rows = np.where((rows >= 0) & ~hidden[np.maximum(rows, 0)], rows, -1)
                blocks.append(_Block(dist, rows, seg_view.source))
    for tail in tails.values():
        for group in tail.groups(spec, source):
            if matches(group.values):
                dist, rows = group.engine.search(queries, min(k, len(group.engine)), checked=True)
                blocks.append(_Block(dist, rows, group.source))

    return _merge(blocks, nq, k, view.higher_is_nearer, retrieve_vectors)


def _block_hits(
    d_rows: list[list[float]], r_rows: list[list[int]], source: RowSource, k: int, retrieve_vectors: bool
) -> list[Hits]:
    """Hits per query from one block's rows: each row is nearest first already; -1 entries are dropped."""
    sources = (source,)
    results = []
    for d_row, r_row in zip(d_rows, r_rows, strict=True):
        if len(r_row) > k or (r_row and min(r_row) < 0):
            kept = [i for i, row in enumerate(r_row) if row >= 0][:k]
            d_row, r_row = [d_row[i] for i in kept], [r_row[i] for i in kept]
        results.append(Hits(r_row, d_row, sources, None, retrieve_vectors))
    return results


def _merge(blocks: list[_Block], nq: int, k: int, higher: bool, retrieve_vectors: bool) -> list[Hits]:
    """k-way merge of every block's candidates, per query, by the metric's direction (ties: first block).

    Every block comes from an engine, so each row of a block is already nearest first (with -1 where a row was
    filtered out): one block needs no sorting at all, which is the common case of one segment and one split.
    """
    if not blocks:
        return [Hits([], [], ()) for _ in range(nq)]
    if len(blocks) == 1:
        b = blocks[0]
        return _block_hits(b.distances.tolist(), b.rows.tolist(), b.source, k, retrieve_vectors)
    dist = np.concatenate([b.distances.astype(np.float64, copy=False) for b in blocks], axis=1)
    rows = np.concatenate([b.rows for b in blocks], axis=1)
    owner = np.concatenate([np.full(b.rows.shape[1], i) for i, b in enumerate(blocks)])
    key = np.where(rows >= 0, -dist if higher else dist, np.inf)
    order = np.argsort(key, axis=1, kind="stable")[:, :k]
    dist = np.take_along_axis(dist, order, axis=1)
    rows = np.take_along_axis(rows, order, axis=1)
    owners = owner[order]
    sources = tuple(b.source for b in blocks)
    results = []
    for d_row, r_row, o_row in zip(dist.tolist(), rows.tolist(), owners.tolist(), strict=True):
        n = r_row.index(-1) if -1 in r_row else len(r_row)  # filtered entries sort last
        results.append(Hits(r_row[:n], d_row[:n], sources, o_row[:n], retrieve_vectors))
    return results
