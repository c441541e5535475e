"""Where Shoal's Vektonn-compatible routes answered otherwise than Vektonn does (source: vektonn/vektonn), over
real HTTP (a served uvicorn app, the session's Postgres): an empty upload, numbers written as strings, empty
sparse vectors, a token sent with a consistency level, a metric beside a Vektonn index type, and an upload right
after its data source was made again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from conftest import serve_api

from shoal import DataPoint, DataSourceSpec, Shoal, SparseVector
from shoal.config.settings import Settings
from shoal.errors import IndexDefinitionError, ValidationError
from shoal.log.records import IndexSpec
from shoal.vektonn.search_json import decode_search

TOKEN = "X-Shoal-Write-Token"


def dense(i: Any, vector: list[float], **values: dict[str, Any]) -> dict[str, Any]:
    attributes = {"id": {"int64": i}, **values}
    return {"attributes": [{"key": k, "value": v} for k, v in attributes.items()],
            "vector": {"isSparse": False, "coordinates": vector}}


def sparse(i: int, indices: list[int], values: list[float]) -> dict[str, Any]:
    return {"attributes": [{"key": "id", "value": {"int64": i}}],
            "vector": {"isSparse": True, "coordinates": values, "coordinateIndices": indices}}


def ids(response: httpx.Response) -> list[list[int]]:
    assert response.status_code == 200, response.text
    return [[p["attributes"][0]["value"]["int64"] for p in r["nearestDataPoints"]] for r in response.json()]


def test_an_empty_upload_answers_200_with_the_head_and_writes_nothing(served: tuple[str, Settings]) -> None:
    """Vektonn's upload route validates each point of the array and produces them: an empty array is 200 with
    nothing written. Shoal answered 400 "batch is empty". Now 200, with the data source's head as the token
    (a search at it reflects every write so far); the Python producer still refuses an empty batch."""
    url, settings = served
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(DataSourceSpec("Empty", "1", 2, {"id": "int64"}, ["id"]))
        r = http.post("/api/v1/upload/Empty/1", json=[])
        assert (r.status_code, r.content, r.headers[TOKEN]) == (200, b"", "0"), r.text
        assert http.post("/api/v1/upload/Empty/1", json=[dense(1, [0, 1]), dense(2, [1, 0])]).status_code == 200
        r = http.post("/api/v1/upload/Empty/1", json=[], headers={"Idempotency-Key": "nothing"})
        assert (r.status_code, r.headers[TOKEN]) == (200, "2"), r.text
        assert shoal.get_data_source("Empty", "1").head_seq == 2
        assert http.post("/api/v1/upload/Nope/1", json=[]).status_code == 404  # an unknown source stays 404
        with pytest.raises(ValidationError, match="batch is empty"):
            shoal.producer("Empty", "1").upload([])


def test_numbers_written_as_strings_are_read_as_vektonn_reads_them(served: tuple[str, Settings]) -> None:
    """Vektonn's HttpJson reads numbers from JSON strings (NumberHandling.AllowReadingFromString): an int64 given
    as "9007199254740993" (past a double's exact integers), a float64 as "2.5e1", k as "2". They were refused
    (400); now they are read, with the same range checks, and a string that spells no number is still refused."""
    url, settings = served
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(DataSourceSpec("Strings", "1", 2, {"id": "int64", "score": "float64"}, ["id"]))
        shoal.create_index(IndexSpec("Strings.Index", "1", "Strings", "1", algorithm="FaissIndex.L2"))
        big = 9007199254740993
        r = http.post("/api/v1/upload/Strings/1", json=[dense(str(big), [0, 1], score={"float64": "2.5e1"}),
                                                        dense("-4", [5, 5], score={"float64": "7"})])
        assert r.status_code == 200, r.text
        query = {"k": "2", "queryVectors": [{"isSparse": False, "coordinates": [0, 1]}]}
        r = http.post("/api/v1/search/Strings.Index/1", json=query, headers={"X-Shoal-Consistency": "strong"})
        assert r.status_code == 200, r.text
        assert [[(a["value"].get("int64"), a["value"].get("float64")) for a in p["attributes"]]
                for p in r.json()[0]["nearestDataPoints"]] == [[(big, None), (None, 25.0)], [(-4, None), (None, 7.0)]]
        for body, says in (
            ([dense(str(2**63), [0, 0], score={"float64": 1})], "int64 value out of range"),
            ([dense("1.0", [0, 0], score={"float64": 1})], "int64 value must be a JSON integer, got string '1.0'"),
            ([dense(True, [0, 0], score={"float64": 1})], "int64 value must be a JSON integer, got boolean"),
            ([dense(1, [0, 0], score={"float64": "NaN"})], "float64 value must be a JSON number, got string 'NaN'"),
            ([dense(1, [0, 0], score={"float64": "Infinity"})], "float64 value must be a JSON number, got string"),
        ):
            r = http.post("/api/v1/upload/Strings/1", json=body)
            assert r.status_code == 400 and says in r.json()["errorMessages"][0], (body, r.text)
        for k, says in (("two", "k must be a JSON integer, got string 'two'"), ("0", "k must be a positive"),
                        ("1.5", "k must be a JSON integer, got string"),
                        (True, "k must be a JSON integer, got boolean")):
            r = http.post("/api/v1/search/Strings.Index/1", json={**query, "k": k})
            assert r.status_code == 400 and says in r.json()["errorMessages"][0], (k, r.text)
        assert shoal.get_data_source("Strings", "1").head_seq == 2
    assert decode_search(b'{"k": "+3", "queryVectors": []}').k == 3


def test_empty_sparse_vectors_are_refused_by_the_vektonn_routes_only(served: tuple[str, Settings]) -> None:
    """Vektonn's SparseVectorValidator refuses a sparse vector without coordinates ("Vector must have
    coordinates"), in an upload and as a query. Shoal stored it, and answered such a query with every point at
    distance 1. Now both are 400 naming the point; the Python API still takes an all-zero sparse vector."""
    url, settings = served
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(DataSourceSpec("Words", "1", 5, {"id": "int64"}, ["id"], vectors_are_sparse=True))
        shoal.create_index(IndexSpec("Words.Index", "1", "Words", "1", algorithm="SparnnIndex.Cosine"))
        r = http.post("/api/v1/upload/Words/1", json=[sparse(1, [1], [1.0]), sparse(2, [], [])])
        assert r.status_code == 400, r.text
        assert r.json()["errorMessages"] == [
            "invalid input, nothing written: point 1, attribute 'vector': a sparse vector must have at least one "
            "coordinate"]
        assert shoal.get_data_source("Words", "1").head_seq == 0
        assert http.post("/api/v1/upload/Words/1", json=[sparse(1, [1], [1.0])]).status_code == 200
        strong = {"X-Shoal-Consistency": "strong"}
        r = http.post("/api/v1/search/Words.Index/1", headers=strong, json={"k": 5, "queryVectors": [
            {"isSparse": True, "coordinates": [1.0], "coordinateIndices": [1]},
            {"isSparse": True, "coordinates": [], "coordinateIndices": []}]})
        assert r.status_code == 400 and "point 1, attribute 'queryVectors': a sparse vector must have at least one " \
            "coordinate" in r.json()["errorMessages"][0], r.text
        # The Python API keeps its rule: an all-zero sparse vector is a data point.
        shoal.producer("Words", "1").upload([DataPoint({"id": 2}, SparseVector([], []))])
        r = http.post("/api/v1/search/Words.Index/1", headers=strong, json={"k": 5, "queryVectors": [
            {"isSparse": True, "coordinates": [1.0], "coordinateIndices": [1]}]})
        assert ids(r) == [[1, 2]]


def test_a_required_token_holds_at_every_consistency_level(make_settings: Callable[..., Settings]) -> None:
    """X-Shoal-Required-Token was ignored unless the level was absent or at_least: with `eventual` the search
    answered from what the searcher held (missing the write the token names) and a token past the log head was
    never checked. Now, as the dataset API reads `min_write_token`, eventual with a token searches at least to
    it (a token past the head is refused), and strong, which reflects every committed write, stays strong."""
    settings = make_settings("local", searcher_poll_s=3600)  # the API's searcher refreshes by no poll meanwhile
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    query = {"k": 5, "queryVectors": [{"isSparse": False, "coordinates": [0, 0]}]}
    with Shoal(settings, notify=False) as shoal, serve_api(settings) as url, httpx.Client(base_url=url) as http:
        shoal.create_data_source(DataSourceSpec("Tok", "1", 2, {"id": "int64"}, ["id"]))
        shoal.create_index(IndexSpec("Tok.Index", "1", "Tok", "1", algorithm="FaissIndex.L2"))
        first = shoal.producer("Tok", "1").upload([DataPoint({"id": 1}, [0.0, 0.0])]).seq
        assert ids(http.post("/api/v1/search/Tok.Index/1", json=query,
                             headers={"X-Shoal-Required-Token": str(first)})) == [[1]]  # the API loads the index
        # Written by another process (this client): the API's searcher is not told.
        later = shoal.producer("Tok", "1").upload([DataPoint({"id": 2}, [1.0, 0.0])]).seq
        eventual = {"X-Shoal-Consistency": "eventual", "X-Shoal-Required-Token": str(later)}
        assert ids(http.post("/api/v1/search/Tok.Index/1", json=query, headers=eventual)) == [[1, 2]]
        r = http.post("/api/v1/search/Tok.Index/1", json=query, headers={**eventual,
                                                                         "X-Shoal-Required-Token": str(later + 5)})
        assert r.status_code == 400 and f"write token {later + 5} is past the log head {later}" in r.text, r.text
        strong = {"X-Shoal-Consistency": "strong", "X-Shoal-Required-Token": str(later)}
        assert ids(http.post("/api/v1/search/Tok.Index/1", json=query, headers=strong)) == [[1, 2]]
        for bad in ({"X-Shoal-Consistency": "strong", "X-Shoal-Required-Token": "x"},
                    {"X-Shoal-Consistency": "Strong", "X-Shoal-Required-Token": "1"},
                    {"X-Shoal-Consistency": "at_least"}):
            assert http.post("/api/v1/search/Tok.Index/1", json=query, headers=bad).status_code == 400, bad


def test_a_metric_that_contradicts_a_vektonn_type_is_refused(served: tuple[str, Settings]) -> None:
    """A Vektonn index type carries its metric (FaissIndex.L2: l2_squared, SparnnIndex.Cosine: cosine). Another
    metric given beside it was silently replaced (HTTP: 201 with the type's metric; Python: stored as the
    type's), where README promises a metric is refused, never silently replaced, and the CLI refuses it. Over
    HTTP any metric but the type's is refused; a Python IndexSpec cannot tell its default (cosine) from a
    metric given, so there the default alone is still replaced."""
    url, settings = served
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(DataSourceSpec("Met", "1", 2, {"id": "int64"}, ["id"]))
        shoal.create_data_source(DataSourceSpec("MetS", "1", 8, {"id": "int64"}, ["id"], vectors_are_sparse=True))

        def create(name: str, source: str, algorithm: str, **extra: Any) -> httpx.Response:
            return http.post("/api/v1/indexes", json={"name": name, "version": "1", "dataSourceName": source,
                                                      "dataSourceVersion": "1", "algorithm": algorithm, **extra})

        for name, source, algorithm, metric in (("H1", "MetS", "SparnnIndex.Cosine", "euclidean"),
                                                ("H2", "Met", "FaissIndex.L2", "cosine"),
                                                ("H3", "Met", "FaissIndex.IP", "l2_squared")):
            r = create(name, source, algorithm, metric=metric)
            assert r.status_code == 400, r.text
            assert f"the Vektonn type {algorithm} carries its own metric" in r.json()["errorMessages"][0]
            assert f"not '{metric}'" in r.json()["errorMessages"][0]
        assert http.get("/api/v1/indexes").json() == []
        assert create("Ok1", "Met", "FaissIndex.L2", metric="l2_squared").json()["metric"] == "l2_squared"
        assert create("Ok2", "Met", "FaissIndex.IP").json()["metric"] == "dot_product"
        assert create("Ok3", "Met", "flat").json()["metric"] == "cosine"  # no metric: the default, as before
        assert create("Ok4", "Met", "flat", metric="manhattan").json()["metric"] == "manhattan"

        with pytest.raises(IndexDefinitionError, match="SparnnIndex.Cosine carries its own metric"):
            shoal.create_index(IndexSpec("P1", "1", "MetS", "1", algorithm="SparnnIndex.Cosine", metric="manhattan"))
        with pytest.raises(IndexDefinitionError, match="FaissIndex.L2 carries its own metric"):
            shoal.create_index(IndexSpec("P2", "1", "Met", "1", algorithm="FaissIndex.L2", metric="dot_product"))
        assert shoal.create_index(IndexSpec("P3", "1", "Met", "1", algorithm="FaissIndex.L2")).spec.metric == \
            "l2_squared"


def test_an_upload_right_after_its_source_was_made_again_meets_the_new_definition(
    served: tuple[str, Settings], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The route reuses a data source's definition for up to SOURCE_TTL_S: right after another process dropped
    the source and made it again with another dimension, a batch valid for the new definition was refused 400
    against the old one. It is now checked against the definition the catalog holds, and written."""
    from shoal import runtime

    monkeypatch.setattr(runtime, "SOURCE_TTL_S", 600.0)  # the route surely reuses the first definition
    url, settings = served
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        shoal.create_data_source(DataSourceSpec("Remade", "1", 2, {"id": "int64"}, ["id"]))
        assert http.post("/api/v1/upload/Remade/1", json=[dense(1, [1, 2])]).status_code == 200
        shoal.drop_data_source("Remade", "1")
        shoal.create_data_source(DataSourceSpec("Remade", "1", 3, {"id": "int64"}, ["id"]))
        r = http.post("/api/v1/upload/Remade/1", json=[dense(2, [1, 2, 3])])
        assert (r.status_code, r.headers.get(TOKEN)) == (200, "1"), r.text
        r = http.post("/api/v1/upload/Remade/1", json=[dense(3, [1, 2])])
        assert r.status_code == 400 and "wrong dimension: expected 3, got 2" in r.text, r.text
        assert shoal.get_data_source("Remade", "1").head_seq == 1


def test_a_reindex_to_a_vektonn_type_takes_that_type_s_metric(local_shoal: Shoal) -> None:
    """A reindex to a Vektonn type without a metric takes the type's (FaissIndex.IP: dot_product) rather than
    inheriting the index's own, which the type would contradict: it was refused as a metric the caller never
    gave. A metric given that contradicts the type is still refused."""
    shoal = local_shoal
    shoal.create_data_source(DataSourceSpec("Re", "1", 2, {"id": "int64"}, ["id"]))
    shoal.producer("Re", "1").upload([DataPoint({"id": i}, [float(i), 1.0]) for i in range(20)])
    shoal.create_index(IndexSpec("RI", "1", "Re", "1", algorithm="FaissIndex.L2"))
    with pytest.raises(IndexDefinitionError, match="FaissIndex.IP carries its own metric"):
        shoal.reindex("RI", "1", algorithm="FaissIndex.IP", metric="l2_squared")
    job = shoal.reindex("RI", "1", algorithm="FaissIndex.IP", wait=True)
    assert job.state == "swapped", job
    assert shoal.get_index("RI", "1").spec.metric == "dot_product"
