"""kNN engines: exactness of flat, recall of hnsw and ivf, validation, serialization and edge cases.

No database needed. Real data: the debian-packages sentence embeddings (float16, L2-normalised, 384-d).
"""

from __future__ import annotations

import threading
import warnings
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from conftest import SHARED_DATA
from helpers.summed import summed_in_one_order
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.engines import (
    ENGINES,
    Engine,
    Metric,
    SparseRows,
    exact_distances,
    exact_top_k,
    from_vektonn,
    get_engine,
    higher_is_nearer,
)
from shoal.engines.flat import search_together
from shoal.engines.metrics import top_k_of
from shoal.errors import ValidationError

DATA = SHARED_DATA
DENSE = ("flat", "hnsw", "ivf")
ALL = tuple((alg, m) for alg in sorted(ENGINES) for m in sorted(ENGINES[alg].supported_metrics))
ALL_DENSE = tuple((alg, m) for alg, m in ALL if not ENGINES[alg].sparse)
K = 10
IVF_NPROBE = 32  # of the default nlist = round(4 * sqrt(10,000)) = 400 lists
HNSW_ROWS = IVF_ROWS = 10_000  # of the real data; flat uses 20,000 (HNSW/IVF builds dominate test time)


# ---- helpers -------------------------------------------------------------------------------------------


@cache
def real() -> tuple[np.ndarray, np.ndarray]:
    assert (DATA / "base_f16.npy").exists(), f"real data missing at {DATA} (../shared, or set SHOAL_SHARED_DATA)"
    base = np.load(DATA / "base_f16.npy", mmap_mode="r")[:20_000].astype(np.float32)
    queries = np.load(DATA / "queries_f16.npy")[:200].astype(np.float32)
    return base, queries


@cache
def real_exact(metric: Metric, rows: int, queries: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Full float64 distance matrix and exact top K for a prefix of the real data."""
    base, q = real()
    full = exact_distances(metric, q[:queries], base[:rows])
    labels = np.broadcast_to(np.arange(rows), full.shape)
    d, lab = top_k_of(metric, full, labels, K)
    return full, d, lab


def random_dense(n: int, d: int, q: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    # A few clusters, so ANN engines see structure like real embeddings have.
    centers = rng.standard_normal((8, d)) * 3
    x = centers[rng.integers(0, 8, n)] + rng.standard_normal((n, d))
    qs = centers[rng.integers(0, 8, q)] + rng.standard_normal((q, d))
    return x.astype(np.float32), qs.astype(np.float32)


def random_sparse(n: int, dim: int, density: float, seed: int = 0) -> SparseRows:
    rng = np.random.default_rng(seed)
    dense = np.where(rng.random((n, dim)) < density, rng.standard_normal((n, dim)), 0.0)
    return SparseRows.from_dense(dense.astype(np.float32))


def assert_exact(
    metric: Metric, full: np.ndarray, d: np.ndarray, lab: np.ndarray, ed: np.ndarray, el: np.ndarray
) -> None:
    """Results equal the exact top k: same distances (float32 rounding), labels equal except genuine ties."""
    scale = max(1.0, float(np.abs(ed[np.isfinite(ed)]).max(initial=0.0)))
    tol = dict(rtol=1e-5, atol=1e-6 * scale)
    np.testing.assert_allclose(d, ed, **tol)
    real_rows = lab >= 0
    np.testing.assert_array_equal(real_rows, el >= 0)
    rows = np.nonzero(real_rows)[0]
    # Every returned label really is at the distance reported for it, so a differing label is a tie.
    np.testing.assert_allclose(d[real_rows], full[rows, lab[real_rows]], **tol)
    for row in lab:
        got = row[row >= 0]
        assert len(set(got.tolist())) == len(got), "a label is returned twice"
    assert (lab == el).mean() > 0.95


def exhaustive(algorithm: str) -> dict[str, int]:
    """Params that make IVF probe every list of a small test index (other engines: defaults)."""
    return {"nprobe": 4096} if algorithm == "ivf" else {}


def recall(lab: np.ndarray, el: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(lab.tolist(), el.tolist(), strict=True)]))


def assert_true_distances(full: np.ndarray, d: np.ndarray, lab: np.ndarray) -> None:
    """ANN results report each label's distance in the metric's own definition (float32 accuracy)."""
    ok = lab >= 0
    rows = np.nonzero(ok)[0]
    np.testing.assert_allclose(d[ok], full[rows, lab[ok]], rtol=1e-4, atol=1e-5)


# ---- exactness and recall on real data ----------------------------------------------------------------


@pytest.mark.parametrize("metric", list(Metric))
def test_flat_equals_exact_on_real_data(metric: Metric) -> None:
    base, queries = real()
    # Manhattan has no BLAS shortcut (neither here nor in the reference): a smaller slice keeps it quick.
    rows, nq = (3_000, 50) if metric is Metric.MANHATTAN else (20_000, 200)
    full, ed, el = real_exact(metric, rows, nq)
    d, lab = get_engine("flat").build(base[:rows], metric, {}).search(queries[:nq], K)
    assert d.dtype == np.float32 and lab.dtype == np.int64
    assert_exact(metric, full, d, lab, ed, el)


@pytest.mark.slow
@pytest.mark.parametrize("metric", sorted(get_engine("hnsw").supported_metrics))
def test_hnsw_recall_on_real_data(metric: Metric) -> None:
    base, queries = real()
    full, _, el = real_exact(metric, HNSW_ROWS, len(queries))
    engine = get_engine("hnsw").build(base[:HNSW_ROWS], metric, {})
    d, lab = engine.search(queries, K)
    assert recall(lab, el) >= 0.95
    assert_true_distances(full, d, lab)


@pytest.mark.slow
@pytest.mark.parametrize("metric", sorted(get_engine("ivf").supported_metrics))
def test_ivf_recall_on_real_data(metric: Metric) -> None:
    base, queries = real()
    full, _, el = real_exact(metric, IVF_ROWS, len(queries))
    engine = get_engine("ivf").build(base[:IVF_ROWS], metric, {"nprobe": IVF_NPROBE})
    assert engine.params == {"nlist": 400, "nprobe": IVF_NPROBE}
    d, lab = engine.search(queries, K)
    assert recall(lab, el) >= 0.9
    assert_true_distances(full, d, lab)


# ---- exactness and recall on random data --------------------------------------------------------------


@pytest.mark.parametrize(("algorithm", "metric"), ALL_DENSE)
def test_dense_engines_on_random_data(algorithm: str, metric: Metric) -> None:
    x, q = random_dense(2_000, 24, 40, seed=1)
    full = exact_distances(metric, q, x)
    ed, el = exact_top_k(metric, q, x, K)
    # nprobe = nlist makes IVF exhaustive: it must then find the exact answer (up to float32 ties).
    params = {"nlist": 32, "nprobe": 32} if algorithm == "ivf" else {}
    d, lab = get_engine(algorithm).build(x, metric, params).search(q, K)
    if algorithm == "hnsw":
        assert recall(lab, el) >= 0.95
        assert_true_distances(full, d, lab)
    else:
        assert_exact(metric, full, d, lab, ed, el)


@pytest.mark.parametrize("metric", list(Metric))
def test_flat_sparse_equals_exact(metric: Metric) -> None:
    rows = random_sparse(400, 60, 0.08, seed=2)  # some rows are empty at this density
    queries = random_sparse(25, 60, 0.2, seed=3)
    assert (np.diff(rows.indptr) == 0).any()
    full = exact_distances(metric, queries, rows)
    ed, el = exact_top_k(metric, queries, rows, K)
    d, lab = get_engine("flat_sparse").build(rows, metric, {}).search(queries, K)
    assert_exact(metric, full, d, lab, ed, el)
    # The sparse reference agrees with the dense one.
    dense_d, dense_l = exact_top_k(metric, queries.to_dense(), rows.to_dense(), K)
    np.testing.assert_allclose(ed, dense_d, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(el, dense_l)


small_int_matrix = st.integers(1, 6).flatmap(
    lambda d: st.tuples(
        st.lists(st.lists(st.integers(-3, 3), min_size=d, max_size=d), min_size=0, max_size=40),
        st.lists(st.lists(st.integers(-3, 3), min_size=d, max_size=d), min_size=1, max_size=4),
    )
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=small_int_matrix, metric=st.sampled_from(list(Metric)), k=st.integers(1, 12))
def test_flat_property_equals_exact_top_k(
    data: tuple[list[list[int]], list[list[int]]], metric: Metric, k: int
) -> None:
    """Small integer coordinates make every product exact, so even ties must resolve identically."""
    rows, qs = data
    d = len(qs[0])
    x = np.array(rows, dtype=np.float32).reshape(len(rows), d)
    q = np.array(qs, dtype=np.float32)
    ed, el = exact_top_k(metric, q, x, k)
    for algorithm, vectors, queries in (
        ("flat", x, q),
        ("flat_sparse", SparseRows.from_dense(x), SparseRows.from_dense(q)),
    ):
        got_d, got_l = get_engine(algorithm).build(vectors, metric, {}).search(queries, k)
        np.testing.assert_array_equal(got_l, el)
        np.testing.assert_array_equal(got_d, ed.astype(np.float32))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_exact_duplicates_come_in_row_order_wherever_they_sit(data: st.DataObject) -> None:
    """A BLAS product may sum two identical rows one rounding step apart by where they sit (2 % of random
    cases), which ordered exact duplicates by position: the flat engine (its small-engine path, its general
    path, its float64 scan when many copies defeat the certificate) and `exact_top_k` give every duplicate in
    row order, with the rows and distances of a brute force that sums every row the same way."""
    metric = data.draw(st.sampled_from([m for m in Metric if m is not Metric.MANHATTAN]), label="metric")
    n = data.draw(st.integers(2, 1_600), label="rows")
    dim = data.draw(st.sampled_from([3, 5, 16, 67, 384]), label="dim")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    x = rng.standard_normal((n, dim)).astype(np.float32)
    copies = data.draw(st.integers(2, min(n, 400)), label="copies")
    where = rng.choice(n, copies, replace=False)
    x[where] = x[where[0]]
    # Queries near the copied row, so that the copies are among the nearest (and ties at the k-th), and one
    # anywhere.
    q = np.vstack([x[where[0]] + rng.standard_normal((2, dim)).astype(np.float32) * np.float32(0.05),
                   rng.standard_normal((1, dim)).astype(np.float32)])
    k = data.draw(st.integers(1, 30), label="k")
    want_d, want_l = summed_in_one_order(metric, q, x, k)
    got_d, got_l = exact_top_k(metric, q, x, k)
    np.testing.assert_array_equal(got_l, want_l)
    np.testing.assert_allclose(got_d, want_d, rtol=1e-12, atol=1e-12)
    for queries in (q, q[:1]):  # a batch, and one query (the searcher's usual call)
        got_d, got_l = get_engine("flat").build(x, metric, {}).search(queries, k)
        np.testing.assert_array_equal(got_l, want_l[: len(queries)])
        np.testing.assert_allclose(got_d, want_d[: len(queries)].astype(np.float32), rtol=1e-6, atol=1e-6)


def test_flat_near_ties_fall_back_to_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many duplicates of the nearest row defeat the float32 certificate; the answer stays exact."""
    flat = get_engine("flat")
    scans: list[int] = []
    original_scan = flat._scan_exact

    def counting_scan(self: Engine, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        scans.append(len(queries))
        return original_scan(self, queries, k)

    monkeypatch.setattr(flat, "_scan_exact", counting_scan)
    x, q = random_dense(5_000, 16, 3, seed=4)
    # 60 copies: a retry with 8x the candidates settles it; 2,000 copies: only the float64 scan does.
    for copies, scanned in ((60, False), (2_000, True)):
        y = x.copy()
        y[-copies:] = q[0] + 0.001
        for metric in Metric:
            scans.clear()
            ed, el = exact_top_k(metric, q, y, K)
            d, lab = flat.build(y, metric, {}).search(q, K)
            assert_exact(metric, exact_distances(metric, q, y), d, lab, ed, el)
            if metric is not Metric.DOT_PRODUCT:  # for the others the copies are the nearest rows: ties
                np.testing.assert_array_equal(lab[0], np.arange(len(y) - copies, len(y) - copies + K))
                assert bool(scans) == scanned


def _joined(
    metric: Metric, parts: list[tuple[np.ndarray, np.ndarray]], sizes: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """search_together's per-engine answers as one top k over the rows of all engines in turn."""
    offsets = np.cumsum([0, *sizes])
    d = np.hstack([p[0] for p in parts]).astype(np.float64)
    lab = np.hstack([np.where(p[1] >= 0, p[1] + off, -1) for p, off in zip(parts, offsets, strict=False)])
    for dist, labels in parts:  # each engine's share is nearest first (the searcher merges shares so)
        assert dist.shape == labels.shape == (len(d), K)
        for row_d, row_l in zip(dist.astype(np.float64), labels, strict=True):
            kept = row_d[row_l >= 0] * (-1 if metric is Metric.DOT_PRODUCT else 1)
            assert (np.diff(kept) >= 0).all()
    assert ((lab >= 0).sum(axis=1) == K).all(), "the engines' shares together hold exactly k rows"
    return top_k_of(metric, d, np.where(lab >= 0, lab, np.iinfo(np.int64).max), K)


@pytest.mark.parametrize("metric", [m for m in Metric if m is not Metric.MANHATTAN])
def test_flat_engines_searched_together_answer_as_one_engine_over_all_their_rows(metric: Metric) -> None:
    """The young tier's many exact engines, searched in one pass: the joint top k is the exact top k over all
    their rows (real data, single queries and a batch, near-ties across engines and a zero query)."""
    from shoal.engines.flat import search_together

    base, q = real()
    x = base[:6_000].copy()
    x[5_990:] = x[10]  # ten copies of one row, in another engine than the row itself: ties across engines
    queries = np.vstack([q[:40], x[10:11], np.zeros((1, x.shape[1]), np.float32)])
    sizes = [2_500, 1_200, 900, 700, 400, 200, 60, 30, 10]
    assert sum(sizes) == len(x)
    flat = get_engine("flat")
    bounds = np.cumsum([0, *sizes])
    engines = [flat.build(x[a:b], metric, {}) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    full = exact_distances(metric, queries, x)
    ed, el = top_k_of(metric, full, np.broadcast_to(np.arange(len(x)), full.shape), K)
    d, lab = _joined(metric, search_together(engines, queries, K), sizes)
    assert_exact(metric, full, d, lab, ed, el)
    for i in range(len(queries)):
        d1, l1 = _joined(metric, search_together(engines, queries[i : i + 1], K), sizes)
        np.testing.assert_array_equal(l1[0], lab[i])
        np.testing.assert_array_equal(d1[0], d[i])
    if metric is not Metric.DOT_PRODUCT:  # the row's own query: the row and its ten copies tie at the front
        np.testing.assert_array_equal(lab[40, :K], [10, *range(5_990, 5_999)])


def test_hnsw_answers_exactly_when_the_graph_cannot_reach_k_rows() -> None:
    x, q = random_dense(300, 8, 4, seed=11)
    engine = get_engine("hnsw").build(x, "dot_product", {})

    class Unreachable:
        """Stands in for the hnswlib index: queries fail as when pruning left rows unreachable."""

        def __init__(self, index: object) -> None:
            self.index = index

        def set_ef(self, ef: int) -> None:
            pass

        def knn_query(self, *args: object, **kwargs: object) -> None:
            raise RuntimeError("Cannot return the results in a contiguous 2D array. Probably ef or M is too small")

        def get_items(self, *args: object, **kwargs: object) -> object:
            return self.index.get_items(*args, **kwargs)

    engine._index = Unreachable(engine._index)
    d, lab = engine.search(q, 300)
    ed, el = exact_top_k("dot_product", q, x, 300)
    np.testing.assert_array_equal(lab, el)
    np.testing.assert_allclose(d, ed, rtol=1e-6)


@pytest.mark.parametrize("rows", [3, 3000])  # the small path (float64 over every row) and the keyed one
def test_distances_past_float32s_range_are_inf_without_a_warning(rows: int) -> None:
    """Squared distances of vectors with coordinates near 1e20 exceed float32: reported as inf, in label order
    after every finite one, and no RuntimeWarning per build or search (a server would log one per query)."""
    x = np.zeros((rows, 2), np.float32)
    x[:, 0] = np.arange(rows, dtype=np.float32)
    x[1] = x[2] = [1e20, 0]  # two huge rows: equal infinite distances, lower label first
    q = np.zeros((1, 2), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = get_engine("flat").build(x, "l2_squared", {})
        d, lab = engine.search(q, rows)
        together = search_together([engine, get_engine("flat").build(x[:1], "l2_squared", {})], q, rows)
    assert lab[0].tolist() == [0, *range(3, rows), 1, 2]
    assert np.isinf(d[0, -2:]).all() and np.isfinite(d[0, :-2]).all()
    # Searched together with a one-row engine, the finite part is the same and the other engine's row leads.
    (d_a, lab_a), (d_b, lab_b) = together
    assert lab_a[0, : rows - 2].tolist() == lab[0, : rows - 2].tolist()
    np.testing.assert_array_equal(d_a[0, : rows - 2], d[0, : rows - 2])
    assert (lab_b[0, 0], d_b[0, 0]) == (0, 0.0)


@pytest.mark.parametrize("metric", sorted(get_engine("ivf").supported_metrics))
def test_ivf_answers_k_rows_when_its_probed_lists_hold_fewer(metric: Metric) -> None:
    """One list probed of 16, k = every row: the probed list holds a sixteenth of them, yet the search answers
    all of them, nearest first, as exact search does (a split of a few rows asked for k used to get fewer)."""
    x, q = random_dense(64, 8, 5, seed=3)
    engine = get_engine("ivf").build(x, metric, {"nlist": 16, "nprobe": 1})
    d, lab = engine.search(q, 64)
    ed, el = exact_top_k(metric, q, x, 64)
    assert (lab >= 0).all()
    np.testing.assert_allclose(d, ed, rtol=1e-4, atol=1e-4)
    for row, want in zip(lab, el, strict=True):
        assert sorted(row.tolist()) == sorted(want.tolist())


# ---- validation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["hnsw", "ivf"])
def test_unsupported_metric_is_refused(algorithm: str) -> None:
    x, _ = random_dense(20, 4, 1)
    with pytest.raises(ValidationError, match=rf"algorithm '{algorithm}' does not support metric 'manhattan'"):
        get_engine(algorithm).build(x, "manhattan", {})
    with pytest.raises(ValidationError, match="supported: cosine, dot_product, euclidean, l2_squared"):
        get_engine(algorithm).check_metric(Metric.MANHATTAN)


def test_unknown_metric_algorithm_and_params_are_refused() -> None:
    with pytest.raises(ValidationError, match=r"unknown metric 'hamming'.*known: cosine"):
        get_engine("flat").check_metric("hamming")
    with pytest.raises(ValidationError, match=r"unknown algorithm 'annoy'.*known: flat, flat_sparse, hnsw, ivf"):
        get_engine("annoy")
    with pytest.raises(ValidationError, match=r"'flat' does not take parameter\(s\) 'M'"):
        get_engine("flat").normalize_params({"M": 16})
    with pytest.raises(ValidationError, match=r"'ivf' does not take parameter\(s\) 'nprobes'.*nlist, nprobe"):
        get_engine("ivf").normalize_params({"nprobes": 4})
    with pytest.raises(ValidationError, match="'hnsw' does not take parameter"):
        get_engine("hnsw").normalize_params({"M": 16, "ef_construction": 200, "ef_search": 64, "seed": 1})


@pytest.mark.parametrize(
    "params",
    [{"M": 16}, {"M": 16, "ef_construction": 100}, {"ef_search": 10}, {"ef_construction": 100, "ef_search": 10}],
)
def test_hnsw_params_all_or_none(params: dict[str, int]) -> None:
    with pytest.raises(ValidationError, match="HNSW parameters must be given all or none: missing"):
        get_engine("hnsw").normalize_params(params)


def test_param_values_are_checked_and_defaults_filled() -> None:
    hnsw, ivf = get_engine("hnsw"), get_engine("ivf")
    assert hnsw.normalize_params({}) == {"M": 16, "ef_construction": 200, "ef_search": 64}
    given_params = {"M": 8, "ef_construction": 50, "ef_search": 20}
    assert hnsw.normalize_params(given_params) == given_params
    assert ivf.normalize_params(None) == {"nlist": None, "nprobe": 32}
    assert ivf.normalize_params(ivf.normalize_params({"nlist": 7})) == {"nlist": 7, "nprobe": 32}  # idempotent
    for bad, rule in (
        ({"M": 1, "ef_construction": 50, "ef_search": 20}, "parameter 'M' must be an integer in 2..512"),
        ({"M": "16", "ef_construction": 50, "ef_search": 20}, "parameter 'M' must be an integer"),
        ({"M": 16, "ef_construction": 50, "ef_search": True}, "parameter 'ef_search' must be an integer"),
    ):
        with pytest.raises(ValidationError, match=rule):
            hnsw.normalize_params(bad)
    with pytest.raises(ValidationError, match="parameter 'nprobe' must be an integer in 1"):
        ivf.normalize_params({"nprobe": 0})
    with pytest.raises(ValidationError, match="parameter 'nlist' must be an integer"):
        ivf.normalize_params({"nlist": 2.5})


def test_bad_vectors_and_queries_are_refused() -> None:
    x, q = random_dense(10, 4, 2)
    flat = get_engine("flat")
    engine = flat.build(x, "cosine", {})
    with pytest.raises(ValidationError, match="dimension 5, the index has 4"):
        engine.search(np.zeros((1, 5), dtype=np.float32), 3)
    with pytest.raises(ValidationError, match="2-d numeric array"):
        engine.search(q[0], 3)
    with pytest.raises(ValidationError, match="k must be a non-negative integer"):
        engine.search(q, -1)
    bad = x.copy()
    bad[3, 1] = np.nan
    with pytest.raises(ValidationError, match="finite"):
        flat.build(bad, "cosine", {})
    with pytest.raises(ValidationError, match="must be SparseRows"):
        get_engine("flat_sparse").build(x, "cosine", {})
    with pytest.raises(ValidationError, match="2-d numeric array"):
        flat.build(random_sparse(3, 4, 0.5), "cosine", {})
    assert engine.search(q, 0)[0].shape == (2, 0)


def test_from_vektonn() -> None:
    assert from_vektonn("FaissIndex.L2", None) == ("flat", Metric.L2_SQUARED, {})
    assert from_vektonn("FaissIndex.IP", {}) == ("flat", Metric.DOT_PRODUCT, {})
    assert from_vektonn("SparnnIndex.Cosine", None) == ("flat_sparse", Metric.COSINE, {})
    hnsw = {"M": "32", "EfConstruction": "400", "EfSearch": "100"}
    assert from_vektonn("FaissIndex.L2", hnsw) == (
        "hnsw",
        Metric.L2_SQUARED,
        {"M": 32, "ef_construction": 400, "ef_search": 100},
    )
    assert from_vektonn("FaissIndex.IP", hnsw)[:2] == ("hnsw", Metric.DOT_PRODUCT)
    with pytest.raises(ValidationError, match=r"unknown Vektonn index type 'FaissIndex\.Cosine'.*FaissIndex\.IP"):
        from_vektonn("FaissIndex.Cosine", None)
    with pytest.raises(ValidationError, match="all or none: missing EfSearch"):
        from_vektonn("FaissIndex.L2", {"M": "32", "EfConstruction": "400"})
    with pytest.raises(ValidationError, match="does not take parameter"):
        from_vektonn("SparnnIndex.Cosine", {"M": "32"})
    with pytest.raises(ValidationError, match="parameter 'M' must be an integer"):
        from_vektonn("FaissIndex.L2", {"M": "many", "EfConstruction": "400", "EfSearch": "100"})


# ---- serialization ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("algorithm", "metric"), ALL)
def test_round_trip_gives_identical_results(algorithm: str, metric: Metric) -> None:
    cls = get_engine(algorithm)
    if cls.sparse:
        x, q = random_sparse(300, 40, 0.1, seed=5), random_sparse(12, 40, 0.2, seed=6)
    else:
        x, q = random_dense(600, 12, 12, seed=5)
    engine = cls.build(x, metric, {})
    data = engine.to_bytes()
    loaded = cls.from_bytes(data, metric, engine.params)
    assert len(loaded) == len(engine) and loaded.dim == engine.dim and loaded.params == engine.params
    for k in (1, K, 700):
        d1, l1 = engine.search(q, k)
        d2, l2 = loaded.search(q, k)
        np.testing.assert_array_equal(l1, l2)
        np.testing.assert_array_equal(d1, d2)
    assert loaded.to_bytes() == data or algorithm == "ivf"  # faiss may lay out its bytes differently


def test_from_bytes_checks_what_it_reads() -> None:
    x, _ = random_dense(50, 4, 1)
    data = get_engine("flat").build(x, "cosine", {}).to_bytes()
    with pytest.raises(ValidationError, match="serialized engine is flat/cosine, expected flat/euclidean"):
        get_engine("flat").from_bytes(data, "euclidean", {})
    with pytest.raises(ValidationError, match="expected hnsw/cosine"):
        get_engine("hnsw").from_bytes(data, "cosine", {})
    with pytest.raises(ValidationError, match="truncated"):
        get_engine("flat").from_bytes(data[:-4], "cosine", {})
    with pytest.raises(ValidationError, match="bad magic"):
        get_engine("flat").from_bytes(b"PK\x03\x04" + data, "cosine", {})


def test_hnsw_graphs_stored_in_the_earlier_layout_still_load_and_extend(tmp_path: Path) -> None:
    """Segments written before graphs were stored as hnswlib's state hold hnswlib's save_index file: they load,
    search and extend as the graph they hold; a malformed state is refused with a clear error."""
    from shoal.engines import envelope

    hnsw = get_engine("hnsw")
    x, q = random_dense(800, 16, 20, seed=9)
    engine = hnsw.build(x[:600], Metric.COSINE, {})
    header, _ = envelope.unpack(engine.to_bytes())
    assert header.pop("layout") == "state"
    engine._index.save_index(str(tmp_path / "graph.bin"))  # the earlier layout's one section
    old = envelope.pack(header, [(tmp_path / "graph.bin").read_bytes()])
    loaded = hnsw.from_bytes(old, Metric.COSINE, engine.params)
    for k in (1, K):
        np.testing.assert_array_equal(loaded.search(q, k)[1], engine.search(q, k)[1])
    again = hnsw.from_bytes(loaded.to_bytes(), Metric.COSINE, engine.params)  # stored again, in the new layout
    np.testing.assert_array_equal(again.search(q, K)[1], engine.search(q, K)[1])
    grown = hnsw.extend_bytes(old, x[600:], Metric.COSINE, engine.params, threads=1)
    assert grown is not None and len(grown) == 800
    assert recall(grown.search(x[600:], 1)[1], np.arange(600, 800)[:, None]) > 0.95
    header, sections = envelope.unpack(engine.to_bytes())
    broken = envelope.pack(header, [bytes(sections[0]), *(bytes(s) for s in sections[1:-1])])
    with pytest.raises(ValidationError, match="serialized HNSW graph is malformed"):
        hnsw.from_bytes(broken, Metric.COSINE, engine.params)


def test_query_time_params_come_from_the_caller_on_load() -> None:
    x, q = random_dense(500, 8, 5)
    hnsw = get_engine("hnsw").build(x, "cosine", {"M": 8, "ef_construction": 40, "ef_search": 10})
    loaded = get_engine("hnsw").from_bytes(hnsw.to_bytes(), "cosine", {"M": 8, "ef_construction": 40, "ef_search": 99})
    assert loaded.params == {"M": 8, "ef_construction": 40, "ef_search": 99}
    ivf = get_engine("ivf").build(x, "cosine", {"nlist": 10})
    loaded_ivf = get_engine("ivf").from_bytes(ivf.to_bytes(), "cosine", {"nprobe": 10})
    assert loaded_ivf.params == {"nlist": 10, "nprobe": 10}
    ed, el = exact_top_k("cosine", q, x, K)
    assert recall(loaded_ivf.search(q, K)[1], el) == 1.0  # all lists probed


def test_single_threaded_hnsw_build_is_reproducible() -> None:
    x, _ = random_dense(400, 8, 1)
    a = get_engine("hnsw").build(x, "euclidean", {}, threads=1).to_bytes()
    b = get_engine("hnsw").build(x, "euclidean", {}, threads=1).to_bytes()
    assert a == b


@pytest.mark.parametrize("metric", sorted(ENGINES["hnsw"].supported_metrics))
def test_hnsw_extended_with_rows_searches_like_a_graph_built_over_all(metric: Metric) -> None:
    """A merge adds small segments' rows to the largest one's graph: labels continue after the base's rows,
    the graph keeps the structure it was built with, and recall over base and added rows stays that of a
    graph built over all of them."""
    base, queries = real()
    old, new = base[:3_000], base[3_000:4_000]
    built = get_engine("hnsw").build(old, metric, {"M": 16, "ef_construction": 40, "ef_search": 64})
    extended = get_engine("hnsw").extend_bytes(built.to_bytes(), new, metric,
                                               {"M": 16, "ef_construction": 200, "ef_search": 64})
    assert extended is not None and len(extended) == 4_000
    assert extended.params == {"M": 16, "ef_construction": 40, "ef_search": 64}  # structure as built
    _, own = extended.search(new[:200], 1)
    assert (own[:, 0] == np.arange(3_000, 3_200)).all()  # the added rows answer under their new labels
    both = np.vstack([old, new])
    _, el = exact_top_k(metric, queries[:100], both, K)
    whole = get_engine("hnsw").build(both, metric, {"M": 16, "ef_construction": 40, "ef_search": 64})
    assert recall(extended.search(queries[:100], K)[1], el) >= recall(whole.search(queries[:100], K)[1], el) - 0.02
    # It serializes like any engine.
    again = get_engine("hnsw").from_bytes(extended.to_bytes(), metric, {"M": 16, "ef_construction": 40,
                                                                        "ef_search": 64})
    assert (again.search(queries[:20], K)[1] == extended.search(queries[:20], K)[1]).all()


def test_only_hnsw_extends_and_a_wrong_header_builds_anew() -> None:
    x, _ = random_dense(300, 8, 1)
    for algorithm in ("flat", "ivf"):
        engine = get_engine(algorithm).build(x, "cosine", {})
        assert not get_engine(algorithm).extends
        assert get_engine(algorithm).extend_bytes(engine.to_bytes(), x[:10], "cosine", {}) is None
    hnsw = get_engine("hnsw").build(x, "cosine", {})
    assert get_engine("hnsw").extend_bytes(hnsw.to_bytes(), x[:10], "euclidean", {}) is None  # not its metric
    assert get_engine("hnsw").extend_bytes(get_engine("flat").build(x, "cosine", {}).to_bytes(), x[:10],
                                           "cosine", {}) is None  # not its algorithm
    with pytest.raises(ValidationError, match="dimension"):
        get_engine("hnsw").extend_bytes(hnsw.to_bytes(), np.ones((2, 5), np.float32), "cosine", {})


# ---- edge cases ---------------------------------------------------------------------------------------


def _data_for(cls: type[Engine], n: int, seed: int = 0) -> tuple[np.ndarray | SparseRows, np.ndarray | SparseRows]:
    x, q = random_dense(n, 6, 3, seed)
    return (SparseRows.from_dense(x), SparseRows.from_dense(q)) if cls.sparse else (x, q)


@pytest.mark.parametrize(("algorithm", "metric"), ALL)
def test_empty_and_single_row_indexes_pad_results(algorithm: str, metric: Metric) -> None:
    cls = get_engine(algorithm)
    worst = -np.inf if higher_is_nearer(metric) else np.inf
    for n in (0, 1, 3):
        x, q = _data_for(cls, n)
        engine = cls.build(x, metric, {})
        engine = cls.from_bytes(engine.to_bytes(), metric, engine.params)
        assert len(engine) == n
        d, lab = engine.search(q, 5)
        assert d.shape == lab.shape == (3, 5)
        np.testing.assert_array_equal(lab[:, n:], -1)
        np.testing.assert_array_equal(d[:, n:], worst)
        ed, el = exact_top_k(metric, q, x, 5)
        np.testing.assert_array_equal(lab, el)
        np.testing.assert_allclose(d, ed, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("algorithm", "metric"), ALL)
def test_batch_of_one_query(algorithm: str, metric: Metric) -> None:
    cls = get_engine(algorithm)
    x, q = _data_for(cls, 300, seed=7)
    engine = cls.build(x, metric, exhaustive(algorithm))
    one = q.take([1]) if cls.sparse else q[1:2]
    d1, l1 = engine.search(one, K)
    d, lab = engine.search(q, K)
    assert d1.shape == (1, K)
    np.testing.assert_array_equal(l1[0], lab[1])
    np.testing.assert_allclose(d1[0], d[1], rtol=1e-6)


@pytest.mark.parametrize(("algorithm", "metric"), ALL)
def test_direction_of_distances(algorithm: str, metric: Metric) -> None:
    cls = get_engine(algorithm)
    x, q = _data_for(cls, 500, seed=8)
    d, _ = cls.build(x, metric, exhaustive(algorithm)).search(q, 20)
    steps = np.diff(d.astype(np.float64), axis=1)
    if metric is Metric.DOT_PRODUCT:
        assert (steps <= 0).all() and (steps < 0).any()
    else:
        assert (steps >= 0).all() and (steps > 0).any()


@pytest.mark.parametrize("algorithm", ["flat", "flat_sparse", "hnsw", "ivf"])
def test_zero_vectors_under_cosine_are_at_distance_one(algorithm: str) -> None:
    cls = get_engine(algorithm)
    x, q = random_dense(50, 6, 2, seed=9)
    x[[3, 17]] = 0.0
    q[1] = 0.0
    if cls.sparse:
        x, q = SparseRows.from_dense(x), SparseRows.from_dense(q)
    full = exact_distances("cosine", q, x)
    assert not np.isnan(full).any()
    np.testing.assert_array_equal(full[:, [3, 17]], 1.0)
    np.testing.assert_array_equal(full[1], 1.0)
    engine = cls.build(x, "cosine", exhaustive(algorithm))
    d, lab = engine.search(q, 50)
    assert not np.isnan(d).any()
    np.testing.assert_allclose(d[0][np.isin(lab[0], [3, 17])], 1.0, atol=1e-6)
    np.testing.assert_allclose(d[1], 1.0, atol=1e-6)  # a zero query: everything at distance 1
    if algorithm.startswith("flat"):
        np.testing.assert_array_equal(lab[1], np.arange(50))  # all tied: lowest labels first


def test_sparse_empty_rows_and_queries() -> None:
    rows = SparseRows.from_lists([[], [2, 0], [], [1]], [[], [1.0, 2.0], [], [-3.0]], dim=3)
    queries = SparseRows.from_lists([[0], []], [[1.0], []], dim=3)
    for metric in Metric:
        ed, el = exact_top_k(metric, queries, rows, 6)
        d, lab = get_engine("flat_sparse").build(rows, metric, {}).search(queries, 6)
        np.testing.assert_array_equal(lab, el)
        np.testing.assert_allclose(d, ed.astype(np.float32))
        dense_d, dense_l = exact_top_k(metric, queries.to_dense(), rows.to_dense(), 6)
        np.testing.assert_array_equal(el, dense_l)
        np.testing.assert_allclose(ed, dense_d)
    d, lab = get_engine("flat_sparse").build(rows, "euclidean", {}).search(queries, 2)
    np.testing.assert_array_equal(lab[1], [0, 2])  # the empty query is nearest to the empty rows
    np.testing.assert_array_equal(d[1], [0.0, 0.0])


def test_sparse_rows() -> None:
    rows = SparseRows.from_lists([[5, 1], [], [0, 9, 3]], [[1.0, 2.0], [], [4.0, 5.0, 6.0]], dim=10)
    assert len(rows) == 3 and rows.nnz == 5
    np.testing.assert_array_equal(rows.row(0)[0], [1, 5])  # sorted within the row
    np.testing.assert_array_equal(rows.row(0)[1], [2.0, 1.0])
    dense = rows.to_dense()
    assert dense.shape == (3, 10) and dense[2, 9] == 5.0 and dense[1].sum() == 0
    np.testing.assert_array_equal(rows.take([2, 0, 2]).to_dense(), dense[[2, 0, 2]])
    np.testing.assert_array_equal(rows.take(slice(1, 3)).to_dense(), dense[1:3])
    np.testing.assert_array_equal(rows.take([]).to_dense(), dense[:0])
    np.testing.assert_allclose(rows.squared_norms(), (dense.astype(np.float64) ** 2).sum(axis=1))
    q_idx, q_val = np.array([0, 5], dtype=np.int32), np.array([1.0, -1.0])
    np.testing.assert_allclose(rows.dot(q_idx, q_val), dense @ np.array([1, 0, 0, 0, 0, -1, 0, 0, 0, 0]))
    with pytest.raises(ValidationError, match="unique"):
        SparseRows.from_lists([[1, 1]], [[1.0, 2.0]], dim=3)
    with pytest.raises(ValidationError, match=r"lie in \[0, 3\)"):
        SparseRows.from_lists([[3]], [[1.0]], dim=3)
    with pytest.raises(ValidationError, match="has 2 indices but 1 values"):
        SparseRows.from_lists([[0, 1]], [[1.0]], dim=3)


def test_faiss_is_quiet_on_small_splits(capfd: pytest.CaptureFixture[str]) -> None:
    x, q = random_dense(120, 8, 2)
    engine = get_engine("ivf").build(x, "euclidean", {"nlist": 100})
    assert engine.params["nlist"] == 100
    tiny = get_engine("ivf").build(x[:3], "euclidean", {"nlist": 100})
    assert tiny.params["nlist"] == 3  # clamped to the rows
    assert get_engine("ivf").build(x, "euclidean", {}).params["nlist"] == 44  # about 4 * sqrt(120)
    many, _ = random_dense(2_000, 8, 1)
    assert get_engine("ivf").build(many, "cosine", {"nlist": 10}).params["nlist"] == 10  # trains on a sample
    out, err = capfd.readouterr()
    assert "WARNING" not in out + err


def test_concurrent_hnsw_searches_with_different_k() -> None:
    x, q = random_dense(2_000, 8, 20, seed=10)
    engine = get_engine("hnsw").build(x, "euclidean", {})
    expected = {k: engine.search(q, k) for k in (1, 10, 150)}
    failures: list[str] = []

    def worker(k: int) -> None:
        for _ in range(20):
            d, lab = engine.search(q, k)
            if not (np.array_equal(lab, expected[k][1]) and np.array_equal(d, expected[k][0])):
                failures.append(f"k={k}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in (1, 10, 150) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


@pytest.mark.parametrize("algorithm", ["flat", "hnsw", "ivf", "flat_sparse"])
@pytest.mark.parametrize("metric", ["cosine", "l2_squared", "dot_product"])
def test_search_lists_agree_with_search_and_order_ties_by_label(algorithm: str, metric: str) -> None:
    """`search_lists` (what the searcher builds results from) answers what `search` does, one query or many,
    and equal distances come in label order: rows 7, 19, 30, 41 and 52 hold the same vector."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((60, 8)).astype(np.float32)
    x[[19, 30, 41, 52]] = x[7]
    q = np.vstack([x[7:8], rng.standard_normal((3, 8)).astype(np.float32)])
    cls = get_engine(algorithm)
    vectors, queries = (SparseRows.from_dense(x), SparseRows.from_dense(q)) if cls.sparse else (x, q)
    engine = cls.build(vectors, metric, exhaustive(algorithm))
    d, lab = engine.search(queries, 10)
    for i in range(len(q)):
        one = queries[i : i + 1] if not cls.sparse else SparseRows.from_dense(q[i : i + 1])
        got_d, got_l = engine.search_lists(one, 10)
        assert got_l == [lab[i].tolist()]
        np.testing.assert_allclose(got_d[0], d[i], rtol=1e-6, atol=1e-6)
    many_d, many_l = engine.search_lists(queries, 10)
    assert many_l == lab.tolist()
    if metric != "dot_product":  # for the others the copies are the nearest rows of query 0, all tied
        assert lab[0][:5].tolist() == [7, 19, 30, 41, 52]
    # k above the row count: every row once, nothing padded.
    assert sorted(engine.search_lists(queries[:1] if not cls.sparse else SparseRows.from_dense(q[:1]), 100)[1][0]) \
        == list(range(60))


@pytest.mark.parametrize("metric", ["cosine", "l2_squared", "dot_product", "euclidean"])
def test_hnsw_search_one_is_search_lists_for_one_raw_query(metric: str) -> None:
    """The single-query shortcut answers what search_lists does (ties in label order), refuses NaN and inf, and
    declines (None) whatever it is not for, leaving it to the checked path."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((300, 8)).astype(np.float32)
    x[[50, 60]] = x[40]
    engine = get_engine("hnsw").build(x, metric, {})
    native = metric in ("cosine", "l2_squared")
    queries = np.vstack([x[40:41], rng.standard_normal((20, 8)).astype(np.float32)])
    for i in range(len(queries)):
        one = engine.search_one(queries[i : i + 1], 10, {"ef_search": 300})
        if not native:
            assert one is None
            continue
        assert one is not None
        d_rows, l_rows = engine.search_lists(queries[i : i + 1], 10, {"ef_search": 300})
        assert one[1] == l_rows[0]
        np.testing.assert_allclose(one[0], d_rows[0], rtol=1e-6)
    if native:
        assert engine.search_one(queries[:1], 3)[1] == [40, 50, 60]  # type: ignore[index]
        bad = queries[:1].copy()
        for value in (np.nan, np.inf, -np.inf):
            bad[0, 3] = value
            with pytest.raises(ValidationError, match="query coordinates must be finite"):
                engine.search_one(bad, 10)
        # Not for it: float64, a batch, a 1-d vector, a wrong dimension, a strided view, k above the row count.
        for query, k in ((queries[:1].astype(np.float64), 10), (queries[:2], 10), (queries[0], 10),
                         (queries[:1, :4], 10), (np.asfortranarray(np.tile(queries[:1], (1, 2)))[:, ::2], 10),
                         (queries[:1], 301)):
            assert engine.search_one(query, k) is None
