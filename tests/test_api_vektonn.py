"""Vektonn's quick start over real HTTP: a served uvicorn app, Vektonn's JSON, Vektonn's answers."""

from __future__ import annotations

import socket

import httpx
import pytest

from shoal import DataSourceSpec, Shoal
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
