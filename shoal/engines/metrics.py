"""The distance metrics and the exact brute-force reference every engine is measured against.

Each metric has one distance definition shared by all engines, so results of several segments and engines
can be k-way merged: cosine is 1 - cosine similarity (a zero vector has distance 1.0 to everything),
euclidean is the L2 distance, manhattan the L1 distance, l2_squared the squared L2 distance (all: smaller is
nearer), and dot_product is the inner product itself (larger is nearer).
"""

from __future__ import annotations

from enum import StrEnum

import numpy as np

from shoal.engines.sparse import SparseRows
from shoal.errors import ValidationError

# Bytes of float64 scratch one manhattan block may use in the reference (which broadcasts q x rows x dim).
_L1_BLOCK_BYTES = 64 << 20


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

    L2 uses |q|^2 + |v|^2 - 2 q.v: in float64 its error is ~1e-16 of the norms, far below the float32
    resolution of the inputs, and it lets the products come from one matrix multiplication.
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


def _dense_l1(queries: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    out = np.empty((len(queries), len(vectors)), dtype=np.float64)
    dim = max(vectors.shape[1], 1)
    rows = max(1, _L1_BLOCK_BYTES // (8 * dim * max(len(queries), 1)))
    for start in range(0, len(vectors), rows):
        block = vectors[start : start + rows]
        out[:, start : start + len(block)] = np.abs(queries[:, None, :] - block[None, :, :]).sum(axis=2)
    return out


def _dense_distances(metric: Metric, queries: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    q = np.asarray(queries, dtype=np.float64)
    v = np.asarray(vectors, dtype=np.float64)
    if q.ndim != 2 or v.ndim != 2 or q.shape[1] != v.shape[1]:
        raise ValidationError(f"queries {q.shape} and vectors {v.shape} must be 2-d with equal dimension")
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


def exact_top_k(
    metric: Metric | str, queries: np.ndarray | SparseRows, vectors: np.ndarray | SparseRows, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """The exact k nearest vectors of each query: (distances float64 [q, k], labels int64 [q, k]).

    Labels are row positions; nearest first, ties broken by the lower label; padded with label -1 and
    distance +inf (-inf for dot_product) when there are fewer than k vectors.
    """
    metric = as_metric(metric)
    dist = exact_distances(metric, queries, vectors)
    labels = np.broadcast_to(np.arange(dist.shape[1], dtype=np.int64), dist.shape)
    return top_k_of(metric, dist, labels, k)
