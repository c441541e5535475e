"""Cosine distances from the approximate engines stay within [0, 2] and match flat's: a stored vector searched for
itself is at distance >= 0 once its segment is built (HNSW reported -4.8e-7 for about half of them, IVF -1.2e-7
for a few), and a vector's opposite at <= 2 (HNSW reported 2.0000005), one query at a time (the single-query
path every server search takes) and in a batch. Through the Python API, on real Postgres and storage, with
the real builder."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from shoal import DataPoint, DataSourceSpec, Shoal
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec
from shoal.searcher.consistency import Consistency

DIM, N = 64, 200
ALGORITHMS = ("flat", "hnsw", "ivf")
# float32 distances of unit vectors: a few 1e-7 apart from flat's float64 ones.
CLOSE = 1e-6


def vectors() -> np.ndarray:
    """200 random 64-d vectors of norms 0.1..100 and their opposites: on this seed, before distances were clipped,
    HNSW put 114 rows below 0 and IVF 2, and HNSW put opposites at 2.0000002."""
    rng = np.random.default_rng(2)
    v = (rng.standard_normal((N, DIM)) * rng.uniform(0.1, 100, (N, 1))).astype(np.float32)
    return np.concatenate([v, -v])


@pytest.fixture
def built(make_shoal: Callable[..., Shoal]) -> tuple[Shoal, np.ndarray]:
    """A tenant with the vectors under cosine flat, HNSW and IVF (every list probed) indexes, each built into a
    segment that holds every row."""
    shoal = make_shoal()
    shoal.create_data_source(DataSourceSpec("pts", "1", DIM, {"id": "int64"}, ["id"]))
    for algorithm in ALGORITHMS:
        shoal.create_index(IndexSpec(algorithm, "1", "pts", "1", algorithm=algorithm, metric="cosine",
                                     params={"nprobe": 1 << 20} if algorithm == "ivf" else {},
                                     id_attributes=["id"]))
    x = vectors()
    shoal.producer("pts", "1").upload([DataPoint({"id": i}, x[i]) for i in range(len(x))])
    builder = ShardBuilder(shoal.engine, shoal.storage)
    for algorithm in ALGORITHMS:
        builder.materialize(shoal.get_index(algorithm, "1").shards[0].id)
    return shoal, x


def test_a_vector_is_at_distance_zero_or_more_from_itself_as_flat_says(built: tuple[Shoal, np.ndarray]) -> None:
    shoal, x = built
    searcher = shoal.searcher(follow=False)
    try:
        ids: dict[str, list[int]] = {}
        dist: dict[str, np.ndarray] = {}
        for algorithm in ALGORITHMS:
            # One query at a time, as a server searches (for HNSW, its single-query path).
            hits = [searcher.search(algorithm, "1", x[i : i + 1], 1, consistency=Consistency.strong())[0]
                    for i in range(len(x))]
            ids[algorithm] = [h.column("id")[0] for h in hits]
            dist[algorithm] = np.array([h.distances[0] for h in hits])
        for algorithm in ALGORITHMS:
            assert ids[algorithm] == list(range(len(x))), algorithm  # each found itself
            assert dist[algorithm].min() >= 0.0, (algorithm, int((dist[algorithm] < 0).sum()))
            assert np.abs(dist[algorithm] - dist["flat"]).max() <= CLOSE, algorithm
        # A batch of queries takes the engines' other path.
        for algorithm in ALGORITHMS:
            hits = searcher.search(algorithm, "1", x, 1, consistency=Consistency.strong())
            assert [h.column("id")[0] for h in hits] == list(range(len(x))), algorithm
            d = np.array([h.distances[0] for h in hits])
            assert d.min() >= 0.0, (algorithm, int((d < 0).sum()))
            assert np.abs(d - dist["flat"]).max() <= CLOSE, algorithm
    finally:
        searcher.close()


def test_every_distance_lies_within_0_and_2_as_flat_says(built: tuple[Shoal, np.ndarray]) -> None:
    shoal, x = built
    searcher = shoal.searcher(follow=False)
    queries = x[:: len(x) // 8]  # a few rows: each one's opposite is at 2, the farthest a cosine distance goes
    k = len(x)
    try:
        answers = {}
        for algorithm in ALGORITHMS:
            single = [searcher.search(algorithm, "1", q[None, :], k, consistency=Consistency.strong())[0]
                      for q in queries]
            batch = searcher.search(algorithm, "1", queries, k, consistency=Consistency.strong())
            answers[algorithm] = (single, batch)
        for algorithm in ALGORITHMS:
            for how, hits in zip(("single", "batch"), answers[algorithm], strict=True):
                for h, flat in zip(hits, answers["flat"][1], strict=True):
                    d = np.array(h.distances)
                    assert 0.0 <= d.min() and d.max() <= 2.0, (algorithm, how, d.min(), d.max())
                    # The same row's distance as flat's (row by row: equal distances may list rows apart).
                    mine = dict(zip(h.column("id"), d, strict=True))
                    theirs = dict(zip(flat.column("id"), flat.distances, strict=True))
                    assert mine.keys() == theirs.keys(), (algorithm, how)
                    assert max(abs(mine[i] - theirs[i]) for i in mine) <= CLOSE, (algorithm, how)
    finally:
        searcher.close()
