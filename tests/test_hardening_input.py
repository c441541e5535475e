"""Issue 13, items 9-12: hostile input through the real served API answers 4xx naming what is wrong (the limit
and its setting, or the field), and writes nothing: the head stays where it was and every list still answers.

Each test keeps the shape of the issue's repro: the same bodies, sent over real sockets to a served app.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import socket
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pyarrow as pa
import pytest
from conftest import serve_api

from shoal import DataSourceSpec, Shoal
from shoal.config.settings import Settings
from shoal.log.records import IndexSpec

DENSE = DataSourceSpec("Hard.Source", "1", 2, {"id": "int64", "text": "string", "at": "datetime", "flag": "bool"},
                       ["id"])
SPARSE = DataSourceSpec("Hard.Sparse", "1", 8, {"id": "int64"}, ["id"], vectors_are_sparse=True)
DENSE_INDEX = IndexSpec("Hard.Index", "1", "Hard.Source", "1", algorithm="flat", metric="euclidean")
SPARSE_INDEX = IndexSpec("Hard.SparseIndex", "1", "Hard.Sparse", "1", algorithm="SparnnIndex.Cosine")
UPLOAD = "/api/v1/upload/Hard.Source/1"
SEARCH = "/api/v1/search/Hard.Index/1"
STRONG = {"X-Shoal-Consistency": "strong"}


def point(i: int, *, text: str = "t", at: str = "2024-01-02T03:04:05Z", **extra: Any) -> dict[str, Any]:
    return {
        "attributes": [
            {"key": "id", "value": {"int64": i}}, {"key": "text", "value": {"string": text}},
            {"key": "at", "value": {"dateTime": at}}, {"key": "flag", "value": {"bool": True}},
        ],
        "vector": {"isSparse": False, "coordinates": [float(i), 1.0]},
        **extra,
    }


def query(n: int = 1, **extra: Any) -> dict[str, Any]:
    return {"k": 2, "queryVectors": [{"isSparse": False, "coordinates": [0.0, 1.0]}] * n, **extra}


def raw(value: Any) -> bytes:
    """JSON as a client may send it: non-ASCII escaped, so a lone surrogate travels as the text `\\ud800`
    (httpx's own encoder would fail on it before sending)."""
    return json.dumps(value).encode()


def arrow_point(at: pa.Array) -> bytes:
    """An Arrow IPC upload body of one point of DENSE with `at` as its datetime column."""
    table = pa.table({"vector": pa.array([[0.5, 0.5]], pa.list_(pa.float32(), 2)), "id": pa.array([7]),
                      "text": pa.array(["t"]), "at": at, "flag": pa.array([True])})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def arrow_vector(vector: list[float]) -> bytes:
    """An Arrow IPC upload body of one point of DENSE with `vector`."""
    table = pa.table({"vector": pa.array([vector], pa.list_(pa.float32(), 2)), "id": pa.array([7]),
                      "text": pa.array(["t"]), "at": pa.array([dt.datetime(2024, 1, 1, tzinfo=dt.UTC)]),
                      "flag": pa.array([True])})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


# 9999-12-31T23:59:59-14:00, as an Arrow timestamp in that zone: 10000-01-01T13:59:59 in UTC.
LATE = (dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.timezone(-dt.timedelta(hours=14)))
        - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(microseconds=1)
ARROW = {"Content-Type": "application/vnd.apache.arrow.stream"}


def messages(r: httpx.Response) -> str:
    """All error text of an answer in either shape."""
    body = r.json()
    return " ".join(body["errorMessages"]) if "errorMessages" in body else f"{body['message']} {body['details']}"


class Api:
    """A served API with one dense and one sparse data source (each with an index), for a fresh anonymous
    tenant; `unchanged()` checks that nothing was written since `setup`."""

    def __init__(self, url: str, settings: Settings) -> None:
        self.settings = settings
        self.http = httpx.Client(base_url=url, timeout=60)
        with Shoal(settings, notify=False) as shoal:
            for spec in (DENSE, SPARSE):
                shoal.create_data_source(spec)
            for index in (DENSE_INDEX, SPARSE_INDEX):
                shoal.create_index(index)
        r = self.http.post(UPLOAD, json=[point(1), point(2)])
        assert r.status_code == 200, r.text
        r = self.http.post("/api/v1/datasets", json={"name": "docs", "dimensions": 2, "metadata": {"v": 1}})
        assert r.status_code == 201, r.text
        self.heads = self._heads()

    def _heads(self) -> dict[str, Any]:
        heads: dict[str, Any] = {}
        for path in ("/api/v1/data-sources/Hard.Source/1", "/api/v1/data-sources/Hard.Sparse/1",
                     "/api/v1/data-sources/docs/1"):
            r = self.http.get(path)
            assert r.status_code == 200, r.text
            heads[path] = r.json()["head"]
        r = self.http.get("/api/v1/data-sources")
        assert r.status_code == 200, r.text
        heads["sources"] = sorted((s["name"], s["version"], s["head"]) for s in r.json())
        r = self.http.get("/api/v1/datasets")
        assert r.status_code == 200, r.text
        heads["datasets"] = [(d["name"], d["metadata"], d["description"]) for d in r.json()["datasets"]]
        return heads

    def unchanged(self) -> None:
        """Nothing was written: every head, the data-source list and the dataset list as they were (and both
        lists still answer 200)."""
        assert self._heads() == self.heads


@pytest.fixture
def serve(make_settings: Callable[..., Settings]) -> Iterator[Callable[..., Api]]:
    """Serve the API for a fresh anonymous tenant with some settings changed; the Api over it."""
    with contextlib.ExitStack() as stack:

        def start(**overrides: Any) -> Api:
            settings = make_settings("local")
            settings = settings.model_copy(update={"anonymous_tenant": settings.tenant, **overrides})
            api = Api(stack.enter_context(serve_api(settings)), settings)
            stack.callback(api.http.close)
            return api

        yield start


def _declared_only(url: str, path: str, length: int) -> tuple[int, str]:
    """Send a request's head declaring `length` body bytes and none of them; the status and body of the answer,
    which must come without the server waiting for the body."""
    parts = urllib.parse.urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
        head = (f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {length}\r\n\r\n")
        sock.sendall(head.encode())
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _content_length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2].decode()


def _content_length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 30


# -- 9. bodies are limited before they are parsed; query vectors per search are limited ---------------------


LIMIT = 64 * 1024


def test_bodies_are_limited_before_parsing_and_query_vectors_per_search(serve: Callable[..., Api]) -> None:
    api = serve(max_body_bytes=LIMIT, max_query_vectors=10, max_batch_points=100)
    http = api.http

    def too_large(r: httpx.Response) -> str:
        assert r.status_code == 413, (r.status_code, r.text[:300])
        text = messages(r)
        assert "SHOAL_MAX_BODY_BYTES" in text and str(LIMIT) in text, text
        return text

    big_upload = raw([point(i, text="x" * 200) for i in range(1000, 1400)])  # ~140 KB, 400 points
    assert len(big_upload) > LIMIT
    # Content-Length over the limit: refused before a byte of the body is read, on every route that takes one.
    url = str(http.base_url).rstrip("/")
    for path in (UPLOAD, SEARCH, "/api/v1/datasets/docs/vectors", "/api/v1/data-sources"):
        # A server waiting for the body would leave the socket's timeout (10 s) to end the read: an error.
        status, body = _declared_only(url, path, 50_000_000)
        assert status == 413, (path, status, body)
        assert "SHOAL_MAX_BODY_BYTES" in body, (path, body)
    too_large(http.post(UPLOAD, content=big_upload, headers={"Content-Type": "application/json"}))

    # A streamed (chunked) body is cut off once it passes the limit.
    def chunks() -> Iterator[bytes]:
        for start in range(0, len(big_upload), 8192):
            yield big_upload[start:start + 8192]

    too_large(http.post(UPLOAD, content=chunks(), headers={"Content-Type": "application/json"}))
    # The fast search route and the FastAPI routes alike; the dataset API in its own shape.
    big_query = raw(query(4000))
    assert len(big_query) > LIMIT
    too_large(http.post(SEARCH, content=big_query))
    too_large(http.request("GET", SEARCH, content=big_query))
    r = http.post("/api/v1/datasets/docs/vectors", content=raw({"vectors": [
        {"id": str(i), "values": [0.5, 0.5], "content": "y" * 200} for i in range(400)]}))
    too_large(r)
    assert r.json()["error_code"] == "PAYLOAD_TOO_LARGE"
    too_large(http.post("/api/v1/data-sources", json={
        "name": "Big", "version": "1", "vectorDimension": 2, "attributeValueTypes": {"id": "int64"},
        "permanentAttributes": ["id"], "customMetadata": {"blob": "z" * LIMIT}}))

    # Query vectors per search: a setting, refused by name before any vector is read.
    r = http.post(SEARCH, json=query(11), headers=STRONG)
    assert r.status_code == 400, r.text
    assert "SHOAL_MAX_QUERY_VECTORS" in messages(r) and "queryVectors" in messages(r)
    r = http.post(SEARCH, json=query(11))  # the eventual (fast path) search too
    assert r.status_code == 400 and "SHOAL_MAX_QUERY_VECTORS" in messages(r), r.text
    r = http.post(SEARCH, json=query(10), headers=STRONG)
    assert r.status_code == 200 and len(r.json()) == 10, r.text

    # More points than the batch limit, within the byte limit: refused (and named) before any point is read.
    r = http.post(UPLOAD, json=[point(i) for i in range(1000, 1101)])
    assert r.status_code == 400 and "more than the configured maximum 100" in messages(r), r.text
    api.unchanged()
    # The connection and the server are still fine for a normal upload.
    r = http.post(UPLOAD, json=[point(3)])
    assert r.status_code == 200, r.text


# -- 10. values no layer can store are a 400 naming the field, not a 500 ------------------------------------

Request = tuple[str, str, dict[str, str], bytes, str]  # method, path, headers, body, the field the answer names

# One case per bullet of item 10, each with every route the value can reach.
CASES_10: dict[str, list[Request]] = {
    "lone-surrogate": [
        ("POST", UPLOAD, {}, raw([point(7, text="\ud800")]), "'text'"),
        ("POST", "/api/v1/data-sources", {}, raw({
            "name": "Surrogate", "version": "1", "vectorDimension": 2, "attributeValueTypes": {"id": "int64"},
            "permanentAttributes": ["id"], "description": "bad \ud800 text"}), "description"),
        ("POST", "/api/v1/datasets", {}, raw({"name": "surrogate", "dimensions": 2,
                                              "description": "bad \ud800 text"}), "description"),
        ("PUT", "/api/v1/aliases/surrogate", {}, raw({"indexName": "\ud800", "indexVersion": "1"}), "index name"),
    ],
    "datetime-beyond-year-9999-in-utc": [
        ("POST", UPLOAD, {}, raw([point(7, at="9999-12-31T23:59:59-14:00")]), "'at'"),
        ("POST", UPLOAD, ARROW, arrow_point(pa.array([LATE], pa.timestamp("us", tz="-14:00"))), "'at'"),
        ("POST", UPLOAD, ARROW, arrow_point(pa.array([LATE], pa.timestamp("us", tz="UTC"))), "'at'"),
    ],
    "sparse-index-of-2-to-the-70": [
        ("POST", "/api/v1/upload/Hard.Sparse/1", {}, raw([{
            "attributes": [{"key": "id", "value": {"int64": 1}}],
            "vector": {"isSparse": True, "coordinates": [1.0], "coordinateIndices": [2**70]}}]), "'vector'"),
        ("POST", "/api/v1/search/Hard.SparseIndex/1", {}, raw({
            "k": 1, "queryVectors": [{"isSparse": True, "coordinates": [1.0], "coordinateIndices": [2**70]}]}),
         "queryVectors"),
    ],
    # Finite coordinates whose vector is too long for float32 distances: hnswlib ranked such vectors wrongly and
    # faiss's k-means aborted the process building an IVF index over them.
    "vector-norm-past-the-bound": [
        ("POST", UPLOAD, {}, raw([point(1), {**point(7), "vector": {"isSparse": False, "coordinates": [1e19, 1e19]}}]),
         "vector norm"),
        ("POST", UPLOAD, ARROW, arrow_vector([1e19, -1e19]), "vector norm"),
        ("POST", "/api/v1/upload/Hard.Sparse/1", {}, raw([{
            "attributes": [{"key": "id", "value": {"int64": 1}}],
            "vector": {"isSparse": True, "coordinates": [2e19], "coordinateIndices": [3]}}]), "vector norm"),
        ("POST", "/api/v1/datasets/docs/vectors", {}, raw({"vectors": [{"id": "a", "values": [1e20, 0.0]}]}),
         "vector norm"),
        ("POST", SEARCH, {}, raw({"k": 1, "queryVectors": [{"isSparse": False, "coordinates": [0.0, 1e20]}]}),
         "vector norm"),
        ("POST", "/api/v1/datasets/docs/search", {}, raw({"vector": [1e20, 1e20], "top_k": 1}), "vector norm"),
    ],
    "write-token-of-2-to-the-63": [
        ("POST", "/api/v1/datasets/docs/search", {}, raw({"vector": [0.5, 0.5], "top_k": 1,
                                                          "min_write_token": 2**63}), "min_write_token"),
        ("POST", SEARCH, {"X-Shoal-Required-Token": str(2**63)}, raw(query()), "x-shoal-required-token"),
    ],
}


@pytest.mark.parametrize("case", list(CASES_10))
def test_unstorable_values_are_a_400_naming_the_field(serve: Callable[..., Api], case: str) -> None:
    api = serve()
    for method, path, headers, body, field in CASES_10[case]:
        r = api.http.request(method, path, content=body, headers={"Content-Type": "application/json", **headers})
        assert r.status_code == 400, (path, r.status_code, r.text)
        assert field.lower() in messages(r).lower(), (path, messages(r))
        api.unchanged()
    assert api.http.get("/api/v1/aliases").json() == []


# -- 11. metadata depth and size are bounded before anything is written ---------------------------------------


def nested(depth: int) -> dict[str, Any]:
    """A JSON object nesting `depth` objects in all."""
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def test_metadata_depth_and_size_are_bounded_before_writing(serve: Callable[..., Api]) -> None:
    api = serve()
    http = api.http
    deep = nested(300)
    # Dataset metadata on create and on update; a vector's metadata on upsert.
    r = http.post("/api/v1/datasets", json={"name": "deep", "dimensions": 2, "metadata": deep})
    assert r.status_code == 400 and r.json()["error_code"] == "INVALID_DATASET_CONFIG", r.text
    assert "metadata" in r.json()["message"] and "32" in r.json()["message"], r.text
    assert http.get("/api/v1/datasets/deep").status_code == 404
    r = http.put("/api/v1/datasets/docs", json={"metadata": deep})
    assert r.status_code == 400 and "metadata" in r.json()["message"], r.text
    r = http.post("/api/v1/datasets/docs/vectors", json={"vectors": [{"id": "a", "values": [0.5, 0.5],
                                                                       "metadata": deep}]})
    assert r.status_code == 400 and "metadata" in messages(r), r.text
    # A data source's custom metadata: too deep, or too large.
    source = {"name": "Deep", "version": "1", "vectorDimension": 2, "attributeValueTypes": {"id": "int64"},
              "permanentAttributes": ["id"]}
    r = http.post("/api/v1/data-sources", json={**source, "customMetadata": deep})
    assert r.status_code == 400 and "customMetadata" in messages(r), r.text
    r = http.post("/api/v1/data-sources", json={**source, "customMetadata": {"blob": "z" * (300 * 1024)}})
    assert r.status_code == 400 and "customMetadata" in messages(r), r.text
    assert http.get("/api/v1/data-sources/Deep/1").status_code == 404
    api.unchanged()
    assert http.get("/api/v1/datasets/docs").json()["vector_count"] == 0

    # Within the bounds, metadata is stored and answered as given.
    fine = nested(32)
    r = http.post("/api/v1/datasets", json={"name": "fine", "dimensions": 2, "metadata": fine})
    assert r.status_code == 201 and r.json()["metadata"] == fine, r.text
    r = http.post("/api/v1/data-sources", json={**source, "customMetadata": nested(64)})
    assert r.status_code == 201, r.text
    assert http.get("/api/v1/data-sources").status_code == 200
    assert http.get("/api/v1/datasets").status_code == 200


# -- 12. booleans are booleans; search errors do not say "nothing written" -------------------------------------


def test_booleans_must_be_booleans_and_search_errors_do_not_claim_a_write(serve: Callable[..., Api]) -> None:
    api = serve()
    http = api.http
    for value in ("yes", 1, "true"):
        tombstone = {"attributes": [{"key": "id", "value": {"int64": 1}}], "isDeleted": value}
        r = http.post(UPLOAD, json=[tombstone])
        assert r.status_code == 400, (value, r.text)
        assert "isDeleted" in messages(r) and "nothing written" in messages(r), r.text
    api.unchanged()
    r = http.post(SEARCH, json=query(k=5), headers=STRONG)
    assert sorted(p["attributes"][0]["value"]["int64"] for p in r.json()[0]["nearestDataPoints"]) == [1, 2]

    # Searches that break a rule: 400, saying what is wrong, and never that nothing was written.
    bad_searches = [
        (SEARCH, {}, query(retrieveVectors="yes")),
        (SEARCH, STRONG, query(retrieveVectors="yes")),
        (SEARCH, {}, {"k": 0, "queryVectors": [{"isSparse": False, "coordinates": [0.0, 1.0]}]}),
        (SEARCH, STRONG, {"k": 1, "queryVectors": [{"isSparse": False, "coordinates": [0.0, 1.0, 2.0]}]}),
        (SEARCH, {"X-Shoal-Consistency": "sometimes"}, query()),
    ]
    for path, headers, body in bad_searches:
        r = http.post(path, json=body, headers=headers)
        assert r.status_code == 400, (path, body, r.text)
        assert "nothing written" not in messages(r), (body, r.text)
        assert messages(r).startswith("invalid query"), r.text
    r = http.post("/api/v1/datasets/docs/search", content=b'{"vector": [NaN, 1.0], "top_k": 1}',
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert "nothing written" not in messages(r), r.text
    api.unchanged()

    # ... and the same from the Python API.
    from shoal.errors import ValidationError

    with Shoal(api.settings, notify=False) as shoal:
        searcher = shoal.searcher()
        try:
            for queries, k, options in (
                ([[0.0, 1.0]], 0, {}),
                ([[0.0, 1.0, 2.0]], 1, {}),
                ([[0.0, 1.0]], 1, {"search_params": {"no_such_param": 3}}),
            ):
                with pytest.raises(ValidationError) as caught:
                    searcher.search(DENSE_INDEX.name, DENSE_INDEX.version, queries, k, **options)
                assert str(caught.value).startswith("invalid query"), str(caught.value)
                assert "nothing written" not in str(caught.value)
        finally:
            searcher.close()
    api.unchanged()
