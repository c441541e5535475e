"""Filtered search: attribute filters (shoal.searcher.filters) through the Python API, the Vektonn search body,
dataset search and multi-dataset search; compared with brute force over the matching live points, at every
consistency level, over built segments and the log tail, on flat (exact), HNSW and IVF (recall kept)."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import serve_api
from helpers.summed import summed_in_one_order
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal import DataPoint, DataSourceSpec, Shoal, Tombstone
from shoal.auth import create_key
from shoal.config.settings import Settings
from shoal.engines.metrics import Metric, exact_distances, exact_top_k
from shoal.errors import QueryError
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec, SparseVector
from shoal.searcher import execute as execute_module
from shoal.searcher.consistency import Consistency

DIM = 8
SECTIONS = ["utils", "net", "doc", "libs"]
T0 = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
Row = dict[str, Any]


def make_rows(n: int, seed: int = 7) -> tuple[list[Row], np.ndarray]:
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((n, DIM)).astype(np.float32)
    rows = [
        {"id": i, "section": SECTIONS[i % 4], "size": int(i * 7 % 1000), "score": float(i % 10) / 2,
         "when": T0 + dt.timedelta(days=i % 365), "flag": i % 3 == 0}
        for i in range(n)
    ]
    return rows, vectors


def brute(rows: list[Row], vectors: np.ndarray, query: np.ndarray, k: int, keep: Callable[[Row], bool],
          metric: str = "euclidean") -> list[int]:
    """The ids of the k nearest rows `keep` passes."""
    idx = [i for i, r in enumerate(rows) if keep(r)]
    if not idx:
        return []
    _, labels = exact_top_k(Metric(metric), query[None, :], vectors[idx], k)
    return [rows[idx[j]]["id"] for j in labels[0] if j >= 0]


class Setup:
    """A data source with typed attributes and one index over it, built; a searcher that does not follow."""

    def __init__(self, shoal: Shoal, algorithm: str, n: int, params: dict[str, Any] | None = None) -> None:
        tag = uuid.uuid4().hex[:8]
        self.shoal = shoal
        self.source = DataSourceSpec(
            f"fs-{tag}", "1", DIM,
            {"id": "int64", "section": "string", "size": "int64", "score": "float64", "when": "datetime",
             "flag": "bool"},
            ["id"],
        )
        shoal.create_data_source(self.source)
        self.index = shoal.create_index(IndexSpec(f"fi-{tag}", "1", self.source.name, "1", algorithm=algorithm,
                                                  metric="euclidean", params=params or {}, id_attributes=["id"]))
        self.rows, self.vectors = make_rows(n)
        self.producer = shoal.producer(self.source.name, "1")
        self.token = self.upload(self.rows, self.vectors)
        self.build()
        self.searcher = shoal.searcher(follow=False)

    def upload(self, rows: list[Row], vectors: np.ndarray) -> int:
        seq = 0
        for s in range(0, len(rows), 2000):
            seq = self.producer.upload([DataPoint(r, v) for r, v in zip(rows[s:s + 2000], vectors[s:s + 2000],
                                                                          strict=True)]).seq
        return seq

    def build(self) -> None:
        ShardBuilder(self.shoal.engine, self.shoal.storage).materialize(self.index.shards[0].id)

    def search(self, query: np.ndarray, k: int, filters: Any, **options: Any) -> list[int]:
        hits = self.searcher.search(self.index.spec.name, "1", [query], k, filters=filters, **options)[0]
        return [h.attributes["id"] for h in hits]


FILTERS: list[tuple[dict[str, Any], Callable[[Row], bool]]] = [
    ({"section": "utils"}, lambda r: r["section"] == "utils"),
    ({"section": {"$eq": "net"}}, lambda r: r["section"] == "net"),
    ({"section": {"$ne": "net"}}, lambda r: r["section"] != "net"),
    ({"section": {"$in": ["doc", "libs"]}}, lambda r: r["section"] in ("doc", "libs")),
    ({"section": {"$nin": ["doc", "libs"]}}, lambda r: r["section"] not in ("doc", "libs")),
    ({"size": {"$gte": 100, "$lt": 300}}, lambda r: 100 <= r["size"] < 300),
    ({"size": {"$gt": 900}}, lambda r: r["size"] > 900),
    ({"score": {"$lte": 1.5}}, lambda r: r["score"] <= 1.5),
    ({"flag": True}, lambda r: r["flag"]),
    ({"when": {"$gte": "2024-03-01T00:00:00Z", "$lt": "2024-04-01"}},
     lambda r: dt.datetime(2024, 3, 1, tzinfo=dt.UTC) <= r["when"] < dt.datetime(2024, 4, 1, tzinfo=dt.UTC)),
    ({"$and": [{"section": "utils"}, {"size": {"$lt": 500}}]}, lambda r: r["section"] == "utils" and r["size"] < 500),
    ({"$or": [{"section": "utils"}, {"id": {"$in": [1, 2, 3]}}]},
     lambda r: r["section"] == "utils" or r["id"] in (1, 2, 3)),
    ({"$not": {"section": {"$in": ["utils", "net", "doc"]}}}, lambda r: r["section"] == "libs"),
    ({"section": "utils", "flag": False}, lambda r: r["section"] == "utils" and not r["flag"]),
    ({"id": 999999}, lambda r: False),
]


@pytest.mark.parametrize("algorithm", ["flat", "hnsw", "ivf"])
def test_every_operator_equals_brute_force(local_shoal: Shoal, algorithm: str) -> None:
    """Each operator and and/or/not: the k nearest matching points, exactly (small matching sets are scanned
    exactly on every algorithm)."""
    s = Setup(local_shoal, algorithm, 600)
    rng = np.random.default_rng(1)
    for filters, keep in FILTERS:
        for _ in range(3):
            q = rng.standard_normal(DIM).astype(np.float32)
            assert s.search(q, 10, filters) == brute(s.rows, s.vectors, q, 10, keep), filters
    # No filter (None or {}) is the unfiltered search.
    q = rng.standard_normal(DIM).astype(np.float32)
    assert s.search(q, 5, {}) == s.search(q, 5, None)
    # Several query vectors in one search: each answered as alone.
    batch = rng.standard_normal((4, DIM)).astype(np.float32)
    filters, keep = FILTERS[5]
    hits = s.searcher.search(s.index.spec.name, "1", batch, 7, filters=filters)
    assert [[h.attributes["id"] for h in one] for one in hits] == [brute(s.rows, s.vectors, q, 7, keep) for q in batch]
    # Time travel takes filters too: as of the first upload's token, the built state.
    assert s.search(q, 6, filters, as_of=s.token) == brute(s.rows, s.vectors, q, 6, keep)


def test_sparse_vectors_filter_exactly(local_shoal: Shoal) -> None:
    """flat_sparse over built segments and the log tail: the k nearest matching points."""
    tag = uuid.uuid4().hex[:8]
    source = DataSourceSpec(f"fsp-{tag}", "1", 50, {"id": "int64", "lang": "string"}, ["id"], vectors_are_sparse=True)
    local_shoal.create_data_source(source)
    index = local_shoal.create_index(IndexSpec(f"fspi-{tag}", "1", source.name, "1", algorithm="flat_sparse",
                                               metric="cosine", id_attributes=["id"]))
    rng = np.random.default_rng(8)
    points = {i: SparseVector(sorted(rng.choice(50, 4, replace=False).tolist()), rng.random(4).tolist())
              for i in range(60)}
    producer = local_shoal.producer(source.name, "1")
    producer.upload([DataPoint({"id": i, "lang": "en" if i % 3 else "de"}, v) for i, v in points.items() if i < 40])
    ShardBuilder(local_shoal.engine, local_shoal.storage).materialize(index.shards[0].id)
    producer.upload([DataPoint({"id": i, "lang": "en" if i % 3 else "de"}, v) for i, v in points.items() if i >= 40])
    dense = np.zeros((60, 50), np.float32)
    for i, v in points.items():
        dense[i, list(v.indices)] = v.values
    query = SparseVector([1, 2, 3, 10, 20], [1.0, 0.5, 0.2, 0.7, 0.1])
    qd = np.zeros(50, np.float32)
    qd[list(query.indices)] = query.values
    searcher = local_shoal.searcher(follow=False)
    try:
        hits = searcher.search(index.spec.name, "1", [query], 5, filters={"lang": "de"},
                               consistency=Consistency.strong())[0]
    finally:
        searcher.close()
    de = [i for i in range(60) if i % 3 == 0]
    dist, labels = exact_top_k(Metric.COSINE, qd[None, :], dense[de], 5)
    assert [h.attributes["id"] for h in hits] == [de[j] for j in labels[0]]
    np.testing.assert_allclose([h.distance for h in hits], dist[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["hnsw", "ivf"])
def test_ann_engines_filtered_paths_keep_recall(local_shoal: Shoal, algorithm: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """With the exact-scan threshold at zero, every filtered search goes through the engine's own filtered
    search (HNSW: widened walk or hnswlib's filter; IVF: faiss's ID selector): every hit matches, k of them,
    and recall@10 against brute force stays high at every selectivity."""
    monkeypatch.setattr(execute_module, "FILTER_EXACT_MAX_ROWS_X_FRACTION", 0)
    s = Setup(local_shoal, algorithm, 3000)
    rng = np.random.default_rng(2)
    for filters, keep in [
        ({"size": {"$lt": 600}}, lambda r: r["size"] < 600),  # ~60 %
        ({"section": "net"}, lambda r: r["section"] == "net"),  # 25 %
        ({"size": {"$lt": 50}}, lambda r: r["size"] < 50),  # ~5 %
        ({"size": {"$lt": 10}}, lambda r: r["size"] < 10),  # ~1 %
    ]:
        recalls = []
        for _ in range(10):
            q = rng.standard_normal(DIM).astype(np.float32)
            got = s.search(q, 10, filters)
            truth = brute(s.rows, s.vectors, q, 10, keep)
            assert len(got) == len(truth) and all(keep(s.rows[i]) for i in got), filters
            recalls.append(len(set(got) & set(truth)) / len(truth))
        assert np.mean(recalls) >= 0.9, (filters, np.mean(recalls))


def test_hnsw_low_selectivity_returns_k_exact_matches(local_shoal: Shoal) -> None:
    """A filter passing 0.5 % of the rows still answers k exact matches (post-filtering would answer ~0)."""
    s = Setup(local_shoal, "hnsw", 4000, {"M": 16, "ef_construction": 100, "ef_search": 32})
    passing = {r["id"] for r in s.rows if r["id"] % 200 == 0}  # 20 of 4000
    rng = np.random.default_rng(3)
    for _ in range(10):
        q = rng.standard_normal(DIM).astype(np.float32)
        got = s.search(q, 10, {"id": {"$in": sorted(passing)}})
        assert got == brute(s.rows, s.vectors, q, 10, lambda r: r["id"] in passing)
        assert len(got) == 10


def test_a_filter_of_its_own_per_search_keeps_no_gathered_rows(local_shoal: Shoal) -> None:
    """Filters that differ per search (a range per request) are answered exactly without keeping the rows
    they gathered, so they neither grow the searcher nor push out what repeated filters keep; a filter seen
    again keeps its subset, and answers the same from it."""
    s = Setup(local_shoal, "hnsw", 3000, {"M": 16, "ef_construction": 100, "ef_search": 32})
    execute_module.SUBSETS.clear()
    rng = np.random.default_rng(5)
    for lo in range(0, 600, 30):  # 20 distinct ranges, each matching about 1 % of the rows
        q = rng.standard_normal(DIM).astype(np.float32)
        flt = {"size": {"$gte": lo, "$lt": lo + 10}}
        assert s.search(q, 10, flt) == brute(s.rows, s.vectors, q, 10, lambda r, lo=lo: lo <= r["size"] < lo + 10)
    assert execute_module.SUBSETS.nbytes == 0
    flt = {"size": {"$gte": 700, "$lt": 710}}
    q = rng.standard_normal(DIM).astype(np.float32)
    first = s.search(q, 10, flt)
    assert execute_module.SUBSETS.nbytes == 0
    assert s.search(q, 10, flt) == first == brute(s.rows, s.vectors, q, 10, lambda r: 700 <= r["size"] < 710)
    assert execute_module.SUBSETS.nbytes > 0
    assert s.search(q, 10, flt) == first


def test_filters_at_every_consistency_level_include_the_log_tail(local_shoal: Shoal) -> None:
    """Points uploaded (and deleted) after the index was built: strong and at_least filtered searches see them,
    eventual ones see the served version only; all equal brute force over the matching state they reflect."""
    s = Setup(local_shoal, "hnsw", 500)
    built_rows, built_vectors = list(s.rows), s.vectors.copy()
    new_rows, new_vectors = make_rows(60, seed=9)
    for r in new_rows:
        r["id"] += 10_000
        r["section"] = "fresh"
    token = s.upload(new_rows, new_vectors)
    # Delete some built "utils" rows: the tail hides them from every level that reflects the delete.
    gone = [r["id"] for r in built_rows if r["section"] == "utils"][:20]
    token = s.producer.upload([Tombstone({"id": i}) for i in gone]).seq
    rows_now = [r for r in built_rows if r["id"] not in gone] + new_rows
    vecs_now = np.vstack([built_vectors[[r["id"] not in gone for r in built_rows]], new_vectors])
    filters = {"section": {"$in": ["fresh", "utils"]}}
    keep = lambda r: r["section"] in ("fresh", "utils")  # noqa: E731
    queries = np.random.default_rng(4).standard_normal((5, DIM)).astype(np.float32)
    for q in queries:
        # Eventual first: this searcher neither follows nor has a young tier yet, so the built version alone
        # (a strong search below extends its young tier, which eventual searches then reflect too).
        assert s.search(q, 10, filters, consistency=Consistency.eventual()) == brute(
            built_rows, built_vectors, q, 10, keep)
    for q in queries:
        expected = brute(rows_now, vecs_now, q, 10, keep)
        assert any(i >= 10_000 for i in expected)
        assert s.search(q, 10, filters, consistency=Consistency.strong()) == expected
        assert s.search(q, 10, filters, consistency=Consistency.at_least(token)) == expected
        assert s.search(q, 10, {"section": "fresh"}, consistency=Consistency.strong()) == brute(
            rows_now, vecs_now, q, 10, lambda r: r["section"] == "fresh")
        assert s.search(q, 10, filters, consistency=Consistency.eventual()) == expected  # the young tier now


@pytest.mark.parametrize("algorithm", ["flat", "hnsw", "ivf"])
def test_a_k_past_every_row_answers_every_matching_row(local_shoal: Shoal, algorithm: str) -> None:
    """Vektonn's k has no upper bound: a filtered search sized its answer by k and raised (a 500 through HTTP)
    for k = 10**30, or tried to allocate 4 TiB for k = 2**40; at k = 10**9 it would have taken 12 GB for one
    query. Every matching row comes back, nearest first, from the index and from the log tail alike."""
    s = Setup(local_shoal, algorithm, 400)
    new_rows, new_vectors = make_rows(30, seed=13)
    for r in new_rows:
        r["id"] += 10_000
    s.upload(new_rows, new_vectors)
    rows, vectors = s.rows + new_rows, np.vstack([s.vectors, new_vectors])
    q = np.random.default_rng(6).standard_normal(DIM).astype(np.float32)
    for flt, keep in (FILTERS[0], FILTERS[5], FILTERS[6], FILTERS[-1]):
        everything = brute(rows, vectors, q, len(rows), keep)
        for k in (10**30, 2**40, len(rows) + 1):
            assert s.search(q, k, flt, consistency=Consistency.strong()) == everything, (flt, k)
            assert s.search(q, k, flt, consistency=Consistency.eventual()) == everything, (flt, k)


def nest(operator: str, depth: int) -> dict[str, Any]:
    """A filter nesting `operator` ($and, $or: a list of one; $not) `depth` levels deep over one condition."""
    flt: dict[str, Any] = {"size": 1}
    for _ in range(depth):
        flt = {operator: flt} if operator == "$not" else {operator: [flt]}
    return flt


def test_filters_nest_up_to_the_limit(local_shoal: Shoal) -> None:
    """32 levels of $and, $or and $not answer as brute force does; the next level is refused by name."""
    s = Setup(local_shoal, "flat", 50)
    q = np.zeros(DIM, np.float32)
    even = {"$not": {"$not": {"size": {"$lt": 100}}}}  # two levels
    flt: dict[str, Any] = even
    for level in range(3, 33):
        flt = {"$and": [flt]} if level % 2 else {"$or": [flt]}
    assert s.search(q, 5, flt) == brute(s.rows, s.vectors, q, 5, lambda r: r["size"] < 100)
    with pytest.raises(QueryError, match="at most 32 levels deep"):
        s.search(q, 5, {"$not": flt})


@pytest.mark.parametrize(
    ("filters", "attribute", "says"),
    [
        ({"nope": 1}, "nope", "unknown attribute"),
        ({"size": "big"}, "size", "expected int64"),
        ({"section": {"$regex": "u.*"}}, "section", "unknown filter operator"),
        ({"$xor": [{"size": 1}]}, "$xor", "unknown filter operator"),
        ({"when": {"$gt": "yesterday"}}, "when", "ISO 8601"),
        ({"flag": {"$gt": True}}, "flag", "$gt needs"),
        ({"section": {"$in": "utils"}}, "section", "takes a list"),
        ({"$or": []}, "$or", "non-empty list"),
        # A lone surrogate (JSON can escape one) matches no stored text, and Arrow cannot take it: it was a 500.
        ({"section": "\ud800"}, "section", "lone surrogate"),
        ({"section": {"$in": ["net", "x\udc00"]}}, "section", "lone surrogate"),
        ({"section": {"$gte": "\ud800"}}, "section", "lone surrogate"),
        # Nested past Python's stack (within the node limit): a RecursionError, a 500 over HTTP.
        (nest("$and", 250), "filter", "at most 32 levels deep"),
        (nest("$not", 340), "filter", "at most 32 levels deep"),
        # Every key of an object is a condition: 1,001 names in one object pass the node limit.
        ({f"f{i}": 1 for i in range(1001)}, "filter", "at most 1000 conditions"),
    ],
)
def test_bad_filters_name_the_attribute(local_shoal: Shoal, filters: Any, attribute: str, says: str) -> None:
    s = Setup(local_shoal, "flat", 10)
    with pytest.raises(QueryError) as err:
        s.search(np.zeros(DIM, np.float32), 3, filters)
    assert err.value.problems[0].attribute == attribute and says in str(err.value), str(err.value)


def test_a_repeated_filter_is_judged_by_its_values_not_by_a_cached_look_alike(local_shoal: Shoal) -> None:
    # Parsed filters are cached per view by their text: a value that prints like an accepted one (a datetime
    # beside its string, on a string attribute) must still be refused, and an accepted one still answered.
    s = Setup(local_shoal, "flat", 10)
    q = np.zeros(DIM, np.float32)
    s.search(q, 3, {"section": "2024-01-01 00:00:00"})
    s.search(q, 3, {"section": "2024-01-01T00:00:00"})
    with pytest.raises(QueryError) as err:
        s.search(q, 3, {"section": dt.datetime(2024, 1, 1)})
    assert "expected string" in str(err.value)
    utils = s.search(q, 3, {"section": "utils"})
    assert utils and s.search(q, 3, {"section": np.str_("utils")}) == utils
    with pytest.raises(QueryError):
        s.search(q, 3, {"score": {"$lt": float("nan")}})
    s.search(q, 3, {"score": {"$lt": 1.5}})
    with pytest.raises(QueryError):
        s.search(q, 3, {"score": {"$lt": None}})


def test_filter_on_an_attribute_the_index_does_not_store_is_refused(local_shoal: Shoal) -> None:
    tag = uuid.uuid4().hex[:8]
    source = DataSourceSpec(f"fp-{tag}", "1", 2, {"id": "int64", "secret": "string"}, ["id"])
    local_shoal.create_data_source(source)
    local_shoal.create_index(IndexSpec(f"fpi-{tag}", "1", source.name, "1", id_attributes=["id"],
                                       payload_attributes=[]))
    searcher = local_shoal.searcher(follow=False)
    try:
        with pytest.raises(QueryError) as err:
            searcher.search(f"fpi-{tag}", "1", [[0.0, 0.0]], 1, filters={"secret": "x"})
    finally:
        searcher.close()
    assert err.value.problems[0].attribute == "secret" and "does not store" in str(err.value)


# -- HTTP ------------------------------------------------------------------------------------------------------


@pytest.fixture
def http_api(make_settings: Any, redis_url: str) -> Iterator[tuple[httpx.Client, Shoal, Settings]]:
    settings = make_settings("local", redis_url=redis_url)
    with Shoal(settings, notify=False) as shoal, serve_api(settings) as url:
        key = create_key(shoal.engine, settings.tenant, "admin")[1]
        with httpx.Client(base_url=url, headers={"Authorization": f"ApiKey {key}"}, timeout=60) as http:
            yield http, shoal, settings


def test_vektonn_search_body_takes_a_filter(http_api: tuple[httpx.Client, Shoal, Settings]) -> None:
    http, shoal, _ = http_api
    s = Setup(shoal, "hnsw", 400)
    q = np.random.default_rng(5).standard_normal(DIM).astype(np.float32)
    url = f"/api/v1/search/{s.index.spec.name}/1"
    body = {"k": 5, "queryVectors": [{"isSparse": False, "coordinates": q.tolist()}]}

    def ids(r: httpx.Response) -> list[int]:
        assert r.status_code == 200, r.text
        return [next(a["value"]["int64"] for a in p["attributes"] if a["key"] == "id")
                for p in r.json()[0]["nearestDataPoints"]]

    # Without a filter: Vektonn's answer as before (the unfiltered search).
    assert ids(http.post(url, json=body)) == s.search(q, 5, None)
    filters = {"$and": [{"section": {"$in": ["net", "doc"]}}, {"size": {"$gte": 200}}]}
    keep = lambda r: r["section"] in ("net", "doc") and r["size"] >= 200  # noqa: E731
    assert ids(http.post(url, json=body | {"filter": filters})) == brute(s.rows, s.vectors, q, 5, keep)
    # The rest of the language through this body too: datetime ranges (ISO text in JSON), $or, $not.
    others = [(f, keep) for f, keep in FILTERS if {"when", "$or", "$not"} & set(f)]
    assert len(others) == 3
    for flt, keep in others:
        assert ids(http.post(url, json=body | {"filter": flt})) == brute(s.rows, s.vectors, q, 5, keep), flt
    # Strong, with points only in the log tail.
    new_rows, new_vectors = make_rows(5, seed=11)
    for r in new_rows:
        r["id"] += 5000
        r["section"] = "tail"
    s.upload(new_rows, new_vectors)
    got = ids(http.post(url, json=body | {"filter": {"section": "tail"}}, headers={"X-Shoal-Consistency": "strong"}))
    assert sorted(got) == sorted(r["id"] for r in new_rows)
    # Bad filters: 400 naming the attribute; nothing else happens.
    for bad, name in (({"colour": "red"}, "colour"), ({"size": {"$gte": "x"}}, "size"), ([1], "filter")):
        r = http.post(url, json=body | {"filter": bad})
        assert r.status_code == 400, r.text
        assert name in r.text
    # Nested past Python's stack: a 400 naming the limit (it answered 500).
    for deep in (nest("$and", 250), nest("$not", 340)):
        r = http.post(url, json=body | {"filter": deep})
        assert r.status_code == 400 and "at most 32 levels deep" in r.text, r.text
    # An integer past 64 bits on an int64 attribute is out of range, as the integer it is (orjson read it as a
    # float: "got float").
    for flt in ({"size": 123456789012345678901234567890}, {"size": {"$gt": -(2**63) - 1}}):
        r = http.post(url, json=body | {"filter": flt})
        assert r.status_code == 400 and "'size'" in r.text and "int64 value out of range" in r.text, r.text
    # A JSON integer past float64's range on a float64 attribute (it answered 500: float() overflowed).
    huge = 10**400
    for flt in ({"score": {"$gt": huge}}, {"score": -huge}, {"score": {"$in": [1.5, huge]}}):
        r = http.post(url, json=body | {"filter": flt})
        assert r.status_code == 400 and "'score'" in r.text and "float64 value out of range" in r.text, r.text


def test_dataset_search_and_multi_dataset_search_take_filters(http_api: tuple[httpx.Client, Shoal, Settings]) -> None:
    http, _, _ = http_api
    for name, index_type in (("fa", "flat"), ("fb", "hnsw")):
        r = http.post("/api/v1/datasets", json={"name": name, "dimensions": 2, "metric_type": "euclidean",
                                                "index_type": index_type})
        assert r.status_code == 201, r.text
        vectors = [{"id": f"{name}{i}", "values": [float(i), 0.0], "document_id": f"doc{i % 2}",
                    "metadata": {"lang": "en" if i % 2 else "de", "year": 2000 + i,
                                 "published": f"2024-0{1 + i % 5}-01T00:00:00Z"}} for i in range(10)]
        r = http.post(f"/api/v1/datasets/{name}/vectors", json={"vectors": vectors})
        assert r.status_code == 200, r.text

    def search(name: str, filters: Any, consistency: str = "strong") -> list[str]:
        r = http.post(f"/api/v1/datasets/{name}/search", json={"vector": [0.0, 0.0], "top_k": 3,
                                                               "consistency": consistency, "filters": filters})
        assert r.status_code == 200, r.text
        return [h["id"] for h in r.json()["results"]]

    assert search("fa", {"lang": "en"}) == ["fa1", "fa3", "fa5"]
    assert search("fa", {"metadata.year": {"$gte": 2004, "$lt": 2008}}) == ["fa4", "fa5", "fa6"]
    assert search("fa", {"$not": {"document_id": "doc0"}}) == ["fa1", "fa3", "fa5"]
    assert search("fb", {"id": {"$in": ["fb7", "fb2", "fb9"]}}) == ["fb2", "fb7", "fb9"]
    assert search("fb", {"published": {"$gte": "2024-04-01T00:00:00Z"}}) == ["fb3", "fb4", "fb8"]
    assert search("fb", {"$or": [{"lang": "de", "year": {"$gt": 2005}}, {"id": "fb1"}]}) == ["fb1", "fb6", "fb8"]
    assert search("fa", {"lang": "fr"}) == []
    assert search("fa", {}) == ["fa0", "fa1", "fa2"]
    # Integers of any size compare exactly with metadata numbers (a 401-digit one answered 500: it was checked
    # for finiteness as a float, which overflowed).
    huge = 10**400
    assert search("fa", {"year": {"$lt": huge}}) == ["fa0", "fa1", "fa2"]
    assert search("fa", {"year": {"$gt": -huge, "$lt": 2002}}) == ["fa0", "fa1"]
    assert search("fb", {"year": {"$in": [huge, 2003, 2001]}}) == ["fb1", "fb3"]
    assert search("fb", {"year": huge}) == [] and search("fb", {"year": {"$gte": huge}}) == []
    assert search("fb", {"year": {"$nin": [huge]}}) == ["fb0", "fb1", "fb2"]

    # Multi-dataset: options.filters applies to every dataset.
    body = {"query_vector": [0.0, 0.0], "datasets": ["fa", "fb"],
            "options": {"top_k": 2, "merge_strategy": "score", "consistency": "strong",
                        "filters": {"year": {"$gte": 2005}}}}
    r = http.post("/api/v1/search/multi-dataset", json=body)
    assert r.status_code == 200, r.text
    assert sorted((h["dataset_id"], h["id"]) for h in r.json()["results"]) == [
        ("fa", "fa5"), ("fb", "fb5")]

    # A lone surrogate, escaped in the JSON body, on an attribute (it answered 500) and on a metadata field.
    for flt, what in (('{"id": "\\ud800"}', "id"), ('{"lang": {"$in": ["en", "\\udc00"]}}', "lang")):
        r = http.post("/api/v1/datasets/fa/search", content='{"vector": [0, 0], "filters": ' + flt + "}",
                      headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error_code"] == "VALIDATION_ERROR", r.text
        assert f"'{what}'" in r.json()["message"] and "lone surrogate" in r.json()["message"], r.text

    # Nested past Python's stack (a 500 before), in either search.
    for deep in (nest("$or", 250), nest("$not", 340)):
        r = http.post("/api/v1/datasets/fa/search", json={"vector": [0.0, 0.0], "filters": deep})
        assert r.status_code == 400 and r.json()["error_code"] == "VALIDATION_ERROR", r.text
        assert "at most 32 levels deep" in r.json()["message"], r.text
        r = http.post("/api/v1/search/multi-dataset", json=body | {"options": body["options"] | {"filters": deep}})
        assert r.status_code == 400 and "at most 32 levels deep" in r.text, r.text

    # Bad filters: 400 VALIDATION_ERROR naming the attribute.
    for bad, what in (({"id": 3}, "id"), ({"lang": {"$like": "e%"}}, "lang"), ({"metadata": "x"}, "metadata")):
        r = http.post("/api/v1/datasets/fa/search", json={"vector": [0.0, 0.0], "filters": bad})
        assert r.status_code == 400 and r.json()["error_code"] == "VALIDATION_ERROR", r.text
        assert f"'{what}'" in r.json()["message"], r.text
        r = http.post("/api/v1/search/multi-dataset", json=body | {"options": body["options"] | {"filters": bad}})
        assert r.status_code == 400 and r.json()["details"]["field"] == "options.filters", r.text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_exact_scan_of_matching_rows_equals_brute_force(data: st.DataObject) -> None:
    """The scan a selective filter takes on HNSW and IVF (matching rows gathered once, float32 keys choosing
    the candidates within their rounding bound, a float64 rerank) gives the exact top k, ties by lower row, as
    brute force over the visible matching rows does: every inner-product metric, small and large subsets,
    exact duplicates (ties), rows hidden by the log tail, a zero query."""
    metric = data.draw(st.sampled_from([m for m in Metric if m is not Metric.MANHATTAN]), label="metric")
    m = data.draw(st.integers(1, 700), label="rows")
    k = data.draw(st.integers(1, 40), label="k")
    dim = data.draw(st.sampled_from([3, 16, 64]), label="dim")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    scale = data.draw(st.sampled_from([1e-3, 1.0, 1e4, 1e19]), label="scale")  # 1e19: float32 products overflow
    distinct = rng.standard_normal((max(1, m // data.draw(st.sampled_from([1, 3]), label="dup")), dim)) * scale
    vectors = distinct[rng.integers(0, len(distinct), m)].astype(np.float32)  # repeats: exact ties
    near = data.draw(st.booleans(), label="near ties")
    if near:
        # Repeats moved by about one float32 step: float32 keys cannot order them, float64 can.
        vectors = (vectors * (1 + rng.uniform(-4e-7, 4e-7, vectors.shape))).astype(np.float32)
    vectors[rng.random(m) < 0.02] = 0.0  # zero rows (cosine: distance 1 from every query)
    local = np.sort(rng.choice(5 * m, m, replace=False)).astype(np.int64)  # split-local rows, increasing
    hidden = rng.random(m) < data.draw(st.sampled_from([0.0, 0.3, 0.97]), label="hidden share")
    hidden = hidden if hidden.any() else None
    queries = np.vstack([vectors[rng.integers(0, m)], rng.standard_normal(dim) * scale,
                         np.zeros(dim)]).astype(np.float32)
    dist, labels = execute_module._exact_subset(metric, execute_module._subset_of(local, vectors), queries, k,
                                                hidden)
    visible = np.flatnonzero(~hidden) if hidden is not None else np.arange(m)
    want_d, want_l = summed_in_one_order(metric, queries, vectors[visible], k)
    want_rows = np.append(local[visible], -1)[want_l]  # label -1 (padding) picks the -1 appended
    if not near:
        assert labels.tolist() == want_rows.tolist()
    # Near ties can be genuine float64 ties (the query's own row and its copy one step away both at distance
    # ~0), which two formulas may order either way: there, the rows found must be as near as brute force's,
    # by brute force's own distances, to float64 rounding (a row one float32 step farther is not).
    found = np.where(labels >= 0, np.searchsorted(local, labels), -1)
    assert ((found >= 0) == (want_l >= 0)).all()
    brute_d = exact_distances(metric, queries, vectors)
    tight = 1e-12 * dim * max(1.0, scale) ** 2  # float64 rounding of d-term products, with room to spare
    for i in range(len(queries)):
        rows = found[i][found[i] >= 0]
        assert len(set(rows.tolist())) == len(rows) and (hidden is None or not hidden[rows].any())
        np.testing.assert_allclose(brute_d[i, rows], want_d[i, : len(rows)], rtol=1e-12,
                                   atol=np.sqrt(tight) if metric is Metric.EUCLIDEAN else tight)
    # The distances returned agree to float64 rounding, which for the L2 metrics is relative to the squared
    # norms (a point's distance to itself cancels |q|^2 + |v|^2 - 2 q.v).
    atol = 1e-6 * max(1.0, scale) ** (1 if metric is Metric.EUCLIDEAN else 2)
    with np.errstate(over="ignore"):  # distances past float32's range are inf on both sides
        want32 = want_d.astype(np.float32)
    np.testing.assert_allclose(dist, want32, rtol=1e-6, atol=atol)


def test_metadata_fields_named_once_are_not_kept(http_api: tuple[httpx.Client, Shoal, Settings]) -> None:
    """A metadata field a filter names once is read for that search and dropped: every new field name used to
    stay with the segment for good (half a megabyte per name over 20,000 rows, outside the memory budget). A
    field filtered on again is kept (bounded, as masks are), and answers the same."""
    from shoal.searcher import json_fields

    http, shoal, _ = http_api
    r = http.post("/api/v1/datasets", json={"name": "meta", "dimensions": 2, "metric_type": "euclidean",
                                            "index_type": "flat"})
    assert r.status_code == 201, r.text
    vectors = [{"id": f"v{i}", "values": [float(i), 0.0], "metadata": {f"user_{j}": i % (j + 2) for j in range(40)}}
               for i in range(300)]
    assert http.post("/api/v1/datasets/meta/vectors", json={"vectors": vectors}).status_code == 200
    assert http.post("/api/v1/datasets/meta/reindex?async=false", json={}).status_code in (200, 202)

    def search(filters: Any) -> list[str]:
        r = http.post("/api/v1/datasets/meta/search", json={"vector": [0.0, 0.0], "top_k": 3, "filters": filters})
        assert r.status_code == 200, r.text
        return [h["id"] for h in r.json()["results"]]

    json_fields.FIELDS.clear()
    for j in range(40):  # each field once: read, answered, dropped
        assert search({f"user_{j}": 1}) == [f"v{i}" for i in range(300) if i % (j + 2) == 1][:3]
    assert json_fields.FIELDS.nbytes == 0
    assert search({"user_3": 2}) == ["v2", "v7", "v12"]  # a field again: kept from now on
    assert json_fields.FIELDS.nbytes > 0
    assert search({"user_3": {"$gte": 4}}) == ["v4", "v9", "v14"]
