"""The distance metrics and the exact brute-force reference every engine is measured against.

Each metric has one distance definition shared by all engines, so results of several segments and engines
can be k-way merged: cosine is 1 - cosine similarity (a zero vector has distance 1.0 to everything),
euclidean is the L2 distance, manhattan the L1 distance, l2_squared the squared L2 distance (all: smaller is
nearer), and dot_product is the inner product itself (larger is nearer).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum

import numpy as np

from shoal.engines.sparse import SparseRows
from shoal.errors import ValidationError

# Bytes of float64 scratch one manhattan block may use in the reference (which broadcasts q x rows x dim).
_L1_BLOCK_BYTES = 64 << 20
# Bytes of each float64 gather (queries, rows) per block of `dense_top_k`'s re-summed pairs: small enough to come
# from the heap, as fresh multi-megabyte arrays are mapped and page-faulted on every call (ten times the sums' cost).
_RESUM_BYTES = 256 << 10
_U64 = 2.0**-53  # float64 unit roundoff


class Metric(StrEnum):
    """A distance definition (see the module docstring for each one's formula and direction)."""

    COSINE = "cosine"
    EUCLIDEAN = "euclidean"
    MANHATTAN = "manhattan"
    DOT_PRODUCT = "dot_product"
    L2_SQUARED = "l2_squared"


def as_metric(metric: Metric | str) -> Metric:
    """The Metric named `metric`; unknown names raise ValidationError listing the known ones."""
    try:
        return Metric(metric)
    except ValueError:
        known = ", ".join(m.value for m in Metric)
        raise ValidationError(f"unknown metric {metric!r} (known: {known})") from None


def higher_is_nearer(metric: Metric | str) -> bool:
    """True when a larger distance value means nearer (only dot_product)."""
    return as_metric(metric) is Metric.DOT_PRODUCT


def worst_distance(metric: Metric | str) -> float:
    """The distance that sorts after every real one: the padding value for missing results."""
    return -np.inf if higher_is_nearer(metric) else np.inf


def sort_keys(metric: Metric | str, distances: np.ndarray) -> np.ndarray:
    """Distances turned into keys where smaller is always nearer (negated for dot_product)."""
    return -distances if higher_is_nearer(metric) else distances


def from_products(metric: Metric, dots: np.ndarray, q_sq_norms: np.ndarray, v_sq_norms: np.ndarray) -> np.ndarray:
    """Distances from float64 inner products and squared norms (broadcast together); not for manhattan.

    L2 uses |q|^2 + |v|^2 - 2 q.v, which lets the products come from one matrix multiplication, but its error
    is relative to the squared norms (`rounding_bounds`), not to the distance: beside norms of 1e12 a distance of
    1000 comes out 0. The exact searches therefore rank with it only to choose the rows that can be among the k
    nearest, and sum those rows' differences directly (`rescored_top_k`, `rescore_nearest`).
    """
    if metric is Metric.DOT_PRODUCT:
        return dots
    if metric is Metric.COSINE:
        denom = np.sqrt(q_sq_norms) * np.sqrt(v_sq_norms)
        # A zero vector (norm 0, so every product with it 0) is at similarity 0: 0 / inf, without a masked divide's
        # extra arrays (this runs once per search of every exact path).
        return 1.0 - np.clip(dots / np.where(denom > 0, denom, np.inf), -1.0, 1.0)
    if metric in (Metric.L2_SQUARED, Metric.EUCLIDEAN):
        sq = np.maximum(q_sq_norms + v_sq_norms - 2.0 * dots, 0.0)
        return np.sqrt(sq) if metric is Metric.EUCLIDEAN else sq
    raise ValueError(f"{metric} distances do not follow from inner products")


def rounding_bounds(terms: int, q_mag: np.ndarray | float, v_mag: np.ndarray) -> np.ndarray:
    """A bound on |approximate - direct| for an L2 key (the squared distance) from `from_products`, or an L1
    distance from `SparseRows.l1_estimates`, where each of the sums involved has at most `terms` terms; `q_mag`
    and `v_mag` are the squared L2 norms (L2) or the L1 norms (manhattan) of the query and the rows. "Direct" is
    the sum of the squared (absolute) coordinate differences, which is within (terms + 3) 2^-53 of the distance
    itself.

    Why (u = 2^-53, g = terms u / (1 - terms u) bounds each float64 sum's relative error): |q|^2, |v|^2 and q.v
    each err by at most g |q|^2, g |v|^2 and g |q| |v| <= g (|q|^2 + |v|^2) / 2, and the addition and the
    subtraction round by u each, so the formula errs by at most (2 terms + 3) u (|q|^2 + |v|^2); the direct sum
    errs by at most (terms + 3) u |q - v|^2 <= (2 terms + 6) u (|q|^2 + |v|^2). Their sum is below the (8 terms +
    32) u (|q|^2 + |v|^2) given here, a factor 2 to spare. The L1 estimate's terms each round twice against
    |v_k| + |q_k|, and its sums within g of (|q|_1 + |v|_1), which the same bound covers."""
    return (8.0 * terms + 32.0) * _U64 * (q_mag + v_mag)


def _chosen(approx: np.ndarray, err: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(query, column) of every finite entry of `approx` [q, c] whose lower bound (approx - err) is within its
    row's k-th smallest upper bound (approx + err): those and only those can be among the row's k nearest."""
    kk = min(k, approx.shape[1])
    if kk <= 0 or len(approx) == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    kth = np.partition(approx + err, kk - 1, axis=1)[:, kk - 1]
    with np.errstate(invalid="ignore"):
        near = approx - err <= kth[:, None]
        if not np.isfinite(kth).all():  # too few finite entries: an infinite bound would keep the left-out ones
            near &= np.isfinite(approx)
    return np.nonzero(near)


def rescore_nearest(
    approx: np.ndarray, err: np.ndarray, k: int, direct: Callable[[np.ndarray, np.ndarray], np.ndarray]
) -> np.ndarray:
    """`approx` (float64 keys [q, c], smaller nearer, inf for an entry left out) with every entry that can be
    among its row's k smallest, each key being within `err` of its directly summed value, replaced by that value,
    `direct(queries, columns)` of those entries. Every other entry is farther than k replaced ones, so the k
    smallest keys of the result are direct sums, the true k nearest (ties by whatever order the caller uses).
    On ordinary data about k entries a row are summed again."""
    qi, ci = _chosen(approx, err, k)
    out = approx.copy()
    if len(qi):
        out[qi, ci] = direct(qi, ci)
    return out


def rescored_top_k(
    metric: Metric, approx: np.ndarray, err: np.ndarray, k: int,
    direct: Callable[[np.ndarray, np.ndarray], np.ndarray], labels: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest of each row of `approx` (float64 keys [q, c] of an L2 metric, squared, or manhattan; inf for
    an entry left out), as `top_k_of` gives them, from the directly summed keys (`direct(queries, columns)`) of
    the entries `rescore_nearest` would replace: distances (the square root of the key for euclidean) and the
    labels (`labels` [q, c], by default the column), ties by the lower label, padded with -1 and inf."""
    nq = len(approx)
    qi, ci = _chosen(approx, err, k)
    key = direct(qi, ci) if len(qi) else np.empty(0, dtype=np.float64)
    lab = ci if labels is None else labels[qi, ci]
    if nq == 1 and len(qi) >= k:  # a server's single query: fewer numpy calls (the young tier runs this per engine)
        order = np.lexsort((lab, key))[:k]
        best = key[order]
        return (np.sqrt(best) if metric is Metric.EUCLIDEAN else best)[None, :], lab[order][None, :]
    order = np.lexsort((lab, key, qi))  # per query (nonzero gives them in order), nearest first
    qs = qi[order]
    starts = np.concatenate(([0], np.cumsum(np.bincount(qs, minlength=nq))[:-1])).astype(np.int64)
    rank = np.arange(len(qs)) - starts[qs]
    take = rank < k
    out_d = np.full((nq, k), np.inf, dtype=np.float64)
    out_l = np.full((nq, k), -1, dtype=np.int64)
    out_d[qs[take], rank[take]] = key[order[take]]
    out_l[qs[take], rank[take]] = lab[order[take]]
    return (np.sqrt(out_d) if metric is Metric.EUCLIDEAN else out_d), out_l


def direct_sq(q64: np.ndarray, v64: np.ndarray, qi: np.ndarray, ri: np.ndarray) -> np.ndarray:
    """|q_qi - v_ri|^2 for each pair (float64 [len(qi)]), summed from the differences, the same way for every
    pair (einsum), so a row's value does not depend on where it sits."""
    out = np.empty(len(qi), dtype=np.float64)
    step = max(1, _RESUM_BYTES // (8 * max(q64.shape[1], 1)))
    for s in range(0, len(qi), step):
        diff = v64[ri[s : s + step]] - q64[qi[s : s + step]]
        out[s : s + step] = np.einsum("ij,ij->i", diff, diff)
    return out


def _dense_l1(queries: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    out = np.empty((len(queries), len(vectors)), dtype=np.float64)
    dim = max(vectors.shape[1], 1)
    rows = max(1, _L1_BLOCK_BYTES // (8 * dim * max(len(queries), 1)))
    for start in range(0, len(vectors), rows):
        block = vectors[start : start + rows]
        out[:, start : start + len(block)] = np.abs(queries[:, None, :] - block[None, :, :]).sum(axis=2)
    return out


def _dense_pair(queries: np.ndarray, vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Queries and vectors as float64 matrices of one dimension (ValidationError otherwise)."""
    q = np.asarray(queries, dtype=np.float64)
    v = np.asarray(vectors, dtype=np.float64)
    if q.ndim != 2 or v.ndim != 2 or q.shape[1] != v.shape[1]:
        raise ValidationError(f"queries {q.shape} and vectors {v.shape} must be 2-d with equal dimension")
    return q, v


def _dense_distances(metric: Metric, queries: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    q, v = _dense_pair(queries, vectors)
    if metric is Metric.MANHATTAN:
        return _dense_l1(q, v)
    q_sq = np.einsum("ij,ij->i", q, q)[:, None]
    v_sq = np.einsum("ij,ij->i", v, v)[None, :]
    return from_products(metric, q @ v.T, q_sq, v_sq)


def _sparse_distances(metric: Metric, queries: SparseRows | np.ndarray, vectors: SparseRows) -> np.ndarray:
    if not isinstance(queries, SparseRows):
        queries = SparseRows.from_dense(np.asarray(queries))
    if queries.dim != vectors.dim:
        raise ValidationError(f"query dimension {queries.dim} differs from vector dimension {vectors.dim}")
    out = np.empty((len(queries), len(vectors)), dtype=np.float64)
    v_sq = vectors.squared_norms() if metric is not Metric.MANHATTAN else None
    for i in range(len(queries)):
        qi, qv = queries.row(i)
        if metric is Metric.MANHATTAN:
            out[i] = vectors.l1_distances(qi, qv)
        else:
            qv64 = qv.astype(np.float64)
            out[i] = from_products(metric, vectors.dot(qi, qv), np.dot(qv64, qv64), v_sq)
    return out


def exact_distances(
    metric: Metric | str, queries: np.ndarray | SparseRows, vectors: np.ndarray | SparseRows
) -> np.ndarray:
    """Every query's distance to every vector (float64 [q, n]), accumulated in float64.

    Dense vectors take dense queries [q, d]; SparseRows vectors take SparseRows (or dense) queries.
    """
    metric = as_metric(metric)
    if isinstance(vectors, SparseRows):
        return _sparse_distances(metric, queries, vectors)
    if isinstance(queries, SparseRows):
        raise ValidationError("sparse queries need sparse vectors")
    return _dense_distances(metric, queries, vectors)


def top_k_of(metric: Metric, distances: np.ndarray, labels: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest of each row of (distances, labels), nearest first, ties by lower label, padded.

    Padding (when a row holds fewer than k entries) has label -1 and the metric's worst distance.
    """
    q, m = distances.shape
    keep = min(k, m)
    order = np.lexsort((labels, sort_keys(metric, distances)), axis=1)[:, :keep]
    out_d = np.full((q, k), worst_distance(metric), dtype=np.float64)
    out_l = np.full((q, k), -1, dtype=np.int64)
    out_d[:, :keep] = np.take_along_axis(distances, order, axis=1)
    out_l[:, :keep] = np.take_along_axis(labels, order, axis=1)
    return out_d, out_l


def _resum_margins(metric: Metric, dim: int, q_norms: np.ndarray, max_norm: float) -> np.ndarray:
    """Per query, twice a bound on how far a distance from a BLAS float64 product can lie from the same distance
    from a product summed in another order (each is within (dim + 8) 2^-53 |q| |v| of the exact product, with a
    factor 2 to spare), through each metric's formula; rows beyond the k-th distance by more than this are
    farther than the k nearest however either product is summed."""
    c = 2.0 * (dim + 8) * _U64
    if metric is Metric.DOT_PRODUCT:
        return 4.0 * c * q_norms * max_norm
    if metric is Metric.COSINE:  # the product over |q| |v|, then two roundings near 1
        return 4.0 * c + 16.0 * _U64 + 0.0 * q_norms
    if metric is Metric.L2_SQUARED:
        return 8.0 * c * (q_norms + max_norm) ** 2
    return 5.0 * np.sqrt(c) * (q_norms + max_norm)  # euclidean: |sqrt(a) - sqrt(b)| <= sqrt(|a - b|)


def dense_top_k(
    metric: Metric, q64: np.ndarray, v64: np.ndarray, v_sq: np.ndarray, k: int, first_label: int = 0,
    max_norm: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The exact k nearest rows of float64 `v64` (squared norms `v_sq`, largest norm `max_norm` if known) to
    each float64 query, as `top_k_of` gives them (labels from `first_label`), ranked as if every row's product
    were summed in the same order; not for manhattan.

    One BLAS product ranks the rows, but BLAS may sum a row differently by where it sits (two identical rows
    came out one rounding step apart in about 2 % of random cases), which would order exact duplicates by
    position. Where the k nearest and the next one all lie further apart than `_resum_margins`, no order of
    summing could change the ranking, and it stands (the common case); for the other queries, every row within
    the margin of the k-th is summed again, row by row in one order (einsum), and those sums rank the answer."""
    nq, n = len(q64), len(v64)
    keep = min(k, n)
    q_sq = np.einsum("ij,ij->i", q64, q64)
    if metric in (Metric.L2_SQUARED, Metric.EUCLIDEAN):
        # The product formula only chooses the rows that can be nearest; their direct sums rank them (the
        # same for a row wherever it sits, so exact duplicates come in row order without re-summing).
        # from_products and rounding_bounds in place: this runs per query and engine of the young tier.
        err = np.add(q_sq[:, None], v_sq[None, :])
        sq = np.multiply(q64 @ v64.T, -2.0)
        sq += err
        np.maximum(sq, 0.0, out=sq)
        err *= (8.0 * q64.shape[1] + 32.0) * _U64  # rounding_bounds(dim, ...)
        d, lab = rescored_top_k(metric, sq, err, k, lambda qi, ri: direct_sq(q64, v64, qi, ri))
        return d, (np.where(lab >= 0, lab + first_label, -1) if first_label else lab)
    dist = from_products(metric, q64 @ v64.T, q_sq[:, None], v_sq[None, :])
    if keep == 0 or nq == 0:
        return top_k_of(metric, dist, np.broadcast_to(np.arange(n, dtype=np.int64), dist.shape), k)
    keys = -dist if metric is Metric.DOT_PRODUCT else dist
    width = min(keep + 1, n)  # the k nearest and the next one
    if max_norm is None:
        max_norm = float(np.sqrt(v_sq.max()))
    margin = _resum_margins(metric, q64.shape[1], np.sqrt(q_sq), max_norm)
    rows = np.arange(nq)[:, None]
    if n > 4 * width:  # choose them, then sort them (equal keys are close, so this order need not be stable)
        near = np.argpartition(keys, width - 1, axis=1)[:, :width]
        near = near[rows, np.argsort(keys[rows, near], axis=1)]
    else:
        near = np.argsort(keys, axis=1)[:, :width]
    near_keys = keys[rows, near]
    # A NaN key (never compares) lets the ranking stand, NaN last, as before.
    close = ((near_keys[:, 1:] - near_keys[:, :-1]) <= margin[:, None]).any(axis=1)
    out_d, out_l = dist[rows, near[:, :keep]], near[:, :keep] + first_label
    if close.any():
        redo = np.flatnonzero(close)
        d, lab = _resummed_top_k(metric, q64[redo], v64, q_sq[redo], v_sq, keys[redo],
                                 near_keys[redo, keep - 1] + margin[redo], keep)
        out_d[redo], out_l[redo] = d, lab + first_label
    if keep == k:
        return out_d, out_l
    pad_d = np.full((nq, k), worst_distance(metric), dtype=np.float64)
    pad_l = np.full((nq, k), -1, dtype=np.int64)
    pad_d[:, :keep], pad_l[:, :keep] = out_d, out_l
    return pad_d, pad_l


def _resummed_top_k(
    metric: Metric, q64: np.ndarray, v64: np.ndarray, q_sq: np.ndarray, v_sq: np.ndarray, keys: np.ndarray,
    limit: np.ndarray, keep: int
) -> tuple[np.ndarray, np.ndarray]:
    """`dense_top_k` for queries with near-ties: every row whose BLAS key is within `limit` (the k-th key plus
    the margin) summed again by einsum, ranked by those sums, ties by the lower row."""
    nq = len(q64)
    with np.errstate(invalid="ignore"):  # NaN never compares greater: a NaN key or limit keeps the row
        qi, ri = np.nonzero(~(keys > limit[:, None]))
    dots = np.empty(len(qi), dtype=np.float64)
    step = max(1, _RESUM_BYTES // (8 * max(q64.shape[1], 1)))
    for s in range(0, len(qi), step):
        dots[s : s + step] = np.einsum("ij,ij->i", q64[qi[s : s + step]], v64[ri[s : s + step]])
    d = from_products(metric, dots, q_sq[qi], v_sq[ri])
    order = np.lexsort((ri, sort_keys(metric, d), qi))  # per query (nonzero gives them in order), nearest first
    starts = np.concatenate(([0], np.cumsum(np.bincount(qi, minlength=nq))[:-1]))
    pick = order[(starts[:, None] + np.arange(keep)).ravel()]
    return d[pick].reshape(nq, keep), ri[pick].reshape(nq, keep).astype(np.int64)


def exact_top_k(
    metric: Metric | str, queries: np.ndarray | SparseRows, vectors: np.ndarray | SparseRows, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The exact k nearest vectors of each query: (distances float64 [q, k], labels int64 [q, k]).

    Labels are row positions; nearest first, ties broken by the lower label (exact duplicates included);
    padded with label -1 and distance +inf (-inf for dot_product) when there are fewer than k vectors.
    """
    metric = as_metric(metric)
    if metric is not Metric.MANHATTAN and not isinstance(queries, SparseRows) and not isinstance(vectors, SparseRows):
        q, v = _dense_pair(queries, vectors)
        return dense_top_k(metric, q, v, np.einsum("ij,ij->i", v, v), k)
    if isinstance(vectors, SparseRows):
        if not isinstance(queries, SparseRows):
            queries = SparseRows.from_dense(np.asarray(queries))
        if queries.dim != vectors.dim:
            raise ValidationError(f"query dimension {queries.dim} differs from vector dimension {vectors.dim}")
        return sparse_top_k(metric, queries, vectors, k)
    dist = exact_distances(metric, queries, vectors)
    labels = np.broadcast_to(np.arange(dist.shape[1], dtype=np.int64), dist.shape)
    return top_k_of(metric, dist, labels, k)


def sparse_top_k(
    metric: Metric, queries: SparseRows, rows: SparseRows, k: int, magnitudes: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The exact k nearest of `rows` to each sparse query, as `exact_top_k` gives them (float64 distances,
    labels; ties by the lower row, padded with -1). `magnitudes` are the rows' squared norms (L2 metrics, cosine,
    dot_product) or L1 norms (manhattan) when the caller holds them.

    One O(nnz) pass per query scores every row; for the L2 metrics and manhattan that score (|q|^2 + |v|^2 -
    2 q.v, or |q|_1 plus the row's corrections) is exact only to `rounding_bounds` of the norms, so it chooses
    the rows that can be nearest and their directly summed distances rank them."""
    if k <= 0:
        return np.empty((len(queries), 0), dtype=np.float64), np.empty((len(queries), 0), dtype=np.int64)
    if magnitudes is None:
        magnitudes = rows.l1_norms() if metric is Metric.MANHATTAN else rows.squared_norms()
    out_d = np.empty((len(queries), k), dtype=np.float64)
    out_l = np.empty((len(queries), k), dtype=np.int64)
    widest = int(np.diff(rows.indptr).max(initial=0))
    for i in range(len(queries)):
        qi, qv = queries.row(i)
        qv64 = qv.astype(np.float64)
        if metric in (Metric.COSINE, Metric.DOT_PRODUCT):
            dist = from_products(metric, rows.dot(qi, qv), float(qv64 @ qv64), magnitudes)
            keys = sort_keys(metric, dist)
            # Only rows at most as far as the k-th nearest can be in the answer; keeping every row tied with
            # it lets the label tie-break pick the lowest labels.
            kth = np.partition(keys, k - 1)[k - 1] if len(keys) >= k else np.inf
            cand = np.flatnonzero(keys <= kth)
            d, lab = top_k_of(metric, dist[cand][None, :], cand[None, :], k)
        else:
            if metric is Metric.MANHATTAN:
                approx, q_mag = rows.l1_estimates(qi, qv), float(np.abs(qv64).sum())
            else:
                q_mag = float(qv64 @ qv64)
                approx = from_products(Metric.L2_SQUARED, rows.dot(qi, qv), q_mag, magnitudes)
            err = rounding_bounds(widest + len(qi) + 1, q_mag, magnitudes)

            def direct(_: np.ndarray, ri: np.ndarray, qi: np.ndarray = qi, qv: np.ndarray = qv) -> np.ndarray:
                picked = rows.take(ri)
                return picked.l1_distances(qi, qv) if metric is Metric.MANHATTAN else picked.sq_l2_distances(qi, qv)

            d, lab = rescored_top_k(metric, approx[None, :], err[None, :], k, direct)
        out_d[i], out_l[i] = d[0], lab[0]
    return out_d, out_l
