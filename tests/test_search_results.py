"""Search results (`Hits`) and per-search parameters (ef_search, nprobe), against a real catalog and real builds."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from shoal import DataSourceSpec, Shoal
from shoal.engines.metrics import Metric, exact_top_k
from shoal.errors import ValidationError
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec
from shoal.searcher.execute import Hit, Hits
from shoal.searcher.searcher import Searcher

DIM, N, K = 16, 2000, 10
SOURCE = DataSourceSpec("Points", "1", DIM, {"id": "int64", "label": "string"}, ["id"])


@pytest.fixture
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    return rng.standard_normal((N, DIM)).astype(np.float32), rng.standard_normal((40, DIM)).astype(np.float32)


@pytest.fixture
def shoal(make_settings, data) -> Iterator[Shoal]:  # type: ignore[no-untyped-def]
    client = Shoal(make_settings("local"), notify=False)
    client.create_data_source(SOURCE)
    vectors, _ = data
    client.producer("Points", "1").upload_columns(
        vectors[: N // 2], {"id": np.arange(N // 2), "label": [f"p{i}" for i in range(N // 2)]}
    )
    yield client
    client.close()


def _index(shoal: Shoal, name: str, algorithm: str, params: dict[str, int] | None = None) -> None:
    shoal.create_index(
        IndexSpec(name, "1", "Points", "1", algorithm=algorithm, metric="l2_squared", params=params or {})
    )
    ShardBuilder(shoal.engine, shoal.storage).materialize(shoal.get_index(name, "1").shards[0].id)


def _second_half(shoal: Shoal, vectors: np.ndarray) -> None:
    shoal.producer("Points", "1").upload_columns(
        vectors[N // 2 :], {"id": np.arange(N // 2, N), "label": [f"p{i}" for i in range(N // 2, N)]}
    )


def _recall(results: list[Hits], truth: np.ndarray) -> float:
    return float(np.mean([len(set(h.column("id")) & set(t.tolist())) / K for h, t in zip(results, truth, strict=True)]))


@pytest.mark.parametrize("segments", [1, 2])
def test_hits_read_columns_and_compare_like_lists(shoal: Shoal, data: tuple[np.ndarray, np.ndarray],
                                                   segments: int) -> None:
    vectors, queries = data
    _index(shoal, "Flat", "flat")
    n = N // 2
    if segments == 2:  # a second segment: results are merged across two engines
        _second_half(shoal, vectors)
        ShardBuilder(shoal.engine, shoal.storage).materialize(shoal.get_index("Flat", "1").shards[0].id)
        n = N
    searcher = shoal.searcher(follow=False)
    try:
        results = searcher.search("Flat", "1", queries, K, retrieve_vectors=True)
    finally:
        searcher.close()
    dist, labels = exact_top_k(Metric.L2_SQUARED, queries, vectors[:n], K)
    assert len(results) == len(queries)
    for hits, d, lab in zip(results, dist, labels, strict=True):
        assert isinstance(hits, Hits) and len(hits) == K
        # Columns and distances read without making Hit objects, and agree with brute force.
        assert hits.column("id") == lab.tolist()
        assert hits.column("label") == [f"p{i}" for i in lab.tolist()]
        np.testing.assert_allclose(hits.distances, d, rtol=1e-4, atol=1e-4)
        # The Hit objects, made on first read, carry the same.
        expected = [
            Hit({"id": int(i), "label": f"p{i}"}, hits.distances[j], vectors[i].tolist()) for j, i in enumerate(lab)
        ]
        assert [h.attributes for h in hits] == [e.attributes for e in expected]
        np.testing.assert_allclose([h.vector for h in hits], vectors[lab], rtol=1e-6)
        assert hits[0] == list(hits)[0] and hits[1:3] == list(hits)[1:3]
        # Equal to a list of the same hits either way round, and pickled as that list.
        assert hits == list(hits) and list(hits) == hits
        assert pickle.loads(pickle.dumps(hits)) == list(hits)
        with pytest.raises(KeyError, match="'vector'.*carry id, label"):
            hits.column("vector")
    assert results[0] != results[1]


def test_an_empty_index_returns_empty_hits(shoal: Shoal, data: tuple[np.ndarray, np.ndarray]) -> None:
    shoal.create_index(IndexSpec("Empty", "1", "Points", "1", algorithm="hnsw"))  # never materialized
    searcher = shoal.searcher(follow=False)
    try:
        results = searcher.search("Empty", "1", data[1][:2], K)
    finally:
        searcher.close()
    assert results == [[], []] and results[0].column("id") == [] and results[0].distances == []


def test_search_params_override_ef_search_and_nprobe_per_search(
    shoal: Shoal, data: tuple[np.ndarray, np.ndarray]
) -> None:
    vectors, queries = data
    _index(shoal, "Hnsw", "hnsw", {"M": 8, "ef_construction": 40, "ef_search": 10})
    _index(shoal, "Ivf", "ivf", {"nlist": 32, "nprobe": 1})
    _, truth = exact_top_k(Metric.L2_SQUARED, queries, vectors[: N // 2], K)
    searcher = shoal.searcher(follow=False)
    try:
        # IVF probing every list is exhaustive: exactly brute force. Its own nprobe=1 is not.
        assert _recall(searcher.search("Ivf", "1", queries, K, search_params={"nprobe": 32}), truth) == 1.0
        assert _recall(searcher.search("Ivf", "1", queries, K), truth) < 0.9
        # HNSW with an ef_search as large as the index finds (nearly) everything; its own ef_search of 10
        # misses more.
        default = searcher.search("Hnsw", "1", queries, K)
        wide = searcher.search("Hnsw", "1", queries, K, search_params={"ef_search": N // 2})
        assert _recall(wide, truth) >= 0.98 > _recall(default, truth) + 0.02
        # The override holds for that search only.
        assert searcher.search("Hnsw", "1", queries, K) == default
        # Concurrent searches with different ef_search each get their own (hnswlib keeps ef on the index).
        def one(i: int) -> bool:
            params = {"ef_search": N // 2} if i % 2 else None
            got = searcher.search("Hnsw", "1", queries[i % 40 : i % 40 + 1], K, search_params=params)[0]
            return got == (wide if i % 2 else default)[i % 40]

        with ThreadPoolExecutor(4) as pool:
            assert all(pool.map(one, range(400)))
    finally:
        searcher.close()


@pytest.mark.parametrize(
    ("index", "params", "message"),
    [
        ("Hnsw", {"ef_search": 0}, r"'ef_search' must be an integer in 1\.\.65536 \(got 0\)"),
        ("Hnsw", {"ef_search": "64"}, r"'ef_search' must be an integer"),
        ("Hnsw", {"ef_search": True}, r"'ef_search' must be an integer"),
        ("Hnsw", {"nprobe": 4}, r"algorithm 'hnsw' takes no search parameter\(s\) 'nprobe' \(accepted: ef_search\)"),
        ("Ivf", {"nprobe": -1}, r"'nprobe' must be an integer"),
        ("Flat", {"ef_search": 64}, r"algorithm 'flat' takes no search parameter\(s\) 'ef_search' \(accepted: none\)"),
    ],
)
def test_bad_search_params_are_refused(shoal: Shoal, data: tuple[np.ndarray, np.ndarray], index: str,
                                       params: dict[str, object], message: str) -> None:
    _index(shoal, index, index.lower())
    searcher: Searcher = shoal.searcher(follow=False)
    try:
        with pytest.raises(ValidationError, match=message):
            searcher.search(index, "1", data[1][:1], K, search_params=params)  # type: ignore[arg-type]
    finally:
        searcher.close()


@pytest.mark.parametrize("metric", ["l2_squared", "cosine", "dot_product", "euclidean"])
def test_nan_and_inf_queries_are_refused_by_every_path(shoal: Shoal, data: tuple[np.ndarray, np.ndarray],
                                                       metric: str) -> None:
    """NaN or inf anywhere in a query is refused, whether one float32 query (the fast path of an index of one
    HNSW engine), a batch or lists; large finite coordinates are not, up to the norm bound."""
    shoal.create_index(IndexSpec("Hnsw", "1", "Points", "1", algorithm="hnsw", metric=metric))
    ShardBuilder(shoal.engine, shoal.storage).materialize(shoal.get_index("Hnsw", "1").shards[0].id)
    queries = data[1][:3].copy()
    searcher = shoal.searcher(follow=False)
    try:
        for bad in (np.nan, np.inf, -np.inf):
            for row, col in ((0, 0), (0, DIM - 1), (2, 5)):
                q = queries.copy()
                q[row, col] = bad
                for attempt in (q[row : row + 1], q, q[row : row + 1].tolist()):
                    with pytest.raises(ValidationError, match="query coordinates must be finite"):
                        searcher.search("Hnsw", "1", attempt, K)
        # Large finite coordinates are fine up to the norm bound (distances stay finite in float32); past it
        # the query is refused by name, as a stored vector is (such distances overflowed and ranked wrongly).
        from shoal.log.validation import MAX_NORM

        long = np.full((1, DIM), 0.99 * MAX_NORM / np.sqrt(DIM), dtype=np.float32)
        assert len(searcher.search("Hnsw", "1", long, K)[0]) == K
        huge = np.full((1, DIM), 3e37, dtype=np.float32)
        for attempt in (huge, np.concatenate([queries, huge]), huge.tolist()):
            with pytest.raises(ValidationError, match="query vector norm .* is past the largest allowed"):
                searcher.search("Hnsw", "1", attempt, K)
        # Finite numbers past float32's range (float64 arrays, lists) are named, with no overflow warning; a
        # float64 array passed unchecked before and was searched as infinity.
        wide = queries.astype(np.float64)
        wide[1, 4] = -1e39
        for attempt in (wide, wide.tolist()):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with pytest.raises(ValidationError, match=r"point 1, attribute 'queryVectors': query coordinates "
                                   r"must be finite float32 values: -1e\+39 at index 4 is past float32's range"):
                    searcher.search("Hnsw", "1", attempt, K)
    finally:
        searcher.close()
