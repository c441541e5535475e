"""Exact indexes keep small distances beside large norms.

|q|^2 + |v|^2 - 2 q.v (the L2 metrics) and |q|_1 plus per-row corrections (sparse manhattan) err by about 1e-16 of
the norms, not of the distance: beside a coordinate of 1e12 (1e18 for L1) a distance of a few thousand came out 0
or noise, so `flat` and `flat_sparse` answered neither the right rows nor the right distances. The reference here
sums the coordinate differences directly in float64 (exactly, for these integer coordinates), as the README's
"brute force over the log state" does, rather than the product formula the other tests' references share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from shoal import DataPoint, DataSourceSpec, Shoal, SparseVector
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec
from shoal.searcher.consistency import Consistency

DIM = 4
NEAR = 24  # rows sharing the large coordinate with the queries; the rest lie a large norm away
ROWS = 1_500  # past the flat engine's small-engine path (1,024 rows): its float32 pass chooses candidates
K = 10
# Norms at which the product formulas lose distances of a few thousand: 1e12 squared is 1e24 (one float64 step
# there is 1.3e8); an L1 norm of 1e18 is 128 per step. Both are within the documented bound (about 6.5e18).
LARGE = {"euclidean": 1e12, "l2_squared": 1e12, "manhattan": 1e18}


def _vectors(metric: str) -> np.ndarray:
    """float32 rows: NEAR of them [X, a, b, c], the others [0, a, b, c], with integer a, b, c."""
    rng = np.random.default_rng(7)
    out = np.zeros((ROWS, DIM), dtype=np.float32)
    out[:, 1:] = rng.integers(-3_000, 3_000, (ROWS, DIM - 1))
    out[:NEAR, 0] = LARGE[metric]
    return out


def _direct(metric: str, query: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """Each row's distance to the query from its coordinate differences, summed in float64."""
    diff = vectors.astype(np.float64) - query.astype(np.float64)
    if metric == "manhattan":
        return np.abs(diff).sum(axis=1)
    sq = (diff * diff).sum(axis=1)
    return np.sqrt(sq) if metric == "euclidean" else sq


def _as_point(vector: np.ndarray, sparse: bool) -> Any:
    if not sparse:
        return vector.tolist()
    nz = np.flatnonzero(vector)
    return SparseVector(nz.tolist(), vector[nz].tolist())


@pytest.mark.parametrize("algorithm", ["flat", "flat_sparse"])
@pytest.mark.parametrize("metric", ["euclidean", "l2_squared", "manhattan"])
def test_exact_indexes_rank_small_distances_beside_large_norms(
    make_shoal: Callable[..., Shoal], algorithm: str, metric: str
) -> None:
    shoal = make_shoal()
    sparse = algorithm == "flat_sparse"
    shoal.create_data_source(DataSourceSpec("big", "1", DIM, {"id": "int64", "grp": "int64"}, ["id"],
                                            vectors_are_sparse=sparse))
    shoal.create_index(IndexSpec("big", "1", "big", "1", algorithm=algorithm, metric=metric, id_attributes=["id"]))
    vectors = _vectors(metric)
    shoal.producer("big", "1").upload(
        [DataPoint({"id": i, "grp": i % 2}, _as_point(v, sparse)) for i, v in enumerate(vectors)])
    # A stored row (distance 0 to itself) and a point among the near rows that is none of them.
    queries = [vectors[3], np.array([LARGE[metric], 17.0, -250.0, 1_234.0], dtype=np.float32)]
    searcher = shoal.searcher(follow=False)

    def check(stage: str) -> None:
        # As a following searcher does on a new head: serve the newest version, extend the young tier to the head.
        searcher.search("big", "1", [_as_point(queries[0], sparse)], 1, consistency=Consistency.strong())
        searcher.refresh()
        searcher.service.follow_heads()
        for consistency in (Consistency.eventual(), Consistency.strong()):
            for filters, rows in ((None, np.arange(ROWS)), ({"grp": 1}, np.arange(1, ROWS, 2))):
                for query in queries:
                    want = _direct(metric, query, vectors[rows])
                    order = np.argsort(want, kind="stable")[:K]
                    # The data leaves no ties among the k nearest (and the next), so the answer is one list.
                    assert (np.diff(np.sort(want)[: K + 1]) > 0).all()
                    hits = searcher.search("big", "1", [_as_point(query, sparse)], K, consistency=consistency,
                                           filters=filters)[0]
                    where = f"{stage}, {consistency}, filters {filters}, query {query.tolist()}"
                    assert [h.attributes["id"] for h in hits] == rows[order].tolist(), where
                    np.testing.assert_allclose([h.distance for h in hits], want[order], rtol=1e-6, err_msg=where)

    check("log only")  # eventual: the young tier; strong: the exact scan of the log tail
    builder = ShardBuilder(shoal.engine, shoal.storage)
    for shard in shoal.get_index("big", "1").shards:
        builder.materialize(shard.id)
    check("built")  # the segments' engines (and their filtered scans)
