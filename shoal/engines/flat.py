"""Exact search over dense vectors: the production exactness reference, so it must be both exact and fast.

Speed comes from float32 matrix products (BLAS) over row blocks; exactness from a float64 rerank plus a
certificate. Per query we keep the kc best rows by the float32 approximation and remember the best
approximate key we dropped. A float32 product of d terms is off by at most ~d * 2^-24 * |q| * |v|, so with
that bound as a margin, the kept rows contain the true top k once the k-th exact (float64) key is below the
best dropped key minus the margin. Queries whose certificate fails (many near-ties) retry with more
candidates and finally fall back to a streaming float64 scan, so the answer always equals `exact_top_k`
(up to genuine floating-point ties).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

import numpy as np

from shoal.engines.base import Engine, register
from shoal.engines.envelope import array_section
from shoal.engines.metrics import (
    Metric,
    dense_top_k,
    direct_sq,
    exact_distances,
    from_products,
    rescore_nearest,
    rounding_bounds,
    top_k_of,
    worst_distance,
)

_U = 2.0**-24  # float32 unit roundoff
_SCORE_BYTES = 32 << 20  # float32 scratch for one (query batch x row block) score matrix
_GATHER_BYTES = 64 << 20  # float64 scratch for one rerank gather or one exact-scan block
_QUERY_BATCH = 256
_MAX_CANDIDATES = 8192  # beyond this (or beyond a quarter of the rows) a float64 scan is cheaper
# Up to this many rows a search is one float64 product against vectors converted once, then one stable sort:
# exact with no certificate, and far fewer numpy calls per query (a small engine, such as the searcher's
# young tier of a few hundred unindexed points, spent ~0.4 ms a query in the general path, ~0.05 ms here).
# Beyond about a thousand rows the float64 product reads twice the bytes and the full sort outgrows the float32
# pass: one 384-d query, cosine, us per engine (small path / general path), one engine in cache: 512 rows 50 / 91,
# 1,024 rows 94 / 106, 2,048 rows 417 / 193; 40,000 rows over many engines (a busy young tier): 512 rows 107 /
# 109, 1,024 rows 190 / 143, 2,048 rows 565 / 469.
_SMALL_ROWS = 1024


def product_error_bound(dim: int) -> float:
    """A bound (with a factor 2 to spare) on the rounding error of a float32 dim-term dot product or L1 sum,
    relative to the magnitudes involved (|q| |v|, or the sum of |terms|)."""
    return 2.0 * (dim + 8) * _U


def key_margins(metric: Metric, dim: int, q_norms: np.ndarray, max_norm: float) -> np.ndarray:
    """Per query (of norm `q_norms`), a bound on |float32 key - exact key| for rows of norm at most `max_norm`,
    keys as `FlatEngine` makes them from float32 products (smaller is nearer; not manhattan): -q.v for
    dot_product, -cos for cosine (product scaled by both float32 inverse norms), |q|^2 + |v|^2 - 2 q.v for the
    L2 metrics. A row whose float32 key exceeds the k-th smallest by more than twice this is not in the top k."""
    c = product_error_bound(dim)
    if metric is Metric.DOT_PRODUCT:
        return c * q_norms * max_norm
    if metric is Metric.COSINE:
        # c for the product of unit-scaled vectors, plus roundings of the two float32 inverse norms.
        return (c + 8 * _U) + 0.0 * q_norms  # the shape of q_norms (a float stays a float, cheaply)
    if metric is Metric.MANHATTAN:
        raise ValueError("manhattan keys are L1 sums: their margin needs the L1 norms")
    return 2 * c * (q_norms + max_norm) ** 2


def _row_blocks(n: int, rows: int) -> list[tuple[int, int]]:
    rows = max(1, rows)
    return [(s, min(n, s + rows)) for s in range(0, n, rows)]


def _keep_smallest(keys: np.ndarray, labels: np.ndarray, kc: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kc smallest keys per row (unordered) with their labels, and the smallest key left out (inf if none)."""
    if keys.shape[1] <= kc:
        return keys, labels, np.full(len(keys), np.inf)
    part = np.argpartition(keys, kc, axis=1)
    # After partitioning, position kc holds the (kc+1)-th smallest key: the best one we drop.
    dropped = np.take_along_axis(keys, part[:, kc : kc + 1], axis=1)[:, 0].astype(np.float64)
    keep = part[:, :kc]
    return np.take_along_axis(keys, keep, axis=1), np.take_along_axis(labels, keep, axis=1), dropped


@register
class FlatEngine(Engine):
    """Exact kNN over dense float32 vectors; every metric."""

    algorithm = "flat"
    supported_metrics = frozenset(Metric)
    sparse = False

    def __init__(self, vectors: np.ndarray, metric: Metric, params: dict[str, Any]) -> None:
        super().__init__(metric, params, int(vectors.shape[1]), len(vectors))
        self._vectors = vectors
        n, d = vectors.shape
        self._sq_norms = np.empty(n, dtype=np.float64)
        l1 = np.empty(n, dtype=np.float64) if metric is Metric.MANHATTAN else None
        for s, e in _row_blocks(n, _GATHER_BYTES // (8 * d)):
            block = vectors[s:e].astype(np.float64)
            self._sq_norms[s:e] = np.einsum("ij,ij->i", block, block)
            if l1 is not None:
                l1[s:e] = np.abs(block).sum(axis=1)
        norms = np.sqrt(self._sq_norms)
        self._max_norm = float(norms.max()) if n else 0.0
        self._max_l1 = float(l1.max()) if l1 is not None and n else 0.0
        with np.errstate(over="ignore"):  # a norm^2 past float32's range is inf in the keys (huge vectors)
            self._sq_norms32 = self._sq_norms.astype(np.float32)
        self._inv_norms32 = np.divide(1.0, norms, out=np.zeros(n), where=norms > 0).astype(np.float32)
        self._c = product_error_bound(d)
        self._small: np.ndarray | None = None  # float64 rows for _search_small, made on its first use

    def rows_and_norms(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The engine's float32 rows and, per row, the squared norm in float64 and float32 and the inverse norm
        in float32 (0 for a zero row), as its keys use them: a scan of some of its rows can reuse them."""
        return self._vectors, self._sq_norms, self._sq_norms32, self._inv_norms32

    @classmethod
    def _build(cls, vectors: np.ndarray, metric: Metric, params: dict[str, Any], threads: int) -> Self:
        return cls(vectors, metric, params)

    def _sections(self) -> list[bytes | memoryview]:
        return [array_section(self._vectors, "<f4")]

    @classmethod
    def _load(cls, header: dict[str, Any], sections: list[memoryview], metric: Metric, params: dict[str, Any]) -> Self:
        vectors = np.frombuffer(sections[0], dtype="<f4").reshape(int(header["count"]), int(header["dim"]))
        return cls(vectors.astype(np.float32, copy=False), metric, params)

    # ---- search -----------------------------------------------------------------------------------------

    def _search(
        self, queries: np.ndarray, k: int, threads: int, params: Mapping[str, int] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        # Distances past float32's range (huge vectors) are reported as inf, without a warning per search.
        with np.errstate(over="ignore"):
            return self._search_exact(queries, k)

    def _search_exact(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self) <= _SMALL_ROWS and self.metric is not Metric.MANHATTAN and len(queries) <= _QUERY_BATCH:
            return self._search_small(queries, k)
        out_d = np.empty((len(queries), k), dtype=np.float32)
        out_l = np.empty((len(queries), k), dtype=np.int64)
        for s, e in _row_blocks(len(queries), _QUERY_BATCH):
            d, lab = self._search_batch(queries[s:e], k)
            out_d[s:e], out_l[s:e] = d, lab
        return out_d, out_l

    def _search_small(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact top k over few rows: float64 distances to every row, nearest first, ties by lower label."""
        if self._small is None:
            self._small = self._vectors.astype(np.float64)
        d, labels = dense_top_k(self.metric, queries.astype(np.float64), self._small, self._sq_norms, k,
                                max_norm=self._max_norm)
        return d.astype(np.float32), labels

    def _search_batch(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        n = len(self)
        res_d = np.empty((len(queries), k), dtype=np.float64)
        res_l = np.empty((len(queries), k), dtype=np.int64)
        pending = np.arange(len(queries))
        if self.metric is Metric.COSINE:
            # A zero query is at distance 1 from every row: all tie, so the answer is the lowest labels.
            # Answered here because such total ties would otherwise defeat the certificate every time.
            zero = ~queries[pending].any(axis=1)
            res_d[zero], res_l[zero] = 1.0, np.arange(k)
            pending = pending[~zero]
        kc = k + max(k, 16)
        while len(pending):
            q = queries[pending]
            if kc >= n // 4 or kc > max(_MAX_CANDIDATES, 2 * k):
                res_d[pending], res_l[pending] = self._scan_exact(q, k)
                break
            cand, dropped = self._candidates(q, kc)
            d, lab = top_k_of(self.metric, self._rerank(q, cand, k), cand, k)
            ok = dropped - self._margins(q) > self._approx_key(d[:, k - 1])
            res_d[pending[ok]], res_l[pending[ok]] = d[ok], lab[ok]
            pending = pending[~ok]
            kc *= 8
        return res_d.astype(np.float32), res_l

    def _candidates(self, queries: np.ndarray, kc: int) -> tuple[np.ndarray, np.ndarray]:
        """The kc rows with the best float32 keys per query, and per query the best key not kept."""
        keys = np.empty((len(queries), 0), dtype=np.float32)
        labels = np.empty((len(queries), 0), dtype=np.int64)
        dropped = np.full(len(queries), np.inf)
        rows = max(kc + 1, _SCORE_BYTES // (4 * len(queries)))
        for s, e in _row_blocks(len(self), rows):
            block_keys = self._approx_keys(queries, s, e)
            block_labels = np.broadcast_to(np.arange(s, e, dtype=np.int64), block_keys.shape)
            bk, bl, bd = _keep_smallest(block_keys, block_labels, kc)
            keys, labels, md = _keep_smallest(np.hstack([keys, bk]), np.hstack([labels, bl]), kc)
            dropped = np.minimum(dropped, np.minimum(bd, md))
        return labels, dropped

    def _approx_keys(self, q: np.ndarray, s: int, e: int) -> np.ndarray:
        """float32 keys (smaller is nearer) of rows s:e for each query."""
        v = self._vectors[s:e]
        m = self.metric
        if m is Metric.MANHATTAN:
            out = np.empty((len(q), e - s), dtype=np.float32)
            sub = max(1, _SCORE_BYTES // (4 * len(q) * self.dim))
            for a, b in _row_blocks(e - s, sub):
                out[:, a:b] = np.abs(q[:, None, :] - v[None, a:b, :]).sum(axis=2)
            return out
        norms = self._inv_norms32 if m is Metric.COSINE else self._sq_norms32
        return _to_keys(m, q @ v.T, q, lambda: norms[s:e])

    def _margins(self, q: np.ndarray) -> np.ndarray:
        """Per query, a bound on |float32 key - exact key| over all rows."""
        q64 = q.astype(np.float64)
        if self.metric is Metric.MANHATTAN:
            return self._c * (np.abs(q64).sum(axis=1) + self._max_l1)
        return key_margins(self.metric, self.dim, np.linalg.norm(q64, axis=1), self._max_norm)

    def _approx_key(self, distances: np.ndarray) -> np.ndarray:
        """Exact distances expressed in the key space of `_approx_keys`."""
        m = self.metric
        if m is Metric.DOT_PRODUCT:
            return -distances
        if m is Metric.COSINE:
            return distances - 1.0
        if m is Metric.EUCLIDEAN:
            return distances * distances
        return distances

    def _rerank(self, queries: np.ndarray, cand: np.ndarray, k: int) -> np.ndarray:
        """float64 distances of each query to its candidate rows, those that can be among its k nearest summed
        directly for the L2 metrics (`_rescored`), so its k smallest are exact."""
        out = np.empty(cand.shape, dtype=np.float64)
        q64 = queries.astype(np.float64)
        q_sq = np.einsum("ij,ij->i", q64, q64)
        per_batch = _GATHER_BYTES // (8 * cand.shape[1] * self.dim)
        for s, e in _row_blocks(len(queries), per_batch):
            g = self._vectors[cand[s:e]].astype(np.float64)
            if self.metric is Metric.MANHATTAN:
                out[s:e] = np.abs(g - q64[s:e, None, :]).sum(axis=2)
            else:
                dots = np.einsum("bd,bkd->bk", q64[s:e], g)
                out[s:e] = _rescored(self.metric, dots, q64[s:e], q_sq[s:e], self._sq_norms[cand[s:e]], g, k)
        return out

    def _scan_exact(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The exact top k by a streaming float64 scan (the fallback when near-ties defeat the certificate)."""
        best_d = np.empty((len(queries), 0), dtype=np.float64)
        best_l = np.empty((len(queries), 0), dtype=np.int64)
        q64 = queries.astype(np.float64)
        for s, e in _row_blocks(len(self), _GATHER_BYTES // (8 * (len(queries) + self.dim))):
            if self.metric is Metric.MANHATTAN:  # L1 sums run row by row in one order already
                dist = exact_distances(self.metric, queries, self._vectors[s:e])
                labels = np.broadcast_to(np.arange(s, e, dtype=np.int64), dist.shape)
            else:  # each block's own top k, from products summed the same way for every row
                dist, labels = dense_top_k(self.metric, q64, self._vectors[s:e].astype(np.float64),
                                           self._sq_norms[s:e], min(k, e - s), first_label=s)
            best_d, best_l = top_k_of(self.metric, np.hstack([best_d, dist]), np.hstack([best_l, labels]), k)
        return best_d, best_l


def search_together(
    engines: Sequence[FlatEngine], queries: np.ndarray, k: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The exact k nearest rows of `engines` taken together, handed back per engine: for each, (distances
    float32 [q, k], labels int64 [q, k]) holding nearest first the rows of the joint top k that are its own,
    label -1 and the worst distance elsewhere. Ties go to the lower label in engine order, as searching each
    engine for k and merging them in that order does; this gives the same answer with one float32 pass and
    one certificate over all rows. Why: the searcher's young tier is dozens of small exact engines, and the
    full path per engine (about 0.1 ms of numpy calls each) cost more than reading their rows
    (bench/freshness.py). The engines share one metric and dimension; `queries` are checked dense float32."""
    with np.errstate(over="ignore"):  # distances past float32's range are inf, as FlatEngine.search gives them
        return _search_together(engines, queries, k)


def _search_together(
    engines: Sequence[FlatEngine], queries: np.ndarray, k: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    if not engines:
        return []
    metric = engines[0].metric
    sizes = np.array([len(e) for e in engines], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    n = int(offsets[-1])
    kc = k + max(k, 16)
    per_batch = min(_QUERY_BATCH, _SCORE_BYTES // (4 * max(n, 1)))
    if (len(engines) == 1 or metric is Metric.MANHATTAN or k <= 0 or n <= _SMALL_ROWS or kc >= n // 4
            or per_batch < 1):
        return [e.search(queries, k, checked=True) for e in engines]
    out_d = np.empty((len(queries), k), dtype=np.float64)
    out_l = np.empty((len(queries), k), dtype=np.int64)
    widest = max(engines, key=lambda e: e._max_norm)  # the margin grows with the largest norm
    for s, e in _row_blocks(len(queries), per_batch):
        q = queries[s:e]
        keys = _keys_together(engines, offsets, q)
        part = np.argpartition(keys, kc, axis=1)
        cand = part[:, :kc]
        dropped = np.take_along_axis(keys, part[:, kc : kc + 1], axis=1)[:, 0].astype(np.float64)
        dist = _rerank_together(engines, offsets, q, cand, k)
        d, lab = top_k_of(metric, dist, cand, k)
        ok = dropped - widest._margins(q) > engines[0]._approx_key(d[:, k - 1])
        if not ok.all():
            # Near-ties the float32 pass cannot separate: those queries search every engine exactly.
            redo = np.flatnonzero(~ok)
            parts = [eng.search(q[redo], k, checked=True) for eng in engines]
            d2 = np.hstack([p[0].astype(np.float64) for p in parts])
            l2 = np.hstack([np.where(p[1] >= 0, p[1] + off, -1) for p, off in zip(parts, offsets, strict=False)])
            d2 = np.where(l2 >= 0, d2, worst_distance(metric))
            l2 = np.where(l2 >= 0, l2, np.iinfo(np.int64).max)  # missing rows sort after every real one
            d[redo], lab[redo] = top_k_of(metric, d2, l2, k)
        out_d[s:e], out_l[s:e] = d, lab
    out_d32 = out_d.astype(np.float32)
    worst = worst_distance(metric)
    results = []
    for i in range(len(engines)):
        mine = (out_l >= offsets[i]) & (out_l < offsets[i + 1])
        results.append((np.where(mine, out_d32, np.float32(worst)), np.where(mine, out_l - offsets[i], -1)))
    return results


def _rerank_together(
    engines: Sequence[FlatEngine], offsets: np.ndarray, queries: np.ndarray, cand: np.ndarray, k: int
) -> np.ndarray:
    """float64 distances of each query to its candidate rows, given as labels over the engines in turn (as
    `FlatEngine._rerank` makes them: the k smallest are exact)."""
    flat = cand.ravel()
    owner = (np.searchsorted(offsets, flat, side="right") - 1).tolist()
    local = (flat - offsets[owner]).tolist()
    # Row by row: a few dozen candidates per query, spread over many engines, gather faster one at a time
    # than by a numpy selection per engine.
    g = np.array([engines[o]._vectors[r] for o, r in zip(owner, local, strict=True)], dtype=np.float64)
    sq = np.array([engines[o]._sq_norms[r] for o, r in zip(owner, local, strict=True)], dtype=np.float64)
    q64 = queries.astype(np.float64)
    g = g.reshape(*cand.shape, -1)
    dots = np.einsum("bkd,bd->bk", g, q64)
    return _rescored(engines[0].metric, dots, q64, np.einsum("ij,ij->i", q64, q64), sq.reshape(cand.shape), g, k)


def _rescored(
    metric: Metric, dots: np.ndarray, q64: np.ndarray, q_sq: np.ndarray, v_sq: np.ndarray, g: np.ndarray, k: int
) -> np.ndarray:
    """float64 distances [q, c] of queries `q64` (squared norms `q_sq`) to their gathered candidate rows `g`
    [q, c, d] (squared norms `v_sq`) from the products `dots`; for the L2 metrics, whose product formula errs
    relative to the norms, every candidate that can be among the k nearest is summed again from the
    differences (`rescore_nearest`), so the k smallest are exact whatever the norms."""
    if metric not in (Metric.L2_SQUARED, Metric.EUCLIDEAN):
        return from_products(metric, dots, q_sq[:, None], v_sq)
    sq = from_products(Metric.L2_SQUARED, dots, q_sq[:, None], v_sq)
    err = rounding_bounds(q64.shape[1], q_sq[:, None], v_sq)
    sq = rescore_nearest(sq, err, k, lambda qi, ci: direct_sq(q64, g[qi, ci], qi, np.arange(len(qi))))
    return np.sqrt(sq) if metric is Metric.EUCLIDEAN else sq


def _keys_together(engines: Sequence[FlatEngine], offsets: np.ndarray, q: np.ndarray) -> np.ndarray:
    """`_approx_keys` of every row of the engines in turn, [q, rows]: the products per engine, the metric's
    scaling once over them all."""
    keys = np.empty((len(q), int(offsets[-1])), dtype=np.float32)
    for i, eng in enumerate(engines):
        np.matmul(q, eng._vectors.T, out=keys[:, offsets[i] : offsets[i + 1]])
    cosine = engines[0].metric is Metric.COSINE
    return _to_keys(engines[0].metric, keys, q,
                    lambda: np.concatenate([e._inv_norms32 if cosine else e._sq_norms32 for e in engines]))


def _to_keys(metric: Metric, prod: np.ndarray, q: np.ndarray, row_norms: Callable[[], np.ndarray]) -> np.ndarray:
    """float32 products q.v [queries, rows] made, in place, the keys `_approx_keys` promises (smaller is nearer).
    `row_norms` gives the rows' float32 inverse norms for cosine, squared norms for the L2 metrics."""
    if metric is Metric.DOT_PRODUCT:
        np.negative(prod, out=prod)
    elif metric is Metric.COSINE:
        q_norms = np.linalg.norm(q.astype(np.float64), axis=1)
        inv_q = np.divide(1.0, q_norms, out=np.zeros(len(q)), where=q_norms > 0).astype(np.float32)
        prod *= -inv_q[:, None]
        prod *= row_norms()[None, :]
    else:  # squared L2 for both L2 metrics: |q|^2 + |v|^2 - 2 q.v
        prod *= -2.0
        prod += row_norms()[None, :]
        prod += np.einsum("ij,ij->i", q, q)[:, None]
    return prod
