"""Vektonn's quick start over real HTTP: a served uvicorn app, Vektonn's JSON, Vektonn's answers."""

from __future__ import annotations

import socket
from collections.abc import Callable

import httpx
import numpy as np
import pyarrow as pa
import pytest
from conftest import serve_api

from shoal import DataPoint, DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.index.builder import ShardBuilder
from shoal.log.records import IndexSpec


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def point(i: int, payload: str, vector: list[float]) -> dict[str, object]:
    return {
        "attributes": [{"key": "id", "value": {"int64": i}}, {"key": "payload", "value": {"string": payload}}],
        "vector": {"isSparse": False, "coordinates": vector},
    }


def test_vektonn_quick_start_over_http(served: tuple[str, Settings]) -> None:
    url, settings = served
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(
            DataSourceSpec("QuickStart.Source", "1.0", 2, {"id": "int64", "payload": "string"}, ["id"])
        )
        index = shoal.create_index(IndexSpec("QuickStart.Index", "1.0", "QuickStart.Source", "1.0",
                                             algorithm="FaissIndex.L2"))
        with httpx.Client(base_url=url, timeout=30) as http:
            r = http.post("/api/v1/upload/QuickStart.Source/1.0", json=[
                point(1, "first data point", [0.0, 1.0]),
                point(2, "second data point", [1.0, 0.0]),
                point(3, "third data point", [-0.5, 0.0]),
            ])
            assert (r.status_code, r.content) == (200, b"")
            token = int(r.headers["X-Shoal-Write-Token"])
            assert token == 3
            for shard in index.shards:
                ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)

            query = {"k": 2, "queryVectors": [{"isSparse": False, "coordinates": [0.0, 2.0]}], "retrieveVectors": True}
            r = http.post("/api/v1/search/QuickStart.Index/1.0", json=query)
            assert r.status_code == 200, r.text
            [result] = r.json()
            assert result["queryVector"] == {"isSparse": False, "coordinates": [0.0, 2.0]}
            assert [(p["distance"], p["attributes"][1]["value"]["string"]) for p in result["nearestDataPoints"]] == [
                (1.0, "first data point"), (4.25, "third data point")
            ]
            first = result["nearestDataPoints"][0]
            assert list(first) == ["vector", "attributes", "distance"]
            assert list(first["vector"]) == ["isSparse", "coordinates"]  # null coordinateIndices left out
            assert first["attributes"][0] == {"key": "id", "value": {"int64": 1}}
            assert first["vector"]["coordinates"] == [0.0, 1.0]

            # GET with a body, keys in any case, as Vektonn's clients may send them.
            r = http.request("GET", "/api/v1/search/QuickStart.Index/1.0",
                             json={"K": 1, "QueryVectors": [{"IsSparse": False, "Coordinates": [0.0, 2.0]}]})
            assert r.status_code == 200, r.text
            assert [p["distance"] for p in r.json()[0]["nearestDataPoints"]] == [1.0]
            assert "vector" not in r.json()[0]["nearestDataPoints"][0]

            # A tombstone removes a point; the write token lets the search see it before any worker runs.
            r = http.post("/api/v1/upload/QuickStart.Source/1.0",
                          json=[{"attributes": [{"key": "id", "value": {"int64": 1}}], "isDeleted": True}])
            assert r.status_code == 200
            deleted = int(r.headers["X-Shoal-Write-Token"])
            r = http.post("/api/v1/search/QuickStart.Index/1.0", json=query,
                          headers={"X-Shoal-Required-Token": str(deleted)})
            assert [p["distance"] for p in r.json()[0]["nearestDataPoints"]] == [4.25, 5.0]

            # A token no upload gave (past the head) is refused, and leaves read-your-writes working: before, the
            # searcher read the log "up to" it and then took every later write as already covered.
            for invented in (deleted + 1, 2**63 - 1):
                r = http.post("/api/v1/search/QuickStart.Index/1.0", json=query,
                              headers={"X-Shoal-Required-Token": str(invented)})
                assert r.status_code == 400, r.text
                assert r.json()["errorMessages"] == [
                    f"invalid query: write token {invented} is past the log head {deleted}: a write token comes "
                    f"from an upload to this data source"]
            r = http.post("/api/v1/upload/QuickStart.Source/1.0", json=[point(4, "fourth data point", [0.0, 2.5])])
            later = {"X-Shoal-Required-Token": r.headers["X-Shoal-Write-Token"]}
            for headers in (later, {"X-Shoal-Consistency": "strong"}):
                r = http.post("/api/v1/search/QuickStart.Index/1.0", json=query, headers=headers)
                assert [p["distance"] for p in r.json()[0]["nearestDataPoints"]] == [0.25, 4.25], headers


def test_a_search_that_could_return_too_many_hits_is_refused(make_settings: Callable[..., Settings]) -> None:
    """Vektonn's k has no bound, so one search of many query vectors with a huge k would make every row a hit
    of every query (1,000 x 59,004 rows: about 18 GB held). Over HTTP a search may return at most
    SHOAL_MAX_SEARCH_HITS hits, k counted up to the rows the index holds: a k past every row stays fine where
    the rows are few, built ones and log-tail ones alike."""
    settings = make_settings("local", max_search_hits=50)
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    with Shoal(settings, notify=False) as shoal, serve_api(settings) as url:
        shoal.create_data_source(DataSourceSpec("Many", "1", 2, {"id": "int64", "payload": "string"}, ["id"]))
        index = shoal.create_index(IndexSpec("Many.Index", "1", "Many", "1", algorithm="FaissIndex.L2"))
        producer = shoal.producer("Many", "1")
        token = producer.upload_columns(np.arange(40, dtype=np.float32).reshape(20, 2),
                                        {"id": np.arange(20), "payload": pa.array(["p"] * 20)}).seq
        for shard in index.shards:
            ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)

        def search(queries: int, k: int, **headers: str) -> httpx.Response:
            body = {"k": k, "queryVectors": [{"coordinates": [0.0, 1.0]}] * queries}
            return httpx.post(f"{url}/api/v1/search/Many.Index/1", json=body, headers=headers, timeout=30)

        built = {"X-Shoal-Required-Token": str(token)}
        for queries, k, hits in ((1, 2**31 - 1, 20), (2, 10**9, 40), (5, 10, 50)):
            r = search(queries, k, **built)
            assert r.status_code == 200, r.text
            assert sum(len(q["nearestDataPoints"]) for q in r.json()) == hits
        for queries, k, message in (
            (3, 10**9, "the search could return 60 hits (3 query vectors x 20: k 1,000,000,000, at most every row)"),
            (6, 10, "the search could return 60 hits (6 query vectors x k 10)"),
        ):
            r = search(queries, k, **built)
            assert r.status_code == 400, r.text
            assert r.json()["errorMessages"] == [
                f"invalid query: {message}, more than the 50 a search may (SHOAL_MAX_SEARCH_HITS): ask for a smaller "
                f"k or fewer query vectors"]
        # The log tail's rows count too: with 6 more (26 rows), two queries may no longer ask for every row.
        later = producer.upload_columns(np.zeros((6, 2), np.float32),
                                        {"id": np.arange(20, 26), "payload": pa.array(["q"] * 6)}).seq
        r = search(2, 10**9, **{"X-Shoal-Required-Token": str(later)})
        assert r.status_code == 400 and "could return 52 hits" in r.json()["errorMessages"][0], r.text
        r = search(1, 10**9, **{"X-Shoal-Consistency": "strong"})
        assert r.status_code == 200 and len(r.json()[0]["nearestDataPoints"]) == 26


def test_strong_after_a_drop_and_a_new_index_under_the_name_answers_the_new_one(
        make_settings: Callable[..., Settings]) -> None:
    """The API's searcher serves an index; another process drops it with its data source and makes them again
    under the same names, and the drop's announcement never arrives (no broker; no poll within the test). A
    strong search answers the new index's points at once: it found the old data source gone and reloaded, where
    it answered 404 "data source N not found" before. Dropped for good, the index answers 404."""
    settings = make_settings("local", searcher_poll_s=3600)
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    strong = {"X-Shoal-Consistency": "strong"}
    query = {"k": 10, "queryVectors": [{"coordinates": [0.0, 0.0]}]}

    def make(shoal: Shoal, first: int) -> None:
        shoal.create_data_source(DataSourceSpec("Again", "1", 2, {"id": "int64", "payload": "string"}, ["id"]))
        shoal.create_index(IndexSpec("Again.Index", "1", "Again", "1", algorithm="FaissIndex.L2"))
        shoal.producer("Again", "1").upload([DataPoint({"id": first + i, "payload": "p"}, [float(i), 0.0])
                                             for i in range(3)])

    with Shoal(settings, notify=False) as shoal, serve_api(settings) as url, httpx.Client(base_url=url) as http:
        def ids() -> list[int]:
            r = http.post("/api/v1/search/Again.Index/1", json=query, headers=strong, timeout=30)
            assert r.status_code == 200, r.text
            return [p["attributes"][0]["value"]["int64"] for p in r.json()[0]["nearestDataPoints"]]

        make(shoal, 0)
        assert ids() == [0, 1, 2]
        shoal.drop_index("Again.Index", "1")
        shoal.drop_data_source("Again", "1")
        make(shoal, 100)
        assert ids() == [100, 101, 102]
        assert http.post("/api/v1/search/Again.Index/1", json=query).status_code == 200  # eventual: the new one
        shoal.drop_index("Again.Index", "1")
        shoal.drop_data_source("Again", "1")
        r = http.post("/api/v1/search/Again.Index/1", json=query, headers=strong, timeout=30)
        assert r.status_code == 404 and "not found" in r.json()["errorMessages"][0], r.text


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/api/v1/upload/Nope/1.0", [point(1, "x", [0, 0])], 404, "not found"),
        ("/api/v1/upload/QS/1", [point(1, "x", [0, 0, 0])], 400, "point 0, attribute 'vector': wrong dimension"),
        ("/api/v1/upload/QS/1", [point(1, "x", [0, 0]), {"attributes": [{"key": "id", "value": {"string": "1"}}],
                                                       "vector": {"coordinates": [0, 0]}}],
         400, "point 1, attribute 'id': expected a int64 value, got string"),
        ("/api/v1/upload/QS/1", [{"attributes": [{"key": "id", "value": {"int64": 1, "string": "x"}}]}], 400,
         "exactly one of"),
        ("/api/v1/search/QS.Index/1", {"k": 0, "queryVectors": [{"coordinates": [0, 0]}]}, 400, "k must be"),
        ("/api/v1/search/QS.Index/1", {"k": 1, "queryVectors": []}, 400, "at least one query vector"),
        ("/api/v1/search/QS.Index/1", {"k": 1, "queryVectors": [{"coordinates": [0, 0, 1]}]}, 400, "dimension"),
        ("/api/v1/search/QS.Index/1", {"k": 1, "queryVectors": [{"coordinates": [0, 0]}, {"coordinates": [0, -1e39]}]},
         400, "query coordinates must be finite float32 values: -1e+39 at index 1 is past float32's range"),
        ("/api/v1/search/QS.Index/1", {"k": 1, "queryVectors": [{"isSparse": True, "coordinates": [1],
                                                                   "coordinateIndices": [0]}]}, 400, "dense vectors"),
        ("/api/v1/search/QS.Index/1", {"k": 1, "queryVectors": [{"coordinates": [0, 0]}],
                                        "splitFilter": [{"key": "payload", "value": {"string": "x"}}]},
         400, "split filter key is not a split attribute"),
        ("/api/v1/search/Nope/1", {"k": 1, "queryVectors": [{"coordinates": [0, 0]}]}, 404, "not found"),
    ],
)
def test_bad_requests_get_vektonn_errors_and_write_nothing(
    served: tuple[str, Settings], path: str, body: object, status: int, message: str
) -> None:
    url, settings = served
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(DataSourceSpec("QS", "1", 2, {"id": "int64", "payload": "string"}, ["id"]))
        shoal.create_index(IndexSpec("QS.Index", "1", "QS", "1", algorithm="FaissIndex.L2"))
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code == status, r.text
        assert any(message in m for m in r.json()["errorMessages"]), r.json()
        assert shoal.get_data_source("QS", "1").head_seq == 0
