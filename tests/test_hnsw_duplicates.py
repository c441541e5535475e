"""HNSW over many copies of one vector (zero vectors, a repeated vector): every row stays reachable.

hnswlib's neighbour pruning keeps one of several identical neighbours, so thousands of copies used to cut the
distinct rows off the graph (with 3,000 zero vectors, none of 30 distinct rows found itself). The engine now
holds each vector once and answers the rows it stands for. No database needed.
"""

from __future__ import annotations

import numpy as np
import pytest

from shoal.engines import Metric, envelope, get_engine
from shoal.engines.hnsw import SEED
from shoal.errors import ValidationError

HNSW = get_engine("hnsw")
DISTINCT = 30
DIM = 8
K = 5
# Copies first (rows 0..copies-1), then the distinct rows: the repro's layout.
CASES = [("zeros", 3_000, "cosine"), ("zeros", 3_000, "euclidean"), ("copies", 2_000, "cosine"),
         ("copies", 2_000, "euclidean")]


def _data(kind: str, copies: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    one = np.zeros(DIM, np.float32) if kind == "zeros" else rng.normal(size=DIM).astype(np.float32)
    return np.vstack([np.tile(one, (copies, 1)), rng.normal(size=(DISTINCT, DIM)).astype(np.float32)])


def _brute(metric: str, q: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Every query's distance to every row, by numpy in float64 (cosine: a zero vector is at distance 1)."""
    q64, x64 = q.astype(np.float64), x.astype(np.float64)
    if metric == "euclidean":
        return np.sqrt(((q64[:, None, :] - x64[None, :, :]) ** 2).sum(axis=2))
    qn, xn = np.linalg.norm(q64, axis=1), np.linalg.norm(x64, axis=1)
    denom = qn[:, None] * xn[None, :]
    return 1.0 - np.divide(q64 @ x64.T, denom, out=np.zeros_like(denom), where=denom > 0)


def _recall(metric: str, q: np.ndarray, x: np.ndarray, labels: np.ndarray) -> float:
    """Recall@k with ties compared by distance: a returned row counts when it is no farther than the k-th."""
    exact = _brute(metric, q, x)
    kth = np.sort(exact, axis=1)[:, labels.shape[1] - 1]
    got = np.take_along_axis(exact, np.maximum(labels, 0), axis=1)
    return float(((got <= kth[:, None] + 1e-5) & (labels >= 0)).mean())


def _assert_rows(labels: np.ndarray, n: int, k: int) -> None:
    """k real row numbers per query, none twice."""
    assert labels.shape[1] == k
    assert ((labels >= 0) & (labels < n)).all()
    for row in labels:
        assert len(set(row.tolist())) == k


@pytest.mark.parametrize(("kind", "copies", "metric"), CASES)
def test_distinct_rows_among_many_copies_find_themselves(kind: str, copies: int, metric: str) -> None:
    """Each stored distinct vector, queried, finds its own row first; recall@5 against brute force is at least
    0.95; results list real rows, copies expanded (k honoured, lowest rows first, none twice)."""
    x = _data(kind, copies)
    n, own = len(x), np.arange(copies, copies + DISTINCT)
    engine = HNSW.build(x, metric, {})  # M 16, ef_construction 200, ef_search 64
    assert len(engine) == n
    d, labels = engine.search(x[own], K)
    assert (labels[:, 0] == own).all()
    assert _recall(metric, x[own], x, labels) >= 0.95
    _assert_rows(labels, n, K)
    # Past every distinct row: the copies' rows fill the rest, as brute force ranks them.
    wide = 100
    d, labels = engine.search(x[own], wide)
    _assert_rows(labels, n, wide)
    np.testing.assert_allclose(d, np.sort(_brute(metric, x[own], x), axis=1)[:, :wide], atol=1e-5)
    if not (kind == "zeros" and metric == "cosine"):  # a zero query is at distance 1 from every row
        d, labels = engine.search(x[:1], 50)
        assert labels[0].tolist() == list(range(50))  # the copies, lowest rows first
    # The single-query paths answer the same.
    d, labels = engine.search(x[own], 10)
    for i, row in enumerate(own):
        got_d, got_l = engine.search_lists(x[row : row + 1], 10)
        assert got_l == [labels[i].tolist()]
        one = engine.search_one(x[row : row + 1], 10)  # cosine: the shortcut; euclidean: declined (None)
        assert one is None or one[1] == labels[i].tolist()


@pytest.mark.parametrize(("kind", "copies", "metric"), CASES)
def test_filtered_search_among_copies_answers_allowed_rows(kind: str, copies: int, metric: str) -> None:
    """A filter allowing half of the copies and every distinct row: only allowed rows come back, the distinct
    ones first for their own vectors, and the copies as their lowest allowed rows."""
    x = _data(kind, copies)
    n, own = len(x), np.arange(copies, copies + DISTINCT)
    engine = HNSW.build(x, metric, {})
    allowed = np.zeros(n, dtype=bool)
    allowed[0:copies:2] = True
    allowed[own] = True
    count = int(allowed.sum())
    for k in (K, 60):
        found = engine.search_filtered(x[own], k, allowed, count, None)
        assert found is not None
        d, labels = found
        _assert_rows(labels, n, k)
        assert allowed[labels].all()
        assert (labels[:, 0] == own).all()
        assert _recall(metric, x[own], x[allowed], np.searchsorted(np.flatnonzero(allowed), labels)) >= 0.95
    if not (kind == "zeros" and metric == "cosine"):
        found = engine.search_filtered(x[:1], 10, allowed, count, None)
        assert found is not None
        assert found[1][0].tolist() == list(range(0, 20, 2))
    # Only distinct rows allowed: the copies' node is not among the answers.
    allowed[:copies] = False
    found = engine.search_filtered(x[own], K, allowed, DISTINCT, None)
    assert found is not None and allowed[found[1]].all() and (found[1][:, 0] == own).all()


@pytest.mark.parametrize(("kind", "copies", "metric"), CASES[:3])
def test_copies_survive_serialization_and_extension(kind: str, copies: int, metric: str) -> None:
    """to_bytes/from_bytes keeps which rows share a vector: identical results. Adding more copies (and more
    distinct rows) to a stored graph keeps every distinct row reachable, under its true row number."""
    x = _data(kind, copies)
    n, own = len(x), np.arange(copies, copies + DISTINCT)
    engine = HNSW.build(x, metric, {})
    loaded = HNSW.from_bytes(engine.to_bytes(), metric, {})
    assert len(loaded) == n
    for k in (1, K, 100):
        for a, b in zip(loaded.search(x[own], k), engine.search(x[own], k), strict=True):
            np.testing.assert_array_equal(a, b)
    allowed = np.arange(n) % 3 != 1
    filtered = [e.search_filtered(x[own], 20, allowed, int(allowed.sum()), None) for e in (loaded, engine)]
    assert filtered[0] is not None and filtered[1] is not None
    for a, b in zip(filtered[0], filtered[1], strict=True):
        np.testing.assert_array_equal(a, b)
    # A malformed row-to-vector map is refused.
    header, sections = envelope.unpack(engine.to_bytes())
    with pytest.raises(ValidationError, match="serialized HNSW graph is malformed"):
        HNSW.from_bytes(envelope.pack({**header, "nodes": header["nodes"] + 1}, list(sections)), metric, {})

    # 2,000 more copies (of the stored vector and of each other) and 20 new distinct rows, two of them twice.
    rng = np.random.default_rng(5)
    new_distinct = rng.normal(size=(20, DIM)).astype(np.float32)
    added = np.vstack([np.tile(x[0], (2_000, 1)), new_distinct, new_distinct[:2]])
    grown = HNSW.extend_bytes(engine.to_bytes(), added, metric, {}, threads=1)
    assert grown is not None and len(grown) == n + len(added)
    both = np.vstack([x, added])
    mine = np.concatenate([own, np.arange(n + 2_000, n + 2_020)])
    d, labels = grown.search(both[mine], K)
    assert (labels[:, 0] == mine).all()
    assert _recall(metric, both[mine], both, labels) >= 0.95
    _assert_rows(labels, len(both), K)
    _, twice = grown.search(new_distinct[:2], 2)
    assert twice.tolist() == [[n + 2_000, n + 2_020], [n + 2_001, n + 2_021]]
    again = HNSW.from_bytes(grown.to_bytes(), metric, {})
    np.testing.assert_array_equal(again.search(both[mine], 100)[1], grown.search(both[mine], 100)[1])


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
def test_copies_added_to_a_graph_without_copies_stay_apart(metric: str) -> None:
    """A graph of distinct rows extended with 3,000 zero vectors and 30 distinct rows: all of them reachable."""
    rng = np.random.default_rng(6)
    base = rng.normal(size=(300, DIM)).astype(np.float32)
    added = _data("zeros", 3_000, seed=7)
    grown = HNSW.extend_bytes(HNSW.build(base, metric, {}).to_bytes(), added, metric, {}, threads=1)
    assert grown is not None
    both = np.vstack([base, added])
    mine = np.concatenate([np.arange(300), np.arange(3_300, 3_330)])
    d, labels = grown.search(both[mine], K)
    assert (labels[:, 0] == mine).all()
    assert _recall(metric, both[mine], both, labels) >= 0.95


@pytest.mark.parametrize("metric", sorted(HNSW.supported_metrics))
def test_without_copies_results_are_hnswlib_own(metric: Metric) -> None:
    """With no two rows alike, the engine answers what a plain hnswlib index of the same parameters and seed
    does (distances converted to Shoal's), through every search path and after a round trip through bytes;
    and a graph stored before node hashes were kept loads to the same answers."""
    import hnswlib

    rng = np.random.default_rng(3)
    x = rng.normal(size=(2_000, 16)).astype(np.float32)
    q = rng.normal(size=(40, 16)).astype(np.float32)
    params = {"M": 16, "ef_construction": 200, "ef_search": 64}
    engine = HNSW.build(x, metric, params, threads=1)
    space = {"cosine": "cosine", "dot_product": "ip", "euclidean": "l2", "l2_squared": "l2"}[metric]
    plain = hnswlib.Index(space=space, dim=16)
    plain.init_index(max_elements=len(x), M=16, ef_construction=200, random_seed=SEED)
    plain.add_items(x, np.arange(len(x)), num_threads=1)
    plain.set_ef(64)
    labels, dist = plain.knn_query(q, k=10, num_threads=1)
    if metric == "dot_product":
        dist = np.float32(1.0) - dist
    elif metric == "euclidean":
        dist = np.sqrt(dist)
    loaded = HNSW.from_bytes(engine.to_bytes(), metric, params)
    header, sections = envelope.unpack(engine.to_bytes())
    if header.pop("hashes", False):  # as graphs were stored before: the graph's sections only
        sections = sections[:-1]
    earlier = HNSW.from_bytes(envelope.pack(header, list(sections)), metric, params)
    for e in (engine, loaded, earlier):
        d, lab = e.search(q, 10)
        np.testing.assert_array_equal(lab, labels.astype(np.int64))
        np.testing.assert_array_equal(d, dist)
        for i in range(len(q)):
            assert e.search_lists(q[i : i + 1], 10)[1] == [labels[i].tolist()]
            one = e.search_one(q[i : i + 1], 10)
            assert one is None or one[1] == labels[i].tolist()
    allowed = np.ones(len(x), dtype=bool)
    found = engine.search_filtered(q, 10, allowed, len(x), None)
    assert found is not None
    np.testing.assert_array_equal(found[1], labels.astype(np.int64))
