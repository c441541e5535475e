"""The dataset API over real HTTP: a served uvicorn app per tenant, the real catalog, storage and (for the cache)
a real embedded Valkey. No indexer worker runs: searches ask for `strong` consistency (an exact scan of the log
tail) unless a test materializes the index itself."""

from __future__ import annotations

import datetime as dt
import json
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import uvicorn
from conftest import wait_for

from shoal import DataSourceSpec, Shoal
from shoal.api.app import create_app
from shoal.api.datasets import install
from shoal.auth import create_key, create_tenant
from shoal.config.settings import Settings
from shoal.datasets import RESERVED_NAMES
from shoal.datasets.service import DatasetService
from shoal.index.builder import ShardBuilder

DATASET_KEYS = ["id", "name", "description", "dimensions", "metric_type", "index_type", "metadata", "created_at",
                "updated_at", "vector_count", "storage_size", "tenant_id", "storage_location"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Serve = Callable[[Settings], str]


@pytest.fixture
def serve() -> Iterator[Serve]:
    """Start the API (dataset routes installed) for some settings on a loopback port; its `/api/v1` URL."""
    running: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(settings: Settings) -> str:
        app = create_app(settings)
        install(app)
        port = _free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        wait_for(lambda: server.started, 30, "the API server to start")
        running.append((server, thread))
        return f"http://127.0.0.1:{port}/api/v1"

    yield start
    for server, thread in running:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def connect() -> Iterator[Callable[..., httpx.Client]]:
    """HTTP clients to a served API, with an API key or none; closed after the test."""
    clients: list[httpx.Client] = []

    def make(url: str, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"ApiKey {key}"} if key else {}
        client = httpx.Client(base_url=url, headers=headers, timeout=30)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def anonymous(settings: Settings, **overrides: Any) -> Settings:
    """The settings with their tenant served to callers without a key (as the embedded default does)."""
    return settings.model_copy(update={"anonymous_tenant": settings.tenant, **overrides})


def admin_key(settings: Settings) -> str:
    """An admin key of the settings' tenant: a keyless caller never deletes, and hard deletes, purges and
    `overwrite` need an admin key (issue 13)."""
    with Shoal(settings, notify=False) as shoal:
        return create_key(shoal.engine, settings.tenant, "admin")[1]


@pytest.fixture
def api(serve: Serve, connect: Callable[..., httpx.Client],
        make_settings: Callable[..., Settings]) -> tuple[httpx.Client, Settings]:
    """A served API on a fresh tenant (its admin key), its Redis unreachable (the cache stays out of the way)."""
    settings = anonymous(make_settings("local"))
    return connect(serve(settings), admin_key(settings)), settings


def create(http: httpx.Client, name: str, dimensions: int = 2, **extra: Any) -> dict[str, Any]:
    r = http.post("/datasets", json={"name": name, "dimensions": dimensions, **extra})
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


def upsert(http: httpx.Client, name: str, *vectors: dict[str, Any]) -> int:
    r = http.post(f"/datasets/{name}/vectors", json={"vectors": list(vectors)})
    assert r.status_code == 200, r.text
    assert r.json()["inserted"] == len(vectors)
    return int(r.json()["write_token"])


def vec(vid: str, values: list[float], **extra: Any) -> dict[str, Any]:
    return {"id": vid, "values": values, **extra}


def assert_error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["success", "error_code", "message", "details"], body
    assert body["success"] is False and body["error_code"] == code, body
    assert isinstance(body["message"], str) and body["message"] and isinstance(body["details"], dict)
    return body  # type: ignore[no-any-return]


def mirror(settings: Settings, name: str) -> Path:
    return Path(str(settings.storage_uri)) / "tenants" / settings.tenant / "datasets" / name / "dataset_metadata.json"


# -- CRUD ------------------------------------------------------------------------------------------------------


def test_create_list_get_update_delete(api: tuple[httpx.Client, Settings]) -> None:
    http, settings = api
    body = create(http, "beta", 3, description="second", metadata={"team": "search", "n": 1})
    assert list(body) == DATASET_KEYS
    assert body | {"created_at": None, "updated_at": None, "storage_location": None} == {
        "id": "beta", "name": "beta", "description": "second", "dimensions": 3, "metric_type": "cosine",
        "index_type": "hnsw", "metadata": {"team": "search", "n": 1}, "created_at": None, "updated_at": None,
        "vector_count": 0, "storage_size": 0, "tenant_id": settings.tenant, "storage_location": None,
    }
    assert body["created_at"] == body["updated_at"]
    create(http, "alpha", 2, metric_type="euclidean", index_type="flat")
    create(http, "gamma_1", 10000, metric_type="dot_product", index_type="ivf", index_params={"nprobe": 4})

    r = http.get("/datasets")
    assert r.status_code == 200
    page = r.json()
    assert (page["total"], page["limit"], page["offset"]) == (3, 100, 0)
    assert [d["id"] for d in page["datasets"]] == ["alpha", "beta", "gamma_1"]
    assert all(list(d) == DATASET_KEYS for d in page["datasets"])
    r = http.get("/datasets", params={"limit": 2})
    assert [d["id"] for d in r.json()["datasets"]] == ["alpha", "beta"] and r.json()["total"] == 3
    r = http.get("/datasets", params={"limit": 2, "offset": 2})
    assert [d["id"] for d in r.json()["datasets"]] == ["gamma_1"]
    assert (r.json()["limit"], r.json()["offset"]) == (2, 2)
    r = http.get("/datasets", params={"offset": 5})
    assert r.json()["datasets"] == [] and r.json()["total"] == 3

    got = http.get("/datasets/beta").json()
    assert got == body

    r = http.put("/datasets/beta", json={"description": "renamed"})
    assert r.status_code == 200, r.text
    updated = r.json()
    assert updated["description"] == "renamed" and updated["metadata"] == {"team": "search", "n": 1}
    assert updated["updated_at"] > body["updated_at"] and updated["created_at"] == body["created_at"]
    r = http.put("/datasets/beta", json={"metadata": None})
    assert r.json()["metadata"] is None and r.json()["description"] == "renamed"
    assert http.get("/datasets/beta").json()["metadata"] is None
    r = http.put("/datasets/beta", json={})  # nothing to change
    assert r.status_code == 200 and r.json()["description"] == "renamed"

    r = http.delete("/datasets/beta")
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True and r.json()["dataset_id"] == "beta"
    assert_error(http.get("/datasets/beta"), 404, "DATASET_NOT_FOUND")
    assert_error(http.delete("/datasets/beta"), 404, "DATASET_NOT_FOUND")
    assert [d["id"] for d in http.get("/datasets").json()["datasets"]] == ["alpha", "gamma_1"]
    with Shoal(settings, notify=False) as shoal:  # the data source and the index went with it
        assert {s.spec.name for s in shoal.list_data_sources()} == {"alpha", "gamma_1"}
        assert {i.spec.name for i in shoal.list_indexes()} == {"alpha", "gamma_1"}
        index = shoal.get_index("gamma_1", "1")
        assert (index.spec.algorithm, index.spec.metric, index.spec.params) == ("ivf", "dot_product",
                                                                                  {"nlist": 100, "nprobe": 4})
        source = shoal.get_data_source("alpha", "1").spec
        assert dict(source.attribute_types) == {"id": "string", "document_id": "string", "content": "string",
                                                "metadata": "string"}
        assert source.permanent_attributes == ("id",)


def test_overwrite_replaces_a_dataset(api: tuple[httpx.Client, Settings]) -> None:
    http, _ = api
    create(http, "docs", 2, metric_type="euclidean", index_type="flat", description="old")
    upsert(http, "docs", vec("a", [1, 0]), vec("b", [0, 1]))
    assert http.get("/datasets/docs").json()["vector_count"] == 2
    search = {"vector": [0, 0], "top_k": 5, "consistency": "strong"}
    assert len(http.post("/datasets/docs/search", json=search).json()["results"]) == 2

    assert_error(http.post("/datasets", json={"name": "docs", "dimensions": 3}), 409, "DATASET_ALREADY_EXISTS")
    fresh = create(http, "docs", 3, overwrite=True)
    assert (fresh["dimensions"], fresh["metric_type"], fresh["index_type"]) == (3, "cosine", "hnsw")
    assert (fresh["description"], fresh["vector_count"], fresh["storage_size"]) == (None, 0, 0)
    r = http.post("/datasets/docs/search", json={"vector": [1, 0, 0], "top_k": 5, "consistency": "strong"})
    assert r.status_code == 200, r.text
    assert r.json()["results"] == []  # nothing of the old dataset is served
    upsert(http, "docs", vec("c", [1, 0, 0]))
    r = http.post("/datasets/docs/search", json={"vector": [1, 0, 0], "top_k": 5, "consistency": "strong"})
    assert [h["id"] for h in r.json()["results"]] == ["c"]
    assert http.get("/datasets").json()["total"] == 1


# -- errors ----------------------------------------------------------------------------------------------------


CREATE_ERRORS: list[tuple[Any, int, str]] = [
    ({"name": "Bad Name", "dimensions": 2}, 400, "INVALID_DATASET_NAME"),
    ({"name": "UPPER", "dimensions": 2}, 400, "INVALID_DATASET_NAME"),
    ({"name": "-dash-first", "dimensions": 2}, 400, "INVALID_DATASET_NAME"),
    ({"name": "", "dimensions": 2}, 400, "INVALID_DATASET_NAME"),
    ({"name": "x" * 101, "dimensions": 2}, 400, "INVALID_DATASET_NAME"),
    ({"name": "a.b", "dimensions": 2}, 400, "INVALID_DATASET_NAME"),
    ({"name": 5, "dimensions": 2}, 400, "INVALID_DATASET_NAME"),
    ({"name": "admin", "dimensions": 2}, 400, "RESERVED_DATASET_NAME"),
    ({"name": "metrics", "dimensions": 2}, 400, "RESERVED_DATASET_NAME"),
    ({"name": "d", "dimensions": 0}, 400, "INVALID_DATASET_CONFIG"),  # out of range (issue 15)
    ({"name": "d", "dimensions": 10001}, 400, "INVALID_DATASET_CONFIG"),
    ({"name": "d", "dimensions": "3"}, 400, "INVALID_DIMENSIONS"),
    ({"name": "d", "dimensions": True}, 400, "INVALID_DIMENSIONS"),
    ({"name": "d", "dimensions": 2.5}, 400, "INVALID_DIMENSIONS"),
    ({"name": "d", "dimensions": 2, "metric_type": "hamming"}, 400, "INVALID_DATASET_CONFIG"),
    ({"name": "d", "dimensions": 2, "index_type": "annoy"}, 400, "INVALID_DATASET_CONFIG"),
    ({"name": "d", "dimensions": 2, "metric_type": "manhattan", "index_type": "hnsw"}, 400,
     "INVALID_DATASET_CONFIG"),  # not in hnsw
    ({"name": "d", "dimensions": 2, "index_params": {"M": 4}}, 400, "INVALID_DATASET_CONFIG"),  # M in 8..64
    ({"name": "d", "dimensions": 2, "index_type": "ivf", "index_params": {"bogus": 1}}, 400,
     "INVALID_DATASET_CONFIG"),
    ({"name": "d", "dimensions": 2, "metadata": [1, 2]}, 400, "INVALID_DATASET_CONFIG"),
    ({"name": "d", "dimensions": 2, "description": "x" * 10001}, 400, "INVALID_DATASET_CONFIG"),
    ({"name": "d", "dimensions": 2, "description": "nul\x00"}, 400, "INVALID_DATASET_CONFIG"),  # Postgres text
    ({"name": "d", "dimensions": 2, "metadata": {"k": "nul\x00"}}, 400, "INVALID_DATASET_CONFIG"),  # and JSONB
    ({"name": "d"}, 400, "VALIDATION_ERROR"),
    ({"name": "d", "dimensions": 2, "colour": "red"}, 400, "VALIDATION_ERROR"),
    ({"name": "d", "dimensions": 2, "overwrite": "yes"}, 400, "VALIDATION_ERROR"),
    ([1, 2], 400, "VALIDATION_ERROR"),
]


def test_create_errors(api: tuple[httpx.Client, Settings]) -> None:
    http, _ = api
    for body, status, code in CREATE_ERRORS:
        r = http.post("/datasets", json=body)
        assert (r.status_code, r.json().get("error_code")) == (status, code), (body, r.text)
        assert_error(r, status, code)
    lone_surrogate = b'{"name": "d", "dimensions": 2, "description": "\\ud800"}'
    r = http.post("/datasets", content=lone_surrogate, headers={"content-type": "application/json"})
    assert_error(r, 400, "INVALID_DATASET_CONFIG")
    assert http.get("/datasets").json()["total"] == 0  # nothing was created


def test_error_codes_on_every_route(api: tuple[httpx.Client, Settings], monkeypatch: pytest.MonkeyPatch) -> None:
    http, settings = api
    reserved = assert_error(http.post("/datasets", json={"name": "system", "dimensions": 2}), 400,
                            "RESERVED_DATASET_NAME")
    assert set(reserved["details"]["reserved_names"]) == set(RESERVED_NAMES)
    assert {"admin", "api", "system", "default", "health", "metrics"} <= RESERVED_NAMES
    r = http.post("/datasets", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400, "VALIDATION_ERROR")
    create(http, "docs", 2, metric_type="euclidean", index_type="flat")
    body = assert_error(http.post("/datasets", json={"name": "docs", "dimensions": 2}), 409, "DATASET_ALREADY_EXISTS")
    assert body["details"].items() >= {"dataset_id": "docs", "conflict": "dataset"}.items()

    # A plain data source of the dataset's name blocks it, even with overwrite (only datasets are replaced).
    with Shoal(settings, notify=False) as shoal:
        shoal.create_data_source(DataSourceSpec("plain", "1", 2, {"id": "int64"}, ["id"]))
    for overwrite in (False, True):
        r = http.post("/datasets", json={"name": "plain", "dimensions": 2, "overwrite": overwrite})
        assert assert_error(r, 409, "DATASET_ALREADY_EXISTS")["details"]["conflict"] == "data_source"
    assert [d["id"] for d in http.get("/datasets").json()["datasets"]] == ["docs"]  # not a dataset: not listed
    assert_error(http.get("/datasets/plain"), 404, "DATASET_NOT_FOUND")

    for limit, offset in ((0, 0), (1001, 0), (10, -1), ("x", 0)):
        assert_error(http.get("/datasets", params={"limit": limit, "offset": offset}), 400, "VALIDATION_ERROR")

    vector = {"vectors": [vec("a", [1, 0])]}
    search = {"vector": [1, 0], "top_k": 1, "consistency": "strong"}
    for method, path, json_body in [
        ("GET", "/datasets/nope", None),
        ("PUT", "/datasets/nope", {"description": "x"}),
        ("DELETE", "/datasets/nope", None),
        ("GET", "/datasets/nope/stats", None),
        ("POST", "/datasets/nope/reindex", None),
        ("POST", "/datasets/nope/vectors", vector),
        ("POST", "/datasets/nope/search", search),
        ("GET", "/datasets/admin", None),  # a reserved name never exists
    ]:
        body = assert_error(http.request(method, path, json=json_body), 404, "DATASET_NOT_FOUND")
        assert body["details"]["dataset_id"] in ("nope", "admin")
    assert_error(http.get("/datasets/Not-Valid!"), 400, "INVALID_DATASET_NAME")

    body = assert_error(http.put("/datasets/docs", json={"description": "ok", "dimensions": 3}), 400,
                        "INVALID_DATASET_CONFIG")
    assert body["details"]["fields"] == ["dimensions"]
    assert_error(http.put("/datasets/docs", json={"name": "other"}), 400, "INVALID_DATASET_CONFIG")
    assert_error(http.put("/datasets/docs", json={"metadata": "text"}), 400, "INVALID_DATASET_CONFIG")
    assert http.get("/datasets/docs").json()["description"] is None  # refused updates changed nothing

    code = http.post("/datasets/docs/reindex", json={"index_type": "bogus"}).json()["error_code"]
    assert code == "VALIDATION_ERROR"  # refused, nothing started
    done = http.post("/datasets/docs/reindex?async=false", json={"index_type": "flat"})
    assert done.status_code == 202, done.text
    assert done.json()["state"] == "swapped" and done.json()["definition"]["algorithm"] == "flat"

    body = assert_error(http.post("/datasets/docs/vectors", json={"vectors": [vec("a", [1, 0]), vec("b", [1])]}),
                        400, "INVALID_DIMENSIONS")
    assert body["details"].items() >= {"position": 1, "expected": 2, "got": 1}.items()
    assert_error(http.post("/datasets/docs/vectors", json={"vectors": []}), 400, "VALIDATION_ERROR")
    assert_error(http.post("/datasets/docs/vectors", json={"vectors": [vec("", [1, 0])]}), 400, "VALIDATION_ERROR")
    r = http.post("/datasets/docs/vectors", content=b'{"vectors": [{"id": "a", "values": [NaN, 0]}]}',
                  headers={"content-type": "application/json"})
    assert_error(r, 400, "VALIDATION_ERROR")
    assert_error(http.post("/datasets/docs/vectors", json={"vectors": [vec("a", ["x", 0])]}), 400,
                 "VALIDATION_ERROR")
    assert http.get("/datasets/docs/stats").json()["vector_count"] == 0  # nothing was written
    assert_error(http.post("/datasets/docs/search", json={"vector": [1, 0, 0]}), 400, "INVALID_DIMENSIONS")
    assert_error(http.post("/datasets/docs/search", json={"vector": [1, 0], "top_k": 0}), 400, "VALIDATION_ERROR")
    assert_error(http.post("/datasets/docs/search", json={"vector": [1, 0], "consistency": "psychic"}), 400,
                 "VALIDATION_ERROR")
    r = http.post("/search/multi-dataset", json={"dataset_ids": ["docs", "nope"], "vector": [1, 0]})
    assert assert_error(r, 404, "DATASET_NOT_FOUND")["details"]["dataset_id"] == "nope"
    r = http.post("/search/multi-dataset", json={"dataset_ids": ["docs", "docs"], "vector": [1, 0]})
    assert_error(r, 400, "VALIDATION_ERROR")
    r = http.post("/search/multi-dataset", json={"dataset_ids": ["docs"], "vector": [1, 0], "merge_strategy": "x"})
    assert_error(r, 400, "VALIDATION_ERROR")
    # A name with a lone surrogate (escaped in the JSON body): the error quotes it, and its body failed to encode,
    # a 500 in place of the 400; it is sent escaped now.
    r = http.post("/search/multi-dataset", content=b'{"datasets": ["\\ud800x"], "query_vector": [1, 0]}',
                  headers={"content-type": "application/json"})
    assert assert_error(r, 400, "INVALID_DATASET_NAME")["details"]["name"] == "\ud800x"

    def boom(self: DatasetService, name: str) -> None:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(DatasetService, "stats", boom)
    body = assert_error(http.get("/datasets/docs/stats"), 500, "INTERNAL_ERROR")
    assert "disk on fire" not in json.dumps(body)  # internals are logged, not leaked

    # The Vektonn routes keep their own error shape.
    r = http.post("/upload/Nope/1.0", json=[])
    assert r.status_code == 404 and list(r.json()) == ["errorMessages"]
    r = http.post("/search/docs/1", json={"k": 0, "queryVectors": [{"coordinates": [0, 0]}]})
    assert r.status_code == 400 and list(r.json()) == ["errorMessages"]
    r = http.post("/search/docs/1", json={"k": "many"})
    assert r.status_code == 400 and list(r.json()) == ["errorMessages"]


# -- vectors, search, stats ------------------------------------------------------------------------------------


def test_a_write_token_past_the_head_is_refused_and_later_writes_stay_visible(
        serve: Serve, connect: Callable[..., httpx.Client], make_settings: Callable[..., Settings]) -> None:
    """A `min_write_token` no upload gave (past the log head) answers 400 naming it. Before, the searcher read
    the log "up to" it, then took every later write as covered already: strong and at_least searches missed
    them until the process restarted."""
    settings = anonymous(make_settings("local", young_tier_max_seqs=0))
    http = connect(serve(settings), admin_key(settings))
    create(http, "tok", 2, metric_type="euclidean", index_type="flat")
    head = upsert(http, "tok", vec("a", [1, 0]), vec("b", [0, 3]))
    query = {"vector": [0, 0], "top_k": 1}
    for invented in (head + 1, 2**63 - 1):
        r = http.post("/datasets/tok/search", json=query | {"min_write_token": invented})
        assert r.status_code == 400 and r.json()["error_code"] == "VALIDATION_ERROR", r.text
        assert f"write token {invented} is past the log head {head}" in r.json()["message"], r.text
    later = upsert(http, "tok", vec("c", [0, 0.5]))
    for level in ({"min_write_token": later}, {"consistency": "strong"}, {"min_write_token": head}):
        r = http.post("/datasets/tok/search", json=query | level)
        assert [(h["id"], h["score"]) for h in r.json()["results"]] == [("c", 0.5)], level


def test_vectors_search_and_stats(serve: Serve, connect: Callable[..., httpx.Client],
                                  make_settings: Callable[..., Settings]) -> None:
    # No young tier: eventual shows only what workers built (none run here), at_least and strong the log.
    settings = anonymous(make_settings("local", young_tier_max_seqs=0))
    http = connect(serve(settings), admin_key(settings))
    create(http, "docs", 2, metric_type="euclidean", index_type="flat")
    first = upsert(
        http, "docs",
        vec("a", [1, 0], content="apple", document_id="doc-1", metadata={"lang": "en", "page": 1}),
        vec("b", [0, 3], content="banana", document_id="doc-1", metadata={"lang": "fr"}),
        vec("c", [5, 0]),
    )
    assert first == 3
    second = upsert(http, "docs", vec("b", [0, 2], content="blueberry", document_id="doc-2"))
    assert second == 4

    query = {"vector": [0, 0], "top_k": 10}
    r = http.post("/datasets/docs/search", json=query)  # eventual: no worker has built anything yet
    assert r.status_code == 200 and r.json()["results"] == []
    r = http.post("/datasets/docs/search", json=query | {"min_write_token": first})  # the state at that write
    assert [(h["id"], h["score"]) for h in r.json()["results"]] == [("a", 1.0), ("b", 3.0), ("c", 5.0)]
    r = http.post("/datasets/docs/search", json=query | {"consistency": "strong"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["dataset_id"], out["metric_type"], out["higher_is_better"], out["consistency"]) == (
        "docs", "euclidean", False, "strong")
    assert out["results"] == [
        {"id": "a", "score": 1.0, "content": "apple", "metadata": {"lang": "en", "page": 1}, "document_id": "doc-1"},
        {"id": "b", "score": 2.0, "content": "blueberry", "metadata": None, "document_id": "doc-2"},
        {"id": "c", "score": 5.0, "content": None, "metadata": None, "document_id": None},
    ]
    r = http.post("/datasets/docs/search", json={"vector": [4, 0], "top_k": 1, "consistency": "strong"})
    assert [(h["id"], h["score"]) for h in r.json()["results"]] == [("c", 1.0)]

    obj = http.get("/datasets/docs").json()
    assert obj["vector_count"] == 3  # live vectors: the re-upserted "b" counts once (issue 15)
    assert obj["storage_size"] > 0

    stats = http.get("/datasets/docs/stats").json()
    assert stats["dataset_id"] == "docs"
    assert stats["vector_count"] == 3  # exact: the log folded by id
    assert stats["storage"]["log_bytes"] == obj["storage_size"]
    assert stats["storage"]["index_bytes"] == 0  # nothing built yet
    assert stats["storage"]["metadata_bytes"] == mirror(settings, "docs").stat().st_size
    assert stats["storage_size"] == sum(v for k, v in stats["storage"].items() if k.endswith("_bytes"))
    assert stats["metadata_stats"] == {
        "log_entries": 4, "log_segments": 2, "upserts": 4, "tombstones": 0,
        "vectors_with_document_id": 2, "distinct_document_ids": 2, "vectors_with_content": 2,
        "vectors_with_metadata": 1, "metadata_keys": {"lang": 1, "page": 1}, "metadata_sampled_vectors": 3,
    }
    index_stats = stats["index_stats"]
    assert (index_stats["index_type"], index_stats["metric_type"], index_stats["index_params"]) == (
        "flat", "euclidean", {})
    [shard] = index_stats["shards"]
    assert (shard["shard"], shard["head"], shard["built_watermark"], shard["lag_seqs"]) == (0, 4, 0, 4)

    # Once the index is built, an eventual search serves it and the stats count its artifacts.
    with Shoal(settings, notify=False) as shoal:
        for s in shoal.get_index("docs", "1").shards:
            ShardBuilder(shoal.engine, shoal.storage).materialize(s.id)
    stats = http.get("/datasets/docs/stats").json()
    assert stats["storage"]["index_bytes"] > 0 and stats["storage"]["index_files"] > 0
    assert stats["index_stats"]["shards"][0]["built_watermark"] == 4
    assert stats["storage_size"] > obj["storage_size"]

    def eventual_sees_all() -> bool:
        return len(http.post("/datasets/docs/search", json=query).json()["results"]) == 3

    wait_for(eventual_sees_all, 20, "the searcher to load the built version")
    r = http.post("/datasets/docs/search", json=query)
    assert [(h["id"], h["score"]) for h in r.json()["results"]] == [("a", 1.0), ("b", 2.0), ("c", 5.0)]


def test_multi_dataset_search_strategies(api: tuple[httpx.Client, Settings]) -> None:
    http, _ = api
    create(http, "left", 2, metric_type="euclidean", index_type="flat")
    create(http, "right", 2, metric_type="euclidean", index_type="hnsw")
    create(http, "dots", 2, metric_type="dot_product", index_type="flat")
    create(http, "cos", 2, metric_type="cosine", index_type="flat")
    upsert(http, "left", vec("l1", [1, 0]), vec("l3", [0, 3]), vec("l5", [5, 0]))  # distances 1, 3, 5
    upsert(http, "right", vec("r2", [0, 2]), vec("r4", [4, 0]))  # distances 2, 4
    upsert(http, "dots", vec("d1", [1, 0]), vec("d2", [2, 0]))

    def run(ids: list[str], strategy: str, top_k: int = 10, vector: list[float] | None = None) -> httpx.Response:
        return http.post("/search/multi-dataset", json={
            "dataset_ids": ids, "vector": vector or [0, 0], "top_k": top_k, "merge_strategy": strategy,
            "consistency": "strong",
        })

    def order(r: httpx.Response) -> list[tuple[str, str]]:
        assert r.status_code == 200, r.text
        return [(h["dataset_id"], h["id"]) for h in r.json()["results"]]

    r = run(["left", "right"], "score")
    assert order(r) == [("left", "l1"), ("right", "r2"), ("left", "l3"), ("right", "r4"), ("left", "l5")]
    assert [h["score"] for h in r.json()["results"]] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [h["rank"] for h in r.json()["results"]] == [0, 0, 1, 1, 2]
    assert (r.json()["merge_strategy"], r.json()["dataset_ids"], r.json()["top_k"]) == ("score", ["left", "right"], 10)
    assert order(run(["left", "right"], "score", 3)) == [("left", "l1"), ("right", "r2"), ("left", "l3")]
    # interleave: rank by rank, datasets in request order.
    assert order(run(["left", "right"], "interleave")) == [
        ("left", "l1"), ("right", "r2"), ("left", "l3"), ("right", "r4"), ("left", "l5")]
    assert order(run(["right", "left"], "interleave")) == [
        ("right", "r2"), ("left", "l1"), ("right", "r4"), ("left", "l3"), ("left", "l5")]
    # round_robin: rank by rank, rank r starting at dataset r mod n.
    assert order(run(["left", "right"], "round_robin")) == [
        ("left", "l1"), ("right", "r2"), ("right", "r4"), ("left", "l3"), ("left", "l5")]
    assert order(run(["left", "right"], "round_robin", 3)) == [("left", "l1"), ("right", "r2"), ("right", "r4")]
    assert order(run(["left", "right"], "interleave", 3)) == [("left", "l1"), ("right", "r2"), ("left", "l3")]
    assert order(run(["left", "right", "dots"], "round_robin", vector=[1, 0])) == [
        ("left", "l1"), ("right", "r2"), ("dots", "d2"),  # rank 0 from left
        ("right", "r4"), ("dots", "d1"), ("left", "l3"),  # rank 1 from right
        ("left", "l5"),  # rank 2 from dots, which has none
    ]
    # dot_product ranks the other way: interleave merges it, score refuses it.
    assert order(run(["dots", "left"], "interleave", 3, [1, 0])) == [("dots", "d2"), ("left", "l1"), ("dots", "d1")]
    body = assert_error(run(["left", "dots"], "score"), 400, "INVALID_DATASET_CONFIG")
    assert body["details"]["metric_types"] == {"left": "euclidean", "dots": "dot_product"}
    # Same direction, different metrics: merged by score as they are.
    upsert(http, "cos", vec("c0", [1, 1]))  # cosine distance 1 - 1/sqrt(2) from [1, 0]
    r = run(["left", "cos"], "score", 3, [1, 0])
    assert order(r) == [("left", "l1"), ("cos", "c0"), ("left", "l3")]
    assert [h["score"] for h in r.json()["results"]] == pytest.approx([0.0, 1 - 2**-0.5, 10**0.5], rel=1e-6)
    # dot_product alone: descending scores.
    r = run(["dots"], "score", vector=[1, 0])
    assert order(r) == [("dots", "d2"), ("dots", "d1")] and [h["score"] for h in r.json()["results"]] == [2.0, 1.0]
    assert_error(run(["left", "right"], "score", vector=[1, 0, 0]), 400, "INVALID_DIMENSIONS")


# -- storage mirror --------------------------------------------------------------------------------------------


def test_dataset_metadata_json_mirrors_the_catalog(api: tuple[httpx.Client, Settings]) -> None:
    http, settings = api
    obj = create(http, "docs", 4, metric_type="dot_product", description="d", metadata={"k": [1, 2]})
    path = mirror(settings, "docs")
    doc = json.loads(path.read_text())
    for key in ("id", "name", "description", "dimensions", "metric_type", "index_type", "metadata", "created_at",
                "updated_at"):
        assert doc[key] == obj[key], key
    assert doc["tenant"] == settings.tenant
    assert doc["index_params"] == {"M": 16, "ef_construction": 200, "ef_search": 50}
    assert doc["data_source"] == {"name": "docs", "version": "1", "permanent_attributes": ["id"], "attributes": {
        "id": "string", "document_id": "string", "content": "string", "metadata": "string"}}
    assert doc["index"] == {"name": "docs", "version": "1", "algorithm": "hnsw", "metric": "dot_product", "shards": 1}

    updated = http.put("/datasets/docs", json={"description": None, "metadata": {"k": "v"}}).json()
    doc = json.loads(path.read_text())
    assert (doc["description"], doc["metadata"], doc["updated_at"]) == (None, {"k": "v"}, updated["updated_at"])
    assert not list(path.parent.glob(".tmp-*"))

    assert http.delete("/datasets/docs").status_code == 200
    assert not path.exists()


def test_on_s3_storage(serve: Serve, connect: Callable[..., httpx.Client],
                      make_settings: Callable[..., Settings]) -> None:
    settings = anonymous(make_settings("s3"))
    http = connect(serve(settings), admin_key(settings))
    create(http, "docs", 2, metric_type="euclidean", index_type="flat")
    upsert(http, "docs", vec("a", [1, 0], document_id="d"), vec("b", [0, 1]))
    upsert(http, "docs", vec("a", [2, 0], document_id="d"))
    stats = http.get("/datasets/docs/stats").json()
    assert (stats["vector_count"], stats["metadata_stats"]["vectors_with_document_id"]) == (2, 1)
    assert stats["storage"]["metadata_bytes"] > 0 and stats["storage"]["log_bytes"] > 0
    with Shoal(settings, notify=False) as shoal:
        path = f"tenants/{settings.tenant}/datasets/docs/dataset_metadata.json"
        assert json.loads(shoal.storage.read(path).to_pybytes())["metric_type"] == "euclidean"
        assert http.delete("/datasets/docs", params={"hard": "true"}).status_code == 200  # soft: test_soft_delete
        assert not shoal.storage.exists(path)
        # A drop queues the files; GC deletes them once the grace period (searchers may still read them) ends.
        shoal.collect_garbage(now=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=settings.gc_grace_s + 1))
        assert shoal.storage.list_files(f"tenants/{settings.tenant}/sources/docs") == []


# -- cache -----------------------------------------------------------------------------------------------------


def test_redis_cache_keys_ttls_and_invalidation(
    serve: Serve, connect: Callable[..., httpx.Client], make_settings: Callable[..., Settings], redis_url: str
) -> None:
    settings = anonymous(make_settings("local", redis_url=redis_url))
    http = connect(serve(settings), admin_key(settings))
    with Shoal(settings, notify=False) as shoal:
        tenant_id = shoal.catalog.tenant_id  # keys carry the tenant's id, not its name (a name may be reused)
    info, listing = f"dataset:info:{tenant_id}:docs", f"dataset:list:{tenant_id}"
    r = redis.Redis.from_url(redis_url)
    try:
        create(http, "docs", 2, description="v1")
        assert not r.exists(info) and not r.exists(listing)
        assert http.get("/datasets/docs").json()["description"] == "v1"
        assert 3590 <= r.ttl(info) <= 3600
        cached = json.loads(r.get(info))
        assert (cached["name"], cached["description"], cached["dimensions"]) == ("docs", "v1", 2)
        assert http.get("/datasets", params={"limit": 5, "offset": 0}).json()["total"] == 1
        assert http.get("/datasets").json()["total"] == 1
        assert sorted(r.hkeys(listing)) == [b"100:0", b"5:0"]
        assert 290 <= r.ttl(listing) <= 300
        assert json.loads(r.hget(listing, "5:0"))["total"] == 1

        # Reads are served from the cache (the catalog says otherwise; the counters stay live).
        r.set(info, json.dumps(cached | {"description": "from the cache"}), keepttl=True)
        assert http.get("/datasets/docs").json()["description"] == "from the cache"
        upsert(http, "docs", vec("a", [1, 0]))
        assert http.get("/datasets/docs").json()["vector_count"] == 1

        # Update invalidates both; the next reads fill them again from the catalog.
        assert http.put("/datasets/docs", json={"description": "v2"}).status_code == 200
        assert not r.exists(info) and not r.exists(listing)
        assert http.get("/datasets/docs").json()["description"] == "v2"
        assert http.get("/datasets").json()["datasets"][0]["description"] == "v2"
        assert r.exists(info) and r.exists(listing)

        # Create invalidates the list (and the new dataset's info).
        create(http, "more", 2)
        assert not r.exists(listing)
        assert http.get("/datasets").json()["total"] == 2
        assert r.exists(listing)

        # Delete invalidates both.
        assert http.delete("/datasets/docs").status_code == 200
        assert not r.exists(info) and not r.exists(listing)
        assert_error(http.get("/datasets/docs"), 404, "DATASET_NOT_FOUND")
        assert [d["id"] for d in http.get("/datasets").json()["datasets"]] == ["more"]
        assert not r.exists(info)  # a miss is not cached
    finally:
        r.close()


def test_cache_down_serves_from_the_catalog(
    serve: Serve, connect: Callable[..., httpx.Client], make_settings: Callable[..., Settings]
) -> None:
    port = _free_port()  # nothing listens there
    settings = anonymous(make_settings("local", redis_url=f"redis://127.0.0.1:{port}/0"))
    http = connect(serve(settings), admin_key(settings))
    create(http, "docs", 2)
    assert http.get("/datasets/docs").status_code == 200
    assert http.get("/datasets").json()["total"] == 1
    assert http.put("/datasets/docs", json={"description": "x"}).json()["description"] == "x"
    assert http.delete("/datasets/docs").status_code == 200
    assert http.get("/datasets").json()["total"] == 0


# -- tenants ---------------------------------------------------------------------------------------------------


def test_tenants_are_isolated_and_roles_enforced(
    serve: Serve, connect: Callable[..., httpx.Client], make_settings: Callable[..., Settings]
) -> None:
    settings = make_settings("local")  # no anonymous tenant: every caller needs a key
    tenant_a, tenant_b = "ds-a-" + uuid.uuid4().hex[:8], "ds-b-" + uuid.uuid4().hex[:8]
    with Shoal(settings, notify=False) as shoal:
        keys = {}
        for tenant in (tenant_a, tenant_b):
            create_tenant(shoal.engine, tenant)
            for role in ("read", "write"):
                keys[tenant, role] = create_key(shoal.engine, tenant, role)[1]
    url = serve(settings)
    a, b = connect(url, keys[tenant_a, "write"]), connect(url, keys[tenant_b, "write"])
    create(a, "secret", 2, metric_type="euclidean", index_type="flat", description="A's")
    upsert(a, "secret", vec("x", [1, 0]))

    assert b.get("/datasets").json() == {"datasets": [], "total": 0, "limit": 100, "offset": 0, "has_more": False,
                                         "tenant_id": tenant_b}
    search = {"vector": [1, 0], "top_k": 1, "consistency": "strong"}
    routes: list[tuple[str, str, Any]] = [
        ("GET", "/datasets/secret", None),
        ("PUT", "/datasets/secret", {"description": "mine now"}),
        ("GET", "/datasets/secret/stats", None),
        ("POST", "/datasets/secret/reindex", None),
        ("POST", "/datasets/secret/vectors", {"vectors": [vec("y", [0, 1])]}),
        ("POST", "/datasets/secret/search", search),
        ("POST", "/search/multi-dataset", {"dataset_ids": ["secret"], "vector": [1, 0], "consistency": "strong"}),
        ("DELETE", "/datasets/secret", None),
    ]
    for method, path, body in routes:
        assert_error(b.request(method, path, json=body), 404, "DATASET_NOT_FOUND")

    # B may use the same name for its own dataset; neither sees the other's.
    create(b, "secret", 3, description="B's")
    assert b.get("/datasets/secret").json()["dimensions"] == 3
    got = a.get("/datasets/secret").json()
    assert (got["dimensions"], got["description"], got["vector_count"]) == (2, "A's", 1)
    r = a.post("/datasets/secret/search", json=search)
    assert [h["id"] for h in r.json()["results"]] == ["x"]
    a_settings, b_settings = (settings.model_copy(update={"tenant": t}) for t in (tenant_a, tenant_b))
    assert json.loads(mirror(a_settings, "secret").read_text())["description"] == "A's"
    assert json.loads(mirror(b_settings, "secret").read_text())["description"] == "B's"
    assert b.delete("/datasets/secret").status_code == 200
    assert a.get("/datasets/secret").status_code == 200

    # Roles: a read key reads but cannot write; no key or a wrong key is refused, in this API's shape.
    reader = connect(url, keys[tenant_a, "read"])
    assert reader.get("/datasets/secret").status_code == 200
    assert reader.post("/datasets/secret/search", json=search).status_code == 200
    for method, path, body in [
        ("POST", "/datasets", {"name": "new", "dimensions": 2}),
        ("PUT", "/datasets/secret", {"description": "x"}),
        ("POST", "/datasets/secret/vectors", {"vectors": [vec("y", [0, 1])]}),
        ("DELETE", "/datasets/secret", None),
    ]:
        assert_error(reader.request(method, path, json=body), 403, "FORBIDDEN")
    r = connect(url).get("/datasets")
    assert_error(r, 401, "UNAUTHORIZED")
    assert r.headers["WWW-Authenticate"] == "ApiKey"
    assert_error(connect(url, "shoal_000000000000_" + "x" * 43).get("/datasets/secret"), 401, "UNAUTHORIZED")
    assert a.get("/datasets/secret").json()["description"] == "A's"


def test_the_management_routes_do_not_drop_what_a_dataset_holds(
    api: tuple[httpx.Client, Settings], connect: Callable[..., httpx.Client]
) -> None:
    """A dataset is its data source and index; dropping either through the Vektonn management routes would
    destroy it for good with a write key (no trash, past the admin-only hard delete) and leave the dataset's
    caches answering it. Those routes refuse (403, naming the dataset route); the dataset API deletes it."""
    http, settings = api
    create(http, "owned", metric_type="euclidean", index_type="flat")
    upsert(http, "owned", vec("a", [1.0, 0.0]))
    with Shoal(settings, notify=False) as shoal:
        writer = create_key(shoal.engine, settings.tenant, "write")[1]
    root = str(http.base_url)
    for client in (connect(root, writer), http):  # a write key, and an admin key alike
        for path in ("/data-sources/owned/1", "/indexes/owned/1"):
            refused = client.delete(path)
            assert refused.status_code == 403, refused.text
            assert "belongs to dataset 'owned'" in refused.text and "/api/v1/datasets/owned" in refused.text
    assert http.get("/datasets/owned").status_code == 200
    found = http.post("/datasets/owned/search", json={"vector": [1.0, 0.0], "top_k": 1, "consistency": "strong"})
    assert found.status_code == 200 and [h["id"] for h in found.json()["results"]] == ["a"], found.text
    assert http.delete("/datasets/owned").status_code == 200  # to the trash, restorable
    assert [d["id"] for d in http.get("/trash").json()["datasets"]] == ["owned"]
