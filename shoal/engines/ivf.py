"""Approximate search with inverted lists (faiss IndexIVFFlat; k-means is faiss's, never ours).

Metrics: euclidean and l2_squared use METRIC_L2 (faiss returns squared L2; euclidean takes the square root),
dot_product uses METRIC_INNER_PRODUCT, cosine normalises vectors and queries and uses the inner product
(distance 1 - ip, clipped to [0, 2] as flat clips it: float32 products of unit vectors stray past +-1 by
about 1e-7; zero vectors stay zero, so their distance is 1). Manhattan is refused.

faiss parallelises with OpenMP. omp_set_num_threads acts on the calling thread only (checked with faiss-cpu's
bundled libgomp), so each build or search sets the thread count it wants and restores the previous one.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Self

import numpy as np

from shoal.engines.base import Engine, register
from shoal.engines.envelope import array_section
from shoal.engines.metrics import Metric, top_k_of
from shoal.engines.params import int_param, reject_unknown
from shoal.errors import ValidationError
from shoal.log.validation import vector_problem

DEFAULT_NPROBE = 32  # of ~4·sqrt(n) lists: recall@10 ≈ 0.92 on the 384-d test embeddings (8 gave ≈ 0.79)
_MAX_NLIST = 1 << 20
_SUPPORTED = frozenset({Metric.COSINE, Metric.DOT_PRODUCT, Metric.EUCLIDEAN, Metric.L2_SQUARED})
# A build refuses rows whose squared norm passes float32's largest value / 4 (norm sqrt(float32 max) / 2, about
# 9.22e18): faiss's k-means aborted the process on longer ones. That was the intake's bound before it became
# MAX_NORM (2^62.5), which leaves float32 room for the distances: rows stored under the former bound still build
# (only searching them may overflow), and no row past it was ever stored.
_KMEANS_MAX_SQ_NORM = float(np.finfo(np.float32).max) / 4


def _kmeans_unfit(vectors: np.ndarray) -> np.ndarray:
    """Positions of the rows of float32 [n, d] `vectors` past _KMEANS_MAX_SQ_NORM (or not finite): a float32 sum
    of squares per row, summed again in float64 for the rows within its rounding error of the bound or past it
    (no float64 copy of the whole build)."""
    with np.errstate(over="ignore", invalid="ignore"):
        sq = np.einsum("ij,ij->i", vectors, vectors)
        near = np.flatnonzero(~(sq <= _KMEANS_MAX_SQ_NORM * (1.0 - 2.0 * (vectors.shape[1] + 2) * 2.0**-24)))
        wide = vectors[near].astype(np.float64)
        return near[~(np.einsum("ij,ij->i", wide, wide) <= _KMEANS_MAX_SQ_NORM)]


def _faiss() -> Any:
    import faiss  # imported late: importing faiss costs ~0.1 s, and most processes never need it

    return faiss


@contextmanager
def _omp_threads(n: int) -> Iterator[None]:
    faiss = _faiss()
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(n)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)


def default_nlist(n: int) -> int:
    """About 4 * sqrt(n) lists, at least 1 and at most n."""
    return max(1, min(n, round(4 * math.sqrt(n))))


def _unit_rows(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    return np.divide(x, norms, out=np.zeros_like(x), where=norms > 0).astype(np.float32)


@register
class IvfEngine(Engine):
    """IVF-Flat over dense float32 vectors: cosine, dot_product, euclidean, l2_squared."""

    algorithm = "ivf"
    supported_metrics = _SUPPORTED
    sparse = False
    search_params = {"nprobe": (1, _MAX_NLIST)}

    def __init__(self, index: Any, metric: Metric, params: dict[str, Any], dim: int, count: int) -> None:
        super().__init__(metric, params, dim, count)
        self._index = index  # None when there are no rows

    @classmethod
    def normalize_params(cls, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """nlist (None: about 4 * sqrt(n), fixed at build) and nprobe (default 32, clamped to nlist)."""
        params = dict(params or {})
        reject_unknown(cls.algorithm, params, ("nlist", "nprobe"))
        nlist = params.get("nlist")
        return {
            "nlist": None if nlist is None else int_param("nlist", nlist, 1, _MAX_NLIST),
            "nprobe": int_param("nprobe", params.get("nprobe", DEFAULT_NPROBE), 1, _MAX_NLIST),
        }

    @classmethod
    def _build(cls, vectors: np.ndarray, metric: Metric, params: dict[str, Any], threads: int) -> Self:
        n, dim = vectors.shape
        # Small splits get fewer lists: k-means needs at least one point per list.
        nlist = max(1, min(params["nlist"] or default_nlist(n), n))
        effective = {**params, "nlist": nlist if n else params["nlist"]}
        if n == 0:
            return cls(None, metric, effective, dim, 0)
        if (unfit := _kmeans_unfit(np.ascontiguousarray(vectors, dtype=np.float32))).size:
            # Written before the intake bounded norms: faiss's k-means would abort the process on it.
            raise ValidationError(f"row {int(unfit[0])}: {vector_problem(vectors[unfit[0]], vectors[unfit[0]])}")
        faiss = _faiss()
        if metric is Metric.COSINE:
            vectors = _unit_rows(vectors)
        faiss_metric = (
            faiss.METRIC_L2 if metric in (Metric.EUCLIDEAN, Metric.L2_SQUARED) else faiss.METRIC_INNER_PRODUCT
        )
        quantizer = faiss.IndexFlat(dim, faiss_metric)
        index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss_metric)  # faiss's wrapper keeps quantizer alive
        # faiss warns on stderr below 39 training points per list; a few points per list still cluster
        # usefully (the default nlist leaves ~sqrt(n)/4 per list), so we accept it and silence the warning.
        index.cp.min_points_per_centroid = 1
        # k-means costs n * nlist * d per iteration; 64 sampled points per list train it well enough and keep
        # a 1M-row build in minutes (faiss's default of 256 would train on every row).
        index.cp.max_points_per_centroid = 64
        index.cp.spherical = metric is Metric.COSINE
        with _omp_threads(threads):
            index.train(vectors)
            index.add(vectors)
        return cls(index, metric, effective, dim, n)

    def _search(
        self, queries: np.ndarray, k: int, threads: int, params: Mapping[str, int] | None = None,
        selector: Any = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        faiss = _faiss()
        if self.metric is Metric.COSINE:
            queries = _unit_rows(queries)
        # Per-call search parameters: unlike index.nprobe they are safe under concurrent searches.
        nprobe = min(params["nprobe"] if params and "nprobe" in params else self._params["nprobe"], self._index.nlist)
        search = faiss.SearchParametersIVF(nprobe=nprobe) if selector is None else \
            faiss.SearchParametersIVF(nprobe=nprobe, sel=selector)
        with _omp_threads(threads):
            dist, labels = self._index.search(queries, k, params=search)
            if selector is None and nprobe < self._index.nlist:
                # The probed lists held fewer than k rows (k is at most the row count here): those queries
                # probe every list, so a search answers k rows whenever the split holds k. A filtered search
                # (selector) leaves its short queries to the caller, which scans their matching rows exactly.
                short = np.flatnonzero((labels < 0).any(axis=1))
                if len(short):
                    every = faiss.SearchParametersIVF(nprobe=self._index.nlist)
                    dist[short], labels[short] = self._index.search(queries[short], k, params=every)
        d = dist.astype(np.float64)
        if self.metric is Metric.COSINE:
            d = np.clip(1.0 - d, 0.0, 2.0)  # slots faiss left empty (-1) get +inf below
        elif self.metric is Metric.EUCLIDEAN:
            d = np.sqrt(np.maximum(d, 0.0))
        # Probed lists may hold fewer than k rows: faiss marks those slots -1; give them the worst distance
        # before re-sorting so they stay last, and put equal distances in label order.
        d = np.where(labels >= 0, d, np.inf if self.metric is not Metric.DOT_PRODUCT else -np.inf)
        d, labels = top_k_of(self.metric, d, labels.astype(np.int64), k)
        return d.astype(np.float32), labels

    def search_filtered(
        self, queries: np.ndarray, k: int, allowed: np.ndarray, count: int, params: Mapping[str, int] | None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The k nearest rows among those `allowed` marks (bool per row, `count` true; checked queries): faiss
        skips the other rows while scanning the probed lists. Labels -1 where the probed lists held fewer
        matching rows (the searcher answers those queries exactly); None when there is no index."""
        if self._index is None or k <= 0:
            return None
        faiss = _faiss()
        bits = np.packbits(allowed, bitorder="little")
        # The selector reads `bits` through a raw pointer: `bits` must outlive the search (it does: a local).
        selector = faiss.IDSelectorBitmap(len(allowed), faiss.swig_ptr(bits))
        dist, labels = self._search(queries, min(k, len(self)), 1, params, selector)
        del selector
        return dist, labels

    def _sections(self) -> list[bytes | memoryview]:
        if self._index is None:
            return []
        return [array_section(_faiss().serialize_index(self._index), "u1")]

    @classmethod
    def _load(cls, header: dict[str, Any], sections: list[memoryview], metric: Metric, params: dict[str, Any]) -> Self:
        n, dim = int(header["count"]), int(header["dim"])
        index = None
        if n:
            index = _faiss().deserialize_index(np.frombuffer(sections[0], dtype=np.uint8))
        # The lists are what was built; nprobe is the caller's (a query-time knob).
        effective = {"nlist": header["params"]["nlist"], "nprobe": params["nprobe"]}
        return cls(index, metric, effective, dim, n)
