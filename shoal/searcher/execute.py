"""Running one kNN search over an index view: per segment and split, minus deletions, plus an exact scan of
the log tail when the consistency level needs it, k-way merged by the metric's direction."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shoal.artifacts.segment import json_value, vectors_of
from shoal.engines.metrics import Metric, exact_distances, higher_is_nearer
from shoal.engines.sparse import SparseRows
from shoal.errors import Problem, ValidationError
from shoal.indexing.sharding import shard_numbers
from shoal.ingest.batch import KEY, SEQ, SPARSE_INDICES, SPARSE_VALUES, VECTOR, check_value
from shoal.ingest.reader import fold
from shoal.records import DataSourceSpec, IndexSpec, SparseVector
from shoal.searcher.views import IndexView


@dataclass(frozen=True)
class Hit:
    """One nearest data point: its id, split and payload attributes, its distance and (on request) its vector."""

    attributes: dict[str, Any]
    distance: float
    vector: list[float] | SparseVector | None = None


@dataclass(frozen=True)
class Tail:
    """Log entries a shard's served version does not reflect yet: keys they touch, and their live upserts."""

    touched: frozenset[str]
    upserts: pa.Table


def prepare_queries(source: DataSourceSpec, queries: Any) -> np.ndarray | SparseRows:
    """Query vectors checked against the data source: count, dimension, dense or sparse, finite."""
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
    table: pa.Table
    column: Callable[[str], list[Any]]  # Python values of a column of `table`, by row


def _vector_value(table: pa.Table, row: int, sparse: bool) -> list[float] | SparseVector:
    if sparse:
        return SparseVector(table[SPARSE_INDICES][row].as_py(), table[SPARSE_VALUES][row].as_py())
    return table[VECTOR][row].as_py()


def _masked(rows: np.ndarray, keys: np.ndarray, masked: frozenset[str]) -> np.ndarray:
    """True where a result row's key is updated or deleted by the log tail (the tail's answer wins)."""
    flat = rows.reshape(-1)
    out = np.fromiter((r >= 0 and keys[r] in masked for r in flat), dtype=bool, count=flat.size)
    return out.reshape(rows.shape)


def execute(
    view: IndexView,
    queries: np.ndarray | SparseRows,
    k: int,
    matches: Callable[[dict[str, Any]], bool],
    tails: dict[int, Tail],
    retrieve_vectors: bool,
) -> list[list[Hit]]:
    """The k nearest live data points per query over every matching split of every shard, plus the tails."""
    spec, source = view.index.spec, view.source.spec
    metric = Metric(spec.metric)
    higher = higher_is_nearer(metric)
    nq = len(queries)
    blocks: list[_Block] = []
    for shard in view.shards:
        tail = tails.get(shard.shard_no)
        masked = tail.touched if tail else frozenset()
        for seg_view in shard.segments:
            seg = seg_view.segment
            for split in seg.splits:
                if not matches(split.values):
                    continue
                size = split.end - split.start
                dead = int(seg_view.deleted[split.start : split.end].sum()) if seg_view.deleted_count else 0
                # Over-fetch by every row that may be filtered out, so an exact engine stays exact.
                want = min(size, k + dead + len(masked))
                if want <= 0:
                    continue
                dist, labels = split.engine.search(queries, want)
                rows = np.where(labels >= 0, labels + split.start, -1)
                valid = rows >= 0
                if seg_view.deleted_count:
                    valid &= ~seg_view.deleted[np.where(valid, rows, 0)]
                if masked:
                    valid &= ~_masked(rows, seg.keys, masked)
                rows = np.where(valid, rows, -1)
                blocks.append(_Block(dist.astype(np.float64), rows, seg.rows, seg.column))
    for tail in tails.values():
        table = tail.upserts
        if not table.num_rows:
            continue
        keep = np.array(
            [
                matches({a: json_value(v) for a, v in zip(spec.split_attributes, vals, strict=True)})
                for vals in zip(*(table[a].to_pylist() for a in spec.split_attributes), strict=True)
            ]
            if spec.split_attributes
            else [True] * table.num_rows,
            dtype=bool,
        )
        table = table.filter(pa.array(keep))
        if not table.num_rows:
            continue
        dist = exact_distances(metric, queries, vectors_of(table, source.vectors_are_sparse, source.vector_dimension))
        rows = np.broadcast_to(np.arange(table.num_rows), dist.shape)
        blocks.append(
            _Block(np.asarray(dist, dtype=np.float64), np.ascontiguousarray(rows), table, _pylists(table))
        )

    return _merge(blocks, nq, k, higher, spec.stored_attributes(), retrieve_vectors, source.vectors_are_sparse)


def _pylists(table: pa.Table) -> Callable[[str], list[Any]]:
    cache: dict[str, list[Any]] = {}

    def column(name: str) -> list[Any]:
        if name not in cache:
            cache[name] = table[name].to_pylist()
        return cache[name]

    return column


def _merge(
    blocks: list[_Block], nq: int, k: int, higher: bool, stored: Sequence[str], retrieve_vectors: bool, sparse: bool
) -> list[list[Hit]]:
    """k-way merge of every block's candidates, per query, by the metric's direction (ties: first block)."""
    if not blocks:
        return [[] for _ in range(nq)]
    dist = np.concatenate([b.distances for b in blocks], axis=1)
    rows = np.concatenate([b.rows for b in blocks], axis=1)
    owner = np.concatenate([np.full(b.rows.shape[1], i) for i, b in enumerate(blocks)])
    key = np.where(rows >= 0, -dist if higher else dist, np.inf)
    order = np.argsort(key, axis=1, kind="stable")[:, :k]
    results: list[list[Hit]] = []
    for qi in range(nq):
        hits = []
        for col in order[qi]:
            row = int(rows[qi, col])
            if row < 0:
                break
            b = blocks[int(owner[col])]
            attrs = {a: b.column(a)[row] for a in stored}
            vec = _vector_value(b.table, row, sparse) if retrieve_vectors else None
            hits.append(Hit(attrs, float(dist[qi, col]), vec))
        results.append(hits)
    return results


def attributes_of(hits: Sequence[Hit]) -> list[dict[str, Any]]:
    """Just the attributes of each hit (handy in tests and the CLI)."""
    return [h.attributes for h in hits]
