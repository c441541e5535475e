"""Defects of the dataset API found by a bug hunt, each through the real served API with the bodies of its repro:
search labelling scores with a metric a reindex elsewhere replaced, metadata nested deeper than the dataset API
allows (written through the Vektonn routes), /stats missing the serving generation's index files, error shapes
(the tenant, a code outside the list, reindex's "default" and engine refusals), and filters reading a vector
without a document_id or content as the text "".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import serve_api, wait_for

from shoal import Shoal
from shoal.auth import create_key
from shoal.config.settings import Settings
from shoal.index.builder import ShardBuilder

Api = tuple[httpx.Client, Settings]


def _key(settings: Settings, role: str) -> str:
    with Shoal(settings, notify=False) as shoal:
        return create_key(shoal.engine, settings.tenant, role)[1]


@pytest.fixture
def open_api(make_settings: Callable[..., Settings]) -> Iterator[Callable[..., Api]]:
    """Serve the API for a fresh tenant (local storage; `overrides` for the settings) and connect to its
    `/api/v1` with an admin key of that tenant."""
    with contextlib.ExitStack() as stack:

        def start(**overrides: Any) -> Api:
            settings = make_settings("local", **overrides)
            url = stack.enter_context(serve_api(settings))
            headers = {"Authorization": f"ApiKey {_key(settings, 'admin')}"}
            client = stack.enter_context(httpx.Client(base_url=f"{url}/api/v1", headers=headers, timeout=60))
            return client, settings

        yield start


def _create(http: httpx.Client, name: str, **extra: Any) -> None:
    r = http.post("/datasets", json={"name": name, "dimensions": 2, **extra})
    assert r.status_code == 201, r.text


def _upsert(http: httpx.Client, name: str, vectors: list[dict[str, Any]]) -> None:
    r = http.post(f"/datasets/{name}/vectors", json={"vectors": vectors})
    assert r.status_code == 200, r.text


def _error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["success"] is False and body["error_code"] == code, body
    return body["details"]  # type: ignore[no-any-return]


# -- 1: the metric a search labels and merges with ---------------------------------------------------------


def test_search_answers_with_the_metric_a_reindex_elsewhere_swapped_in(
    open_api: Callable[..., Api], redis_url: str
) -> None:
    # The dataset cache on (a real Valkey), as in every deployment with a broker: the first search caches the
    # dataset's record, and the reindex below runs in another client, which cannot touch this process's cache.
    http, settings = open_api(redis_url=redis_url)
    _create(http, "docs")  # cosine
    _create(http, "other", metric_type="dot_product")
    _upsert(http, "docs", [{"id": "a", "values": [1, 0]}, {"id": "b", "values": [10, 1]}])
    _upsert(http, "other", [{"id": "o1", "values": [3, 0]}, {"id": "o2", "values": [0.5, 0]}])
    query = {"vector": [1, 0], "top_k": 2, "consistency": "strong"}
    before = http.post("/datasets/docs/search", json=query).json()
    assert (before["metric_type"], before["higher_is_better"]) == ("cosine", False)

    with Shoal(settings, notify=False) as shoal:
        assert shoal.reindex("docs", "1", metric="dot_product", wait=True).state == "swapped"

    # The API's searcher serves the new generation at its next poll (SHOAL_SEARCHER_POLL_S); its answers must
    # then say so, where they said cosine for as long as the cached record lived (an hour).
    def answered() -> dict[str, Any]:
        return http.post("/datasets/docs/search", json=query).json()  # type: ignore[no-any-return]

    wait_for(lambda: answered()["metric_type"] == "dot_product", 30, "search to answer with the new metric")
    after = answered()
    assert after["higher_is_better"] is True
    assert [(h["id"], h["score"]) for h in after["results"]] == [("b", pytest.approx(10.0)), ("a", pytest.approx(1.0))]

    # Both datasets now rank higher-is-nearer: `score` merges them, largest first.
    r = http.post("/search/multi-dataset", json={"query_vector": [1, 0], "datasets": ["docs", "other"],
                                                 "options": {"top_k": 4, "merge_strategy": "score",
                                                             "consistency": "strong"}})
    assert r.status_code == 200, r.text
    assert [(h["dataset_id"], h["id"]) for h in r.json()["results"]] == [
        ("docs", "b"), ("other", "o1"), ("docs", "a"), ("other", "o2")]


# -- 2: metadata nested deeper than the dataset API allows -------------------------------------------------


def test_metadata_nested_past_the_limit_through_vektonn_is_answered_as_its_text(open_api: Callable[..., Api]) -> None:
    http, _ = open_api()
    _create(http, "dm")
    _upsert(http, "dm", [{"id": "ok", "values": [0, 1], "metadata": {"language": "en"}}])
    upload = str(http.base_url).removesuffix("/") + "/upload/dm/1"
    deep = {depth: "[" * depth + "]" * depth for depth in (33, 300, 3000)}  # 33: one past the API's own limit
    for depth, text in deep.items():
        point = [{"attributes": [{"key": "id", "value": {"string": f"deep{depth}"}},
                                 {"key": "metadata", "value": {"string": text}},
                                 {"key": "document_id", "value": {"string": ""}},
                                 {"key": "content", "value": {"string": ""}}],
                  "vector": {"isSparse": False, "coordinates": [1.0, 0.0]}}]
        assert httpx.post(upload, json=point, headers=http.headers).status_code == 200

    r = http.post("/datasets/dm/search", json={"vector": [1, 0], "top_k": 10, "consistency": "strong"})
    assert r.status_code == 200, r.text
    metadata = {h["id"]: h["metadata"] for h in r.json()["results"]}
    assert metadata == {"ok": {"language": "en"}, **{f"deep{d}": text for d, text in deep.items()}}

    r = http.post("/search/multi-dataset", json={"query_vector": [1, 0], "datasets": ["dm"],
                                                 "options": {"top_k": 10, "consistency": "strong"}})
    assert r.status_code == 200, r.text
    assert {h["id"]: h["metadata"] for h in r.json()["results"]} == metadata

    r = http.get("/datasets/dm/stats")
    assert r.status_code == 200, r.text
    stats = r.json()["metadata_stats"]
    # The texts are no metadata object, as search shows them: only "ok" counts.
    assert (stats["vectors_with_metadata"], stats["languages"], stats["metadata_keys"]) == (1, {"en": 1},
                                                                                          {"language": 1})


# -- 3: /stats' index bytes after a reindex ------------------------------------------------------------------


def _files_under(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def test_stats_count_the_index_files_of_the_generation_a_reindex_swapped_in(open_api: Callable[..., Api]) -> None:
    http, settings = open_api()
    _create(http, "docs")
    _upsert(http, "docs", [{"id": f"v{i}", "values": [i, 1]} for i in range(20)])
    with Shoal(settings, notify=False) as shoal:  # no worker runs: build the first generation here
        for shard in shoal.get_index("docs", "1").shards:
            ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)
    folder = Path(str(settings.storage_uri)) / "tenants" / settings.tenant / "indexes" / "docs"

    def storage() -> dict[str, Any]:
        r = http.get("/datasets/docs/stats")
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    built = storage()
    assert (built["storage"]["index_bytes"], built["storage"]["index_files"]) == _files_under(folder) != (0, 0)

    r = http.post("/datasets/docs/reindex?async=false", json={"index_config": {"M": 32}})
    assert r.status_code == 202 and r.json()["state"] == "swapped", r.text
    after = storage()
    # The new generation lives in its own folder (1/gen-2) beside the first one's, kept for rollback: both count.
    assert sorted(p.name for p in folder.iterdir()) == ["1"]
    assert sorted(p.name for p in (folder / "1").iterdir()) == ["gen-1", "gen-2"]
    assert (after["storage"]["index_bytes"], after["storage"]["index_files"]) == _files_under(folder)
    assert after["storage"]["index_bytes"] - built["storage"]["index_bytes"] == _files_under(folder / "1" / "gen-2")[0]
    assert after["storage"]["index_bytes"] >= after["memory_usage_bytes"] > 0  # what serves is counted
    assert after["storage_size"] == sum(after["storage"][k] for k in ("log_bytes", "index_bytes", "metadata_bytes"))


# -- 4: error shapes -------------------------------------------------------------------------------------------


def test_errors_after_a_valid_key_name_its_tenant_and_a_listed_code(open_api: Callable[..., Api]) -> None:
    http, settings = open_api()
    _create(http, "e")
    reader = httpx.Client(base_url=http.base_url, headers={"Authorization": f"ApiKey {_key(settings, 'read')}"},
                          timeout=60)
    json_body = {"content-type": "application/json"}
    with reader:
        details = _error(reader.post("/datasets", json={"name": "x", "dimensions": 2}), 403, "FORBIDDEN")
        assert details["tenant_id"] == settings.tenant
        details = _error(reader.post("/datasets", content=b"{", headers=json_body), 400, "VALIDATION_ERROR")
        assert details["tenant_id"] == settings.tenant  # the body failed, not the key
    details = _error(http.post("/datasets", content=b"{", headers=json_body), 400, "VALIDATION_ERROR")
    assert details["tenant_id"] == settings.tenant
    # An integer past Python's 4300 digits: FastAPI's own 400 ("HTTP_ERROR" before), in the documented codes.
    r = http.post("/datasets", content=b'{"name":"x","dimensions":' + b"9" * 4400 + b"}", headers=json_body)
    details = _error(r, 400, "VALIDATION_ERROR")
    assert details["tenant_id"] == settings.tenant and details["field"] == "body"
    assert "4300 digits" in r.json()["message"]
    # A key that fails: no tenant, and the key is what the answer is about, whatever the body.
    bad = httpx.post(f"{http.base_url}datasets", content=b"{", headers={**json_body, "Authorization": "ApiKey nope"})
    assert _error(bad, 401, "UNAUTHORIZED")["tenant_id"] is None
    assert http.get("/datasets").json()["total"] == 1  # nothing was created


def test_reindex_reads_default_beside_index_config_as_create_does_and_refusals_alike(
    open_api: Callable[..., Api],
) -> None:
    http, _ = open_api()
    body = {"index_type": "default", "index_config": {"index_type": "flat"}}
    r = http.post("/datasets", json={"name": "a", "dimensions": 2, **body})
    assert r.status_code == 201 and r.json()["index_type"] == "flat", r.text
    r = http.post("/datasets/a/reindex?async=false", json=body)
    assert r.status_code == 202 and r.json()["state"] == "swapped", r.text
    assert r.json()["definition"]["algorithm"] == "flat"
    r = http.post("/datasets/a/reindex?async=false",
                  json={"index_type": "hnsw", "index_config": {"index_type": "default"}})
    assert r.status_code == 202 and r.json()["definition"]["algorithm"] == "hnsw", r.text
    _error(http.post("/datasets/a/reindex", json={"index_type": "ivf", "index_config": {"index_type": "flat"}}),
           400, "INVALID_DATASET_CONFIG")  # two named types still disagree

    # hnsw for manhattan (only flat computes L1): create and both forms of reindex refuse it alike.
    _error(http.post("/datasets", json={"name": "m", "dimensions": 2, "metric_type": "manhattan",
                                        "index_type": "hnsw"}), 400, "INVALID_DATASET_CONFIG")
    _create(http, "m2", metric_type="manhattan")
    details = _error(http.post("/datasets/m2/reindex?async=false", json={"index_type": "hnsw"}), 400,
                     "INVALID_DATASET_CONFIG")
    assert (details["field"], details["index_type"], details["metric_type"]) == ("index_type", "hnsw", "manhattan")
    details = _error(http.post("/datasets/m2/reindex?async=false", json={"index_config": {"index_type": "hnsw"}}),
                     400, "INVALID_DATASET_CONFIG")
    assert details["field"] == "index_config"
    assert http.get("/datasets/m2").json()["index_type"] == "flat"  # nothing was swapped in


# -- 5: filters on document_id and content ---------------------------------------------------------------


def test_filters_read_a_vector_without_document_id_or_content_as_a_metadata_field_without_the_key(
    open_api: Callable[..., Api],
) -> None:
    http, _ = open_api()
    _create(http, "dz", metric_type="euclidean", index_type="flat")
    # Each vector's metadata mirrors its document_id and content (`doc`, `text`), left out where they are: a
    # filter on the attribute must select what the same filter on the metadata field selects.
    _upsert(http, "dz", [
        {"id": "with", "values": [0.0, 0.0], "document_id": "doc1", "content": "hello",
         "metadata": {"doc": "doc1", "text": "hello"}},
        {"id": "without", "values": [0.1, 0.0]},
        {"id": "blank", "values": [0.15, 0.0], "document_id": "", "content": ""},
        {"id": "other", "values": [0.2, 0.0], "document_id": "doc2", "content": "zzz",
         "metadata": {"doc": "doc2", "text": "zzz"}},
    ])

    def ids(flt: dict[str, Any]) -> list[str]:
        r = http.post("/datasets/dz/search", json={"vector": [0, 0], "top_k": 10, "consistency": "strong",
                                                   "filters": flt})
        assert r.status_code == 200, (flt, r.text)
        return [h["id"] for h in r.json()["results"]]

    everything = ["with", "without", "blank", "other"]
    assert ids({}) == everything
    expected: dict[str | None, list[str]] = {
        "doc1": ["with"],
        "": [],  # "" is how "none" is stored, never a value
        None: ["without", "blank"],
    }
    for value, want in expected.items():
        assert ids({"document_id": value}) == ids({"doc": value}) == want, value
    conditions: list[tuple[Any, list[str]]] = [
        ({"$lt": "doc2"}, ["with"]),
        ({"$lte": "doc1"}, ["with"]),
        ({"$gt": ""}, ["with", "other"]),
        ({"$gte": ""}, ["with", "other"]),
        ({"$gte": "doc2"}, ["other"]),
        ({"$eq": ""}, []),
        ({"$eq": None}, ["without", "blank"]),
        ({"$ne": None}, ["with", "other"]),
        ({"$ne": "doc1"}, ["without", "blank", "other"]),
        ({"$ne": ""}, everything),
        ({"$in": ["doc1", "", None]}, ["with"]),
        ({"$nin": ["doc1", "doc2"]}, ["without", "blank"]),
        ({"$nin": [None]}, everything),
        ({"$gt": "doc0", "$ne": "doc2"}, ["with"]),
    ]
    for condition, want in conditions:
        assert ids({"document_id": condition}) == ids({"doc": condition}) == want, condition
        assert ids({"$not": {"document_id": condition}}) == ids({"$not": {"doc": condition}}), condition
    assert ids({"content": {"$lt": "m"}}) == ids({"text": {"$lt": "m"}}) == ["with"]
    assert ids({"content": None, "document_id": None}) == ["without", "blank"]
    assert ids({"$or": [{"content": "zzz"}, {"document_id": {"$eq": None}}]}) == ["without", "blank", "other"]
    r = http.post("/datasets/dz/search", json={"vector": [0, 0], "filters": {"document_id": {"$lt": 5}}})
    details = _error(r, 400, "VALIDATION_ERROR")  # still typed: a number is no document id
    assert details["field"] == "filters" and "document_id" in r.json()["message"]
