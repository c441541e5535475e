"""Running one kNN search over an index view: per segment and split, minus deletions, plus an exact scan of
the log tail when the consistency level needs it, k-way merged by the metric's direction."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa

from shoal.engines import Engine, get_engine
from shoal.engines.flat import FlatEngine, key_margins, search_together
from shoal.engines.metrics import (
    Metric,
    direct_sq,
    exact_distances,
    from_products,
    rescore_nearest,
    rounding_bounds,
    worst_distance,
)
from shoal.engines.sparse import SparseRows
from shoal.errors import Problem, ValidationError
from shoal.index.segment import LoadedSegment, json_value, vectors_of
from shoal.log.records import AttributeType, DataSourceSpec, IndexSpec, SparseVector
from shoal.log.validation import (
    SPARSE_INDICES,
    SPARSE_VALUES,
    VECTOR,
    check_value,
    number_array,
    numbers_to_float32,
    sq_norm_fits_f32,
    unfit_rows,
    vector_problem,
)
from shoal.searcher.filters import MASKS, Filter
from shoal.searcher.hits import Hit, Hits, RowSource, attributes_of
from shoal.searcher.repeat_cache import RepeatCache
from shoal.searcher.tails import Tail, TailGroup, build_tails
from shoal.searcher.views import IndexView

__all__ = ["Hit", "Hits", "Tail", "attributes_of", "build_tails", "execute", "prepare_queries", "split_matcher"]


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
        # The usual call, checked in a few attribute reads and one dot product: a float32 sum of squares that
        # clears the bound by its rounding error means every coordinate is finite (NaN and inf propagate) and
        # every vector's float64 squared norm within MAX_SQ_NORM; any other takes the full (float64) check below.
        if sq_norm_fits_f32(float(np.vdot(queries, queries)), queries.size):
            return queries
    if source.vectors_are_sparse:
        return _sparse_queries(source, list(queries))
    given: Any = queries
    if not isinstance(queries, np.ndarray):
        given = items = list(queries)
        if any(isinstance(q, SparseVector) for q in items):
            raise ValidationError(
                Problem("the index holds dense vectors: query with dense vectors", attribute="queryVectors")
            )
    # Bool, integer and float numbers only, as stored vectors: complex or datetime queries were cast silently.
    numbers, wrong = number_array(given, "query vectors")
    if numbers is None:
        raise ValidationError(Problem(str(wrong), attribute="queryVectors"))
    arr = numbers_to_float32(numbers)  # an integer past float64's range: infinite, named below
    if arr.ndim == 1 and arr.size:
        arr, given = arr[None, :], [given]
    # No vector at all ([], an array of no rows) is refused as such; a vector of no coordinates ([[]]) by its
    # dimension, below: it was given, only empty.
    if arr.ndim == 0 or arr.shape[0] == 0:
        raise ValidationError(Problem("at least one query vector is required", attribute="queryVectors"))
    if arr.ndim != 2:
        raise ValidationError(Problem(f"query vectors must be one vector or a list of vectors, got an array of "
                                      f"shape {list(arr.shape)}", attribute="queryVectors"))
    if arr.shape[1] != source.vector_dimension:
        raise ValidationError(
            Problem(
                f"wrong query dimension: expected {source.vector_dimension}, got {arr.shape[-1]}",
                attribute="queryVectors",
            )
        )
    arr = np.ascontiguousarray(arr)
    unfit = unfit_rows(arr)
    if unfit.size:
        i = int(unfit[0])
        raise ValidationError(Problem(f"query {vector_problem(given[i], arr[i])}", i, "queryVectors"))
    return arr


def _sparse_queries(source: DataSourceSpec, items: list[Any]) -> SparseRows:
    """Sparse query vectors checked as an upload's sparse vectors are (validation._check_sparse): indices and
    values two one-dimensional lists of one length, unique integer indices within the dimension, finite float32
    values and a norm of at most MAX_NORM; else ValidationError naming queryVectors and the query's position."""
    if not items:
        raise ValidationError(Problem("at least one query vector is required", attribute="queryVectors"))
    if not all(isinstance(q, SparseVector) for q in items):
        raise ValidationError(
            Problem("the index holds sparse vectors: query with sparse vectors", attribute="queryVectors")
        )
    dim = source.vector_dimension
    all_idx: list[np.ndarray] = []
    all_val: list[np.ndarray] = []
    for i, q in enumerate(items):
        given_idx, wrong = number_array(q.indices, "sparse indices")
        given_val, wrong_val = number_array(q.values, "sparse values")
        if given_idx is None or given_val is None:
            raise ValidationError(Problem(f"query {wrong or wrong_val}", i, "queryVectors"))
        if given_idx.ndim != 1 or given_val.ndim != 1 or given_idx.shape != given_val.shape:
            raise ValidationError(Problem("sparse query vector needs its indices and values as two lists of one "
                                          "length", i, "queryVectors"))
        # Integers only: a float index (5.9 was searched as index 5) or a bool is refused, never truncated into
        # another dimension. An object array holds Python integers, some past 64 bits: out of every range.
        kind = given_idx.dtype.kind
        if given_idx.size and (kind not in "iuO" or kind == "O" and not all(
                isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_) for v in given_idx)):
            raise ValidationError(Problem("query sparse indices must be integers", i, "queryVectors"))
        idx: np.ndarray | None
        try:
            idx = given_idx.astype(np.int64) if kind != "u" else given_idx
        except OverflowError:
            idx = None
        if idx is None or idx.size and (idx.min() < 0 or idx.max() >= dim):
            raise ValidationError(Problem(f"sparse index out of range 0..{dim - 1}", i, "queryVectors"))
        idx = idx.astype(np.int64)
        if np.unique(idx).size != idx.size:
            raise ValidationError(Problem("sparse query vector repeats an index", i, "queryVectors"))
        val = numbers_to_float32(given_val)  # past float32's range (even float64's): inf, named just below
        wrong = vector_problem(given_val, val)  # as a dense query's: finite, norm at most MAX_NORM
        if wrong is not None:
            raise ValidationError(Problem(f"query {wrong}", i, "queryVectors"))
        all_idx.append(idx)
        all_val.append(val)
    # The rows from the checked arrays (not the caller's lists again), sorted within each row.
    lengths = np.array([len(idx) for idx in all_idx], dtype=np.int64)
    indptr = np.zeros(len(items) + 1, dtype=np.int64)
    np.cumsum(lengths, out=indptr[1:])
    flat_idx, flat_val = np.concatenate(all_idx), np.concatenate(all_val)
    order = np.lexsort((flat_idx, np.repeat(np.arange(len(items)), lengths)))
    return SparseRows(indptr, flat_idx[order], flat_val[order], dim)


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
    floats = [k for k in wanted if source.attribute_types[k] == AttributeType.FLOAT64]
    if not floats:
        return lambda values: all(values.get(k) == v for k, v in wanted.items())

    def matches(values: dict[str, Any]) -> bool:
        # A float64 split value comes back from the catalog's JSON as an int when it is integral (1e300 as
        # 10**300, unequal to 1e300): compared as the float it was stored from.
        return all(_as_float(values.get(k)) == v if k in floats else values.get(k) == v for k, v in wanted.items())

    return matches


def _as_float(value: Any) -> Any:
    """An integral JSON number read back for a float64 value, as that float; anything else unchanged."""
    return float(value) if type(value) is int else value


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
    flt: Filter | None = None,
) -> list[Hits]:
    """The k nearest live data points per query over every matching split of every shard, plus the tails;
    with `flt`, the k nearest live points that match it (see `_execute_filtered`)."""
    if flt is not None:
        return _execute_filtered(view, queries, k, matches, tails, retrieve_vectors, params, flt)
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
    groups = [g for tail in tails.values() for g in tail.groups(spec, source) if matches(g.values)]
    blocks.extend(_young_blocks(groups, queries, k))
    return _merge(blocks, nq, k, view.higher_is_nearer, retrieve_vectors, Metric(spec.metric), queries)


def _young_blocks(groups: list[TailGroup], queries: np.ndarray | SparseRows, k: int) -> list[_Block]:
    """The tail's candidates: the exact k nearest of all its groups' upserts together (one pass when they are
    dense exact engines, as the young tier's are), as one block per group that holds any."""
    engines = [g.engine for g in groups]
    # No more candidates than the groups hold: a caller's k may be any size, and the candidates' arrays are k
    # wide (a k of ten million over two young rows took 1.6 GB).
    k = min(k, sum(len(e) for e in engines))
    if k == 0:
        return []
    if len(engines) > 1 and isinstance(queries, np.ndarray) and all(type(e) is FlatEngine for e in engines):
        found = search_together(engines, queries, k)
    else:
        found = [g.engine.search(queries, min(k, len(g.engine)), checked=True) for g in groups]
    return [_Block(dist, rows, g.source) for g, (dist, rows) in zip(groups, found, strict=True)
            if (rows >= 0).any()]


# Where a filtered search of an ANN split (HNSW, IVF) scans the matching rows exactly instead of searching the
# index: when matching rows x matching fraction <= this. An exact scan costs ~0.27 us per matching row; the
# index's filtered search costs ~0.3 ms / fraction (hnswlib's filter walks past the rows it rejects), so they
# cross where m * f = 0.3 ms / 0.27 us ~ 1,100, i.e. m = sqrt(1,100 n). Measured with `bench/filters.py
# --sweep` (debian-packages, 59k x 384, HNSW M16 efC200 ef64, one query per call, 2 shared cores): at 9.6 %
# (5.6k rows) exact 656 QPS vs index 255, at 19.7 % (11.6k rows) exact 348 vs index 601, at 30 % exact 178 vs
# index 1,034 (the widened walk); below 5 % exact is 20-200x faster and recall 1.0 where the walk's drops.
FILTER_EXACT_MAX_ROWS_X_FRACTION = 1_100
_SUBSET_BYTES = 256 << 20  # matching rows' vectors kept per (segment, split, filter), least recently used out
# A subset of at most this many rows keeps its vectors in float64 too and is ranked in float64 at once: fewer
# numpy calls than choosing candidates by float32 keys first (one 384-d query, cosine, real data, us per call:
# 59 rows 18.4 against 19.8, 128 rows 24 against 21: the float64 products are summed row by row, not by BLAS).
_TINY_ROWS = 64
# Products of magnitudes below this stay finite in float32 (max ~3.4e38), keys included.
_F32_SAFE = 1e36


@dataclass(frozen=True)
class _Subset:
    """The rows of one split of one segment that one filter matches, with their vectors gathered once: a
    filter repeated over an immutable segment scans a contiguous matrix, as numpy over those rows would."""

    rows: np.ndarray  # split-local row numbers, increasing
    vectors: np.ndarray  # float32 [m, d]
    sq_norms: np.ndarray  # float64 [m]
    sq_norms32: np.ndarray  # float32 [m]
    inv_norms: np.ndarray  # float32 [m], 0 for a zero vector
    max_norm: float  # the largest row norm: it bounds the float32 keys' rounding error
    vectors64: np.ndarray | None  # float64 [m, d], kept for a subset of at most _TINY_ROWS rows

    @property
    def nbytes(self) -> int:
        wide = self.vectors64.nbytes if self.vectors64 is not None else 0
        return int(self.rows.nbytes + self.vectors.nbytes + wide + 16 * len(self.rows))


# Matching rows' vectors per (segment, filter, split), kept once a filter comes back (shoal.searcher.repeat_cache).
SUBSETS: RepeatCache[_Subset] = RepeatCache(_SUBSET_BYTES, lambda sub: sub.nbytes)


_ROWS_ENGINE = " rows engine"  # under this name in a segment's py_columns cache: no attribute can have it


def _rows_engine(seg: LoadedSegment, source: DataSourceSpec, metric: Metric) -> FlatEngine:
    """An exact engine over all of a segment's rows (a view of its vector column where that is one chunk), made
    once per segment for its rows' norms: a subset then costs a gather of its rows and no float64 pass."""
    found = seg.py_columns.get(_ROWS_ENGINE)
    if found is None:
        found = seg.py_columns[_ROWS_ENGINE] = FlatEngine(vectors_of(seg.rows, False, source.vector_dimension),
                                                          metric, {})
    return found  # type: ignore[no-any-return]


def _subset_in(engine: FlatEngine, rows: np.ndarray, labels: np.ndarray) -> _Subset:
    """The subset of an exact engine's `rows` (increasing), labelled `labels`, with the norms it holds for them:
    a segment's split (labels split-local) or a young-tier group's matching upserts."""
    vectors, sq_norms, sq_norms32, inv_norms = engine.rows_and_norms()
    sq = sq_norms[rows]
    picked = np.take(vectors, rows, axis=0)
    wide = picked.astype(np.float64) if len(rows) <= _TINY_ROWS else None
    return _Subset(labels, picked, sq, sq_norms32[rows], inv_norms[rows], math.sqrt(float(sq.max(initial=0.0))),
                   wide)


def _matching(engine: FlatEngine, mask: np.ndarray, start: int = 0) -> _Subset:
    """The subset of the rows `mask` marks, counted from the engine's row `start`, labelled from 0 there."""
    local = np.flatnonzero(mask)
    return _subset_in(engine, local + start if start else local, local)


def _subset_of(local: np.ndarray, gathered: np.ndarray) -> _Subset:
    """The subset of rows `local` (split-local, increasing) whose vectors are `gathered`, with its norms."""
    vectors = np.ascontiguousarray(gathered, dtype=np.float32)
    return _subset_in(FlatEngine(vectors, Metric.EUCLIDEAN, {}), np.arange(len(vectors)), local)


def _dots(rows64: np.ndarray, q64: np.ndarray) -> np.ndarray:
    """Each row's float64 product with q, summed in the same order for every row: a BLAS matrix-vector product
    may sum a row differently by its position (seen on 3 x 16), which would order exact duplicates (ties, to
    be broken by row) by where they happen to sit."""
    return np.einsum("ij,j->i", rows64, q64)


def _subset_distances(
    metric: Metric, rows64: np.ndarray, q64: np.ndarray, qq: float, v_sq: np.ndarray, gone: np.ndarray | None,
    k: int,
) -> np.ndarray:
    """float64 distances of one query (squared norm `qq`) to candidate rows `rows64` (squared norms `v_sq`; `gone`
    marks hidden ones, whose value does not matter), summed in one order for every row (`_dots`). For the L2
    metrics, whose product formula errs relative to the norms, the rows that can be among the k nearest visible
    ones are summed again from their differences, so the k smallest visible distances are exact."""
    if metric not in (Metric.L2_SQUARED, Metric.EUCLIDEAN):
        return from_products(metric, _dots(rows64, q64), qq, v_sq)
    sq = from_products(Metric.L2_SQUARED, _dots(rows64, q64), qq, v_sq)
    if gone is not None:
        sq = np.where(gone, np.inf, sq)  # left out of the k nearest, and never summed again
    err = rounding_bounds(len(q64), qq, v_sq)
    sq = rescore_nearest(sq[None, :], err[None, :], k,
                         lambda _, ci: direct_sq(q64[None, :], rows64, np.zeros(len(ci), dtype=np.int64), ci))[0]
    return np.sqrt(sq) if metric is Metric.EUCLIDEAN else sq


def _exact_subset(
    metric: Metric, sub: _Subset, queries: np.ndarray, k: int, hidden: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """The exact k nearest rows of a subset (minus `hidden`, bool per subset row): split-local labels, -1 pads.

    float32 keys (as the flat engine makes them) pick the candidates: every row whose key is within twice the
    keys' rounding bound (`key_margins`) of the k-th smallest, which holds the exact top k and every row tied
    with its last; they are reranked in float64 as the flat engine's distances are, ties by label (a tiny
    subset is ranked in float64 whole). One query at a time: a server's searches are single queries, and
    per-query numpy calls on 1-d arrays are the cheapest."""
    m = len(sub.rows)
    worst = worst_distance(metric)
    out_d = np.full((len(queries), k), worst, dtype=np.float32)
    out_l = np.full((len(queries), k), -1, dtype=np.int64)
    dim = queries.shape[1]
    # Distances past float32's range (huge vectors) are reported as inf, without a warning per search.
    with np.errstate(over="ignore"):
        for i, q in enumerate(queries):
            q64 = q.astype(np.float64)
            qq = float(q64 @ q64)
            q_norm = math.sqrt(qq)
            if m <= _TINY_ROWS or not q_norm * sub.max_norm + sub.max_norm**2 < _F32_SAFE:
                # Every row: so few that choosing candidates costs more than it saves, or magnitudes whose float32
                # products could overflow.
                cand = slice(None)
            else:
                key = sub.vectors @ q  # [m] float32, made the key in place
                if metric is Metric.DOT_PRODUCT:
                    np.negative(key, out=key)
                elif metric is Metric.COSINE:
                    key *= np.float32(-1.0 / q_norm) if q_norm > 0 else np.float32(0.0)
                    key *= sub.inv_norms
                else:  # the L2 metrics: |v|^2 - 2 q.v, the flat engine's key less the constant |q|^2
                    key *= np.float32(-2.0)
                    key += sub.sq_norms32
                if hidden is not None:
                    key[hidden] = np.inf
                # Rows beyond the k-th key plus twice the rounding bound are farther than all k rows up to it,
                # exactly; an infinite k-th key (fewer visible rows than k) keeps every row.
                slack = 2.0 * float(key_margins(metric, dim, q_norm, sub.max_norm))
                cand = np.flatnonzero(key <= np.partition(key, k - 1)[k - 1] + slack)
            rows64 = sub.vectors64 if type(cand) is slice and sub.vectors64 is not None else sub.vectors[cand].astype(
                np.float64)
            labels = sub.rows[cand]
            gone = hidden[cand] if hidden is not None else None
            dist = _subset_distances(metric, rows64, q64, qq, sub.sq_norms[cand], gone, k)
            if gone is not None:
                dist = np.where(gone, worst, dist)
                labels = np.where(gone, -1, labels)
            key64 = -dist if metric is Metric.DOT_PRODUCT else dist
            if type(cand) is slice and m > k:  # sort only the rows up to the k-th (and every row tied with it)
                near = np.flatnonzero(key64 <= np.partition(key64, k - 1)[k - 1])
                order = near[np.lexsort((labels[near], key64[near]))][:k]
            else:
                order = np.lexsort((labels, key64))[:k]
            n = len(order)
            out_d[i, :n], out_l[i, :n] = dist[order], labels[order]
    return out_d, out_l


def _execute_filtered(
    view: IndexView,
    queries: np.ndarray | SparseRows,
    k: int,
    matches: Callable[[dict[str, Any]], bool],
    tails: dict[int, Tail],
    retrieve_vectors: bool,
    params: Mapping[str, int] | None,
    flt: Filter,
) -> list[Hits]:
    """`execute` restricted to rows matching `flt`: per split, the engine's own filtered search where many
    rows match (HNSW walks only toward allowed rows, IVF skips the others in its lists), an exact scan of the
    matching rows where few do (and always on flat), and an exact scan of the tail's matching upserts."""
    spec, source = view.index.spec, view.source.spec
    metric = Metric(spec.metric)
    # The subset scan takes dense float32 queries and an inner-product metric; else the exact engines do.
    fast = isinstance(queries, np.ndarray) and metric is not Metric.MANHATTAN
    nq = len(queries)
    blocks: list[_Block] = []
    for shard in view.shards:
        tail = tails.get(shard.shard_no)
        for seg_view in shard.segments:
            seg = seg_view.segment
            fmask = MASKS.get(seg.id, flt, seg.rows, seg.py_columns)
            if not fmask.any():
                continue
            hidden = tail.hidden_rows(seg) if tail else None
            if seg_view.deleted_count:
                hidden = seg_view.deleted if hidden is None else hidden | seg_view.deleted
            for split in seg.splits:
                if not matches(split.values):
                    continue
                ok = fmask[split.start : split.end]
                if hidden is not None:
                    ok = ok & ~hidden[split.start : split.end]
                count = int(np.count_nonzero(ok))
                if count == 0:
                    continue

                exact = partial(_segment_exact, fast=fast, metric=metric, source=source, seg=seg, start=split.start,
                                ok=ok, fsplit=fmask[split.start : split.end], hidden=hidden, key=flt.key)
                dist, labels = _search_allowed(split.engine, queries, k, ok, count, params, exact)
                rows = np.where(labels >= 0, labels + split.start, -1) if split.start else labels
                blocks.append(_Block(dist, rows, seg_view.source))
    for tail in tails.values():
        for group in tail.groups(spec, source):
            if not matches(group.values):
                continue
            table = group.source.table
            ok = MASKS.get(group.cache_id, flt, table, group.filter_columns)
            if not ok.any():
                continue
            engine = group.engine
            if fast and isinstance(engine, FlatEngine):
                # The group's exact engine already holds its rows and their norms: scan the matching ones.
                sub = SUBSETS.get((group.cache_id, flt.key, 0), lambda e=engine, ok=ok: _matching(e, ok))
                # At most as wide as its rows: a caller's k may be any size (Vektonn's is unbounded).
                dist, rows = _exact_subset(metric, sub, queries, min(k, len(sub.rows)), None)
            else:
                dist, rows = _exact_allowed(metric, source.vectors_are_sparse, queries, k, ok,
                                            lambda idx, t=table: _gather(t, source, idx))
            blocks.append(_Block(dist, rows, group.source))
    return _merge(blocks, nq, k, view.higher_is_nearer, retrieve_vectors, metric, queries)


def _segment_exact(
    q: Any, want: int, *, fast: bool, metric: Metric, source: DataSourceSpec, seg: LoadedSegment, start: int,
    ok: np.ndarray, fsplit: np.ndarray, hidden: np.ndarray | None, key: str,
) -> tuple[np.ndarray, np.ndarray]:
    """The exact `want` nearest rows `ok` marks in one split of `seg` (split-local labels): over the cached
    subset the filter matches (`fsplit`) minus `hidden`, or by an exact engine (manhattan, sparse)."""
    if not fast:
        return _exact_allowed(metric, source.vectors_are_sparse, q, want, ok,
                              lambda idx: _gather(seg.rows, source, idx + start))
    sub = SUBSETS.get((seg.id, key, start),
                      lambda: _matching(_rows_engine(seg, source, metric), fsplit, start))
    gone = None if hidden is None else hidden[start + sub.rows]
    return _exact_subset(metric, sub, q, want, gone if gone is not None and gone.any() else None)


def _gather(table: pa.Table, source: DataSourceSpec, rows: np.ndarray) -> Any:
    """The vectors of some rows of a segment's or tail's table, as the engines take them."""
    cols = [SPARSE_INDICES, SPARSE_VALUES] if source.vectors_are_sparse else [VECTOR]
    picked = table.select(cols).take(pa.array(rows, pa.int64()))
    return vectors_of(picked, source.vectors_are_sparse, source.vector_dimension)


def _exact_allowed(
    metric: Any, sparse: bool, queries: Any, k: int, ok: np.ndarray, gather: Callable[[np.ndarray], Any]
) -> tuple[np.ndarray, np.ndarray]:
    """The exact k nearest of the rows `ok` marks, by an exact engine over them (labels are positions in
    `ok`; -1 pads): the tail's path, and the segments' for manhattan and sparse vectors."""
    idx = np.flatnonzero(ok)
    engine = get_engine("flat_sparse" if sparse else "flat").build(gather(idx), metric, None, threads=1)
    dist, labels = engine.search(queries, min(k, len(idx)), checked=True)  # padded to no more than there are
    return dist, np.where(labels >= 0, idx[np.maximum(labels, 0)], -1)


def _search_allowed(
    engine: Engine,
    queries: Any,
    k: int,
    ok: np.ndarray,
    count: int,
    params: Mapping[str, int] | None,
    exact: Callable[[Any, int], tuple[np.ndarray, np.ndarray]],
) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest rows of one split among those `ok` marks (`count` of them), split-local labels; at most
    `count` wide (a caller's k may be any size, and a block of results is never wider than its rows)."""
    k = min(k, count)
    filtered = getattr(engine, "search_filtered", None)
    if filtered is None or count * count <= FILTER_EXACT_MAX_ROWS_X_FRACTION * len(engine):
        return exact(queries, k)
    found = filtered(queries, k, ok, count, params)
    if found is None:
        return exact(queries, k)
    dist, labels = found
    short = (labels[:, :k] < 0).any(axis=1)
    if short.any():
        # The index found fewer matching rows than there are (an IVF probe, an unreachable graph region):
        # those queries are answered exactly, never with fewer results than exist.
        d2, l2 = exact(queries[np.flatnonzero(short)], k)
        dist, labels = dist.copy(), labels.copy()
        dist[short, :k], labels[short, :k] = d2, l2
    if dist.shape[1] < k:
        pad = k - dist.shape[1]
        dist = np.hstack([dist, np.full((len(dist), pad), worst_distance(engine.metric), dtype=dist.dtype)])
        labels = np.hstack([labels, np.full((len(labels), pad), -1, dtype=labels.dtype)])
    return dist, labels


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


def _merge(
    blocks: list[_Block], nq: int, k: int, higher: bool, retrieve_vectors: bool, metric: Metric,
    queries: np.ndarray | SparseRows,
) -> list[Hits]:
    """k-way merge of every block's candidates, per query, by the metric's direction (ties: first block).

    Every block comes from an engine, so each row of a block is already nearest first (with -1 where a row was
    filtered out): one block needs no sorting at all, which is the common case of one segment and one split.
    The blocks' distances are float32: entries of different blocks that round to one float32 value among the k
    nearest are ordered by their float64 distances (`_float64_order`), as one exact engine ranks its rows.
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
    # One past the k nearest: a k-th tied with the next may be ordered after it in float64 (below).
    order = np.argsort(key, axis=1, kind="stable")[:, : k + 1]
    dist_k = np.take_along_axis(dist, order, axis=1)
    rows_k = np.take_along_axis(rows, order, axis=1)
    owners = owner[order]
    sources = tuple(b.source for b in blocks)
    results = []
    for qi, (d_row, r_row, o_row) in enumerate(zip(dist_k.tolist(), rows_k.tolist(), owners.tolist(), strict=True)):
        n = r_row.index(-1) if -1 in r_row else len(r_row)  # filtered entries sort last
        if len(set(d_row[:n])) < n:
            # Equal float32 distances among them, maybe of two blocks: float32 cannot order those, float64 may
            # (1 and 0.99999999 both round to 1.0). Rare: no distance repeats in the usual answer.
            full = _float64_order(blocks, metric, queries, qi, key[qi], rows[qi], owner,
                                  np.argsort(key[qi], kind="stable"), k, higher)[: k + 1]
            d_row, r_row, o_row = dist[qi, full].tolist(), rows[qi, full].tolist(), owner[full].tolist()
        n = min(n, k)
        results.append(Hits(r_row[:n], d_row[:n], sources, o_row[:n], retrieve_vectors))
    return results


def _float64_order(
    blocks: list[_Block], metric: Metric, queries: np.ndarray | SparseRows, qi: int, key: np.ndarray,
    rows: np.ndarray, owner: np.ndarray, order: np.ndarray, k: int, higher: bool,
) -> np.ndarray:
    """One query's merge order (`order`, stable by the float32 `key`) with every run of equal keys that reaches
    into the k nearest and spans blocks reordered by the entries' float64 distances, recomputed from their
    stored vectors as the exact engines compute them (equal ones keep their order: first block). A run keeps its
    place: float32 rounding is monotone, so entries of different float32 values are already in float64 order."""
    sorted_key = key[order]
    runs = []
    start = 0
    while start < min(k, len(order)) and sorted_key[start] < np.inf:
        end = start + 1
        while end < len(order) and sorted_key[end] == sorted_key[start]:
            end += 1
        if end - start > 1 and len(set(owner[order[start:end]].tolist())) > 1:
            runs.append((start, end))
        start = end
    if not runs:
        return order
    order = order.copy()
    entries = np.concatenate([order[a:b] for a, b in runs])
    d64 = np.empty(len(order), dtype=np.float64)
    for b in np.unique(owner[entries]).tolist():  # one gather per block
        mine = entries[owner[entries] == b]
        d64[mine] = _distances64(blocks[b], metric, queries, qi, rows[mine])
    for a, b in runs:
        run = order[a:b]
        order[a:b] = run[np.argsort(-d64[run] if higher else d64[run], kind="stable")]
    return order


def _distances64(block: _Block, metric: Metric, queries: np.ndarray | SparseRows, qi: int,
                 rows: np.ndarray) -> np.ndarray:
    """The float64 distances of query `qi` to some stored rows of a block, as the exact engines compute them:
    the L2 metrics summed from the coordinate differences, the others from float64 products (or L1 sums)."""
    dim = queries.dim if isinstance(queries, SparseRows) else queries.shape[1]
    sparse = block.source.sparse
    cols = [SPARSE_INDICES, SPARSE_VALUES] if sparse else [VECTOR]
    picked = vectors_of(block.source.table.select(cols).take(pa.array(rows, pa.int64())), sparse, dim)
    v = picked.to_dense().astype(np.float64) if sparse else picked.astype(np.float64)
    if isinstance(queries, SparseRows):
        q = np.zeros(dim, dtype=np.float64)
        q_idx, q_val = queries.row(qi)
        q[q_idx] = q_val
    else:
        q = queries[qi].astype(np.float64)
    if metric in (Metric.EUCLIDEAN, Metric.L2_SQUARED):
        diff = v - q
        sq = np.einsum("ij,ij->i", diff, diff)
        return np.sqrt(sq) if metric is Metric.EUCLIDEAN else sq
    return exact_distances(metric, q[None, :], v)[0]
