"""The norm bound (MAX_NORM) leaves float32 room for the distances hnswlib and faiss compute, and every write and
query path accepts exactly the same vectors under it (one float64 check)."""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import pytest

from shoal import DataPoint, DataSourceSpec, Shoal
from shoal.engines.base import get_engine
from shoal.errors import ValidationError
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec
from shoal.log.validation import MAX_NORM, MAX_SQ_NORM, vector_problem
from shoal.searcher.consistency import Consistency

DIM = 16


def _largest_accepted(direction: np.ndarray) -> np.ndarray:
    """The float32 vector along `direction` of (about) the largest norm the bound accepts."""
    v = (direction / np.linalg.norm(direction) * MAX_NORM).astype(np.float32)
    while vector_problem(v, v) is not None:
        v = np.nextafter(v, np.float32(0))  # every coordinate one float32 step nearer zero
    return v


def _just_past_a_float32_check() -> np.ndarray:
    """A float32 vector whose norm (summed in float64) is past MAX_NORM by a few parts in 1e8, while its squares
    summed in float32 come to at most the float32-rounded bound: a float32 check lets it through."""
    rng = np.random.default_rng(3)
    bound32 = np.float32(MAX_SQ_NORM)
    for _ in range(2000):
        u = rng.standard_normal(DIM)
        for excess in (1e-8, 3e-8, 6e-8):
            v = (u / np.linalg.norm(u) * MAX_NORM * (1 + excess)).astype(np.float32)
            wide = v.astype(np.float64)
            if wide @ wide > MAX_SQ_NORM and np.einsum("ij,ij->i", v[None], v[None])[0] <= bound32:
                return v
    raise AssertionError("no such vector found")


def _build(shoal: Shoal, name: str) -> None:
    builder = ShardBuilder(shoal.engine, shoal.storage)
    for shard in shoal.get_index(name, "1").shards:
        builder.materialize(shard.id)


def test_antipodal_vectors_at_the_norm_bound_get_finite_distances_and_k_results(
    make_shoal: Callable[..., Shoal],
) -> None:
    """Two opposite vectors of the largest norm the bound accepts are 2 x MAX_NORM apart: every engine answers
    both, at a finite distance (at sqrt(float32 max) / 2, faiss dropped the far one and hnswlib answered inf)."""
    shoal = make_shoal()
    spec = DataSourceSpec("Antipodes", "1", DIM, {"id": "int64"}, ["id"])
    shoal.create_data_source(spec)
    v = _largest_accepted(np.random.default_rng(28).standard_normal(DIM))
    shoal.producer(spec.name, spec.version).upload([DataPoint({"id": 1}, v.tolist()),
                                                    DataPoint({"id": 2}, (-v).tolist())])
    far = 2 * float(np.linalg.norm(v.astype(np.float64)))
    cases = [("flat", "l2_squared"), ("hnsw", "euclidean"), ("hnsw", "l2_squared"), ("ivf", "euclidean"),
             ("ivf", "l2_squared")]
    for algorithm, metric in cases:
        name = f"Antipodes.{algorithm}.{metric}"
        shoal.create_index(IndexSpec(name, "1", spec.name, spec.version, algorithm=algorithm, metric=metric))
        _build(shoal, name)
    searcher = shoal.searcher(follow=False)
    try:
        for algorithm, metric in cases:
            name = f"Antipodes.{algorithm}.{metric}"
            want = far if metric == "euclidean" else far * far
            for q, order in ((v, [1, 2]), (-v, [2, 1])):
                hits = searcher.search(name, "1", q[None, :], 2)[0]
                assert [h.attributes["id"] for h in hits] == order, (name, list(hits))
                assert hits[0].distance == 0.0
                assert np.isfinite(hits[1].distance) and hits[1].distance == pytest.approx(want, rel=1e-6), (
                    name, hits[1].distance)
    finally:
        searcher.close()


def test_every_path_refuses_a_vector_just_past_the_bound_and_takes_the_largest_within_it(
    make_shoal: Callable[..., Shoal],
) -> None:
    """One float64 check everywhere: a vector a few float32 steps past MAX_NORM is refused by upload,
    upload_columns and as a query (list or float32 array), and the message tells its norm from the bound; the
    largest vector within the bound is taken by all four."""
    shoal = make_shoal()
    spec = DataSourceSpec("Edge", "1", DIM, {"id": "int64"}, ["id"])
    shoal.create_data_source(spec)
    shoal.create_index(IndexSpec("Edge.Flat", "1", spec.name, spec.version, algorithm="flat", metric="euclidean"))
    producer = shoal.producer(spec.name, spec.version)
    past = _just_past_a_float32_check()
    within = _largest_accepted(past.astype(np.float64))

    refusals = []
    for attempt in (lambda: producer.upload([DataPoint({"id": 1}, past.tolist())]),
                    lambda: producer.upload_columns(past[None, :], {"id": [2]})):
        with pytest.raises(ValidationError, match="vector norm") as err:
            attempt()
        refusals.append(str(err.value))
    producer.upload([DataPoint({"id": 3}, within.tolist())])
    producer.upload_columns(within[None, :], {"id": [4]})
    _build(shoal, "Edge.Flat")
    searcher = shoal.searcher(follow=False)
    try:
        for query in (past.tolist(), past[None, :].copy()):
            with pytest.raises(ValidationError, match="query vector norm") as err:
                searcher.search("Edge.Flat", "1", query, 2)
            refusals.append(str(err.value))
        for query in (within.tolist(), within[None, :].copy()):
            hits = searcher.search("Edge.Flat", "1", query, 2)[0]
            assert sorted(h.attributes["id"] for h in hits) == [3, 4] and [h.distance for h in hits] == [0.0, 0.0]
    finally:
        searcher.close()
    for message in refusals:
        found = re.search(r"vector norm (\S+) is past the largest allowed, ([^:]+):", message)
        assert found, message
        assert float(found[1]) > float(found[2]), message  # enough digits to tell them apart


def test_an_ivf_build_takes_vectors_stored_under_the_former_bound() -> None:
    """Rows stored before the bound became MAX_NORM (norms up to sqrt(float32 max) / 2) stay buildable: a merge or
    reindex over them must not fail; only rows past the former bound (never stored) are refused."""
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((200, 4)).astype(np.float32)
    rows[7] = np.array([9e18, 0, 0, 0], dtype=np.float32)  # between the bound and the former one
    assert vector_problem(rows[7], rows[7]) is not None  # past today's bound
    engine = get_engine("ivf").build(rows, "euclidean", {"nlist": 8, "nprobe": 8})
    dist, labels = engine.search(rows[7][None, :], 1)
    assert labels[0, 0] == 7 and dist[0, 0] == 0.0


@pytest.mark.parametrize("metric", ["euclidean", "dot_product"])
def test_distances_equal_in_float32_in_two_blocks_rank_by_float64(
    make_shoal: Callable[..., Shoal], metric: str
) -> None:
    """Exact answers are ranked in float64 wherever the rows sit: A = (1, 0) and B = (0.99999994, 0.0003) are
    both 1.0 from the origin in float32, and B is nearer in float64 (|B| = 0.99999998535); with the query
    (1, 0.00021) both products are 1.0 in float32 and B's is larger in float64 (1.0000000034). With A in a
    segment and B in the log tail, in two segments, or all in one, B comes first (it was A while they sat
    apart)."""
    shoal = make_shoal()
    spec = DataSourceSpec("Ties", "1", 2, {"id": "int64"}, ["id"])
    shoal.create_data_source(spec)
    shoal.create_index(IndexSpec("Ties.Flat", "1", spec.name, spec.version, algorithm="flat", metric=metric))
    producer = shoal.producer(spec.name, spec.version)
    a, b = [1.0, 0.0], [0.99999994, 0.0003]
    query = [[0.0, 0.0]] if metric == "euclidean" else [[1.0, 2.1e-4]]
    builder = ShardBuilder(shoal.engine, shoal.storage)
    shard = shoal.get_index("Ties.Flat", "1").shards[0].id
    searcher = shoal.searcher(follow=False)
    try:
        def first(consistency: Consistency) -> int:
            searcher.refresh()
            return searcher.search("Ties.Flat", "1", query, 1, consistency=consistency)[0][0].attributes["id"]

        producer.upload([DataPoint({"id": 1}, a)])
        builder.materialize(shard)
        producer.upload([DataPoint({"id": 2}, b)])
        assert first(Consistency.strong()) == 2  # A in a segment, B in the log tail
        builder.materialize(shard)
        assert first(Consistency.eventual()) == 2  # two segments
        builder.merge(shard, force=True)
        assert first(Consistency.eventual()) == 2  # one segment
    finally:
        searcher.close()
