"""An exactness oracle that does not share the code under test's way of summing."""

from __future__ import annotations

import numpy as np

from shoal.engines.metrics import Metric, from_products, top_k_of


def summed_in_one_order(
    metric: Metric, queries: np.ndarray, vectors: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The exact top k (float64 distances, rows; ties by the lower row, -1 pads) with every row's float64
    product summed the same way (numpy's einsum loop, never BLAS, which may sum two identical rows one rounding
    step apart by where they sit and so order exact duplicates by position). Not for manhattan."""
    q, v = queries.astype(np.float64), vectors.astype(np.float64)
    dist = from_products(metric, np.einsum("ij,kj->ik", q, v), np.einsum("ij,ij->i", q, q)[:, None],
                         np.einsum("ij,ij->i", v, v)[None, :])
    return top_k_of(metric, dist, np.broadcast_to(np.arange(len(v), dtype=np.int64), dist.shape), k)
