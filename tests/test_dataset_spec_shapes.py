"""The dataset API's request and response shapes as the DeepLake API specifies them (issue 15, "Shapes and rules
to match"), through HTTP with the specified bodies, asserting what a client written against that specification
checks. Today's forms keep working (tests/test_api_datasets.py). Real Postgres, Valkey and storage; the index is
built in-process by the real builder where a test needs one, and searches ask for `strong` consistency."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
from conftest import serve_api

from shoal import Shoal
from shoal.auth import create_key
from shoal.config.settings import Settings
from shoal.index.builder import ShardBuilder

DEFAULT_HNSW = {"M": 16, "ef_construction": 200, "ef_search": 50}
DEFAULT_IVF = {"nlist": 100, "nprobe": 10}


class Api:
    """A served API for a fresh tenant, called with an admin key."""

    def __init__(self, http: httpx.Client, shoal: Shoal, settings: Settings) -> None:
        self.http, self.shoal, self.settings = http, shoal, settings
        self.tenant = settings.tenant

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post("/api/v1/datasets", json=body)
        assert r.status_code == 201, r.text
        return r.json()  # type: ignore[no-any-return]

    def upsert(self, name: str, *vectors: dict[str, Any]) -> None:
        r = self.http.post(f"/api/v1/datasets/{name}/vectors", json={"vectors": list(vectors)})
        assert r.status_code == 200, r.text

    def stats(self, name: str) -> dict[str, Any]:
        r = self.http.get(f"/api/v1/datasets/{name}/stats")
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def error(self, r: httpx.Response, status: int, code: str) -> dict[str, Any]:
        """The error body after checking its shape, status and code; its details name the caller's tenant and
        carry an action hint."""
        assert r.status_code == status, r.text
        body = r.json()
        assert list(body) == ["success", "error_code", "message", "details"], body
        assert (body["success"], body["error_code"]) == (False, code), body
        assert body["details"]["tenant_id"] == self.tenant, body
        assert isinstance(body["details"]["action"], str) and body["details"]["action"], body
        return body  # type: ignore[no-any-return]

    def names(self) -> list[str]:
        return [d["name"] for d in self.http.get("/api/v1/datasets").json()["datasets"]]


@pytest.fixture
def api(make_settings: Any, redis_url: str) -> Iterator[Api]:
    settings = make_settings("local", redis_url=redis_url)
    with Shoal(settings, notify=False) as shoal, serve_api(settings) as url:
        key = create_key(shoal.engine, settings.tenant, "admin")[1]
        with httpx.Client(base_url=url, headers={"Authorization": f"ApiKey {key}"}, timeout=60) as http:
            yield Api(http, shoal, settings)


def vec(vid: str, values: list[float], **extra: Any) -> dict[str, Any]:
    return {"id": vid, "values": values, **extra}


# -- 1. create: index_config, "default", partial params, defaults, ranges, manhattan ---------------------------


def test_create_takes_index_config_partial_params_and_the_default_index_type(api: Api) -> None:
    # The specified form: HNSW params given partly, the rest from the specified defaults.
    body = api.create({"name": "partial", "dimensions": 4, "index_type": "hnsw",
                       "index_config": {"M": 32, "ef_construction": 300}})
    assert body["index_type"] == "hnsw"
    assert api.stats("partial")["parameters"] == {"M": 32, "ef_construction": 300, "ef_search": 50}
    assert api.shoal.get_index("partial", "1").spec.params == {"M": 32, "ef_construction": 300, "ef_search": 50}

    # "default" is the documented default, hnsw with its default params.
    assert api.create({"name": "dflt", "dimensions": 4, "index_type": "default"})["index_type"] == "hnsw"
    assert api.stats("dflt")["parameters"] == DEFAULT_HNSW

    # IVF's defaults; the type may also come inside index_config.
    assert api.create({"name": "ivf-default", "dimensions": 4, "index_type": "ivf"})["index_type"] == "ivf"
    assert api.stats("ivf-default")["parameters"] == DEFAULT_IVF
    body = api.create({"name": "ivf-config", "dimensions": 4, "index_config": {"index_type": "ivf", "nprobe": 20}})
    assert body["index_type"] == "ivf"
    assert api.stats("ivf-config")["parameters"] == {"nlist": 100, "nprobe": 20}

    # Today's form keeps working (index_params, complete or partial).
    api.create({"name": "older", "dimensions": 4, "index_params": {"M": 8, "ef_construction": 100, "ef_search": 10}})
    assert api.stats("older")["parameters"] == {"M": 8, "ef_construction": 100, "ef_search": 10}
    r = api.http.post("/api/v1/datasets", json={"name": "both", "dimensions": 4, "index_config": {"M": 16},
                                                "index_params": {"M": 16}})
    assert api.error(r, 400, "INVALID_DATASET_CONFIG")["details"]["field"] == "index_params"


@pytest.mark.parametrize(
    ("config", "field", "value", "allowed"),
    [
        ({"M": 7}, "index_config.M", 7, {"min": 8, "max": 64}),
        ({"M": 65}, "index_config.M", 65, {"min": 8, "max": 64}),
        ({"ef_construction": 99}, "index_config.ef_construction", 99, {"min": 100, "max": 500}),
        ({"ef_construction": 501}, "index_config.ef_construction", 501, {"min": 100, "max": 500}),
        ({"ef_search": 9}, "index_config.ef_search", 9, {"min": 10, "max": 500}),
        ({"ef_search": 501}, "index_config.ef_search", 501, {"min": 10, "max": 500}),
        ({"index_type": "ivf", "nlist": 16, "nprobe": 17}, "index_config.nprobe", 17, {"min": 1, "max": 16}),
        ({"index_type": "ivf", "nprobe": 101}, "index_config.nprobe", 101, {"min": 1, "max": 100}),
    ],
)
def test_index_parameter_ranges_are_enforced_with_the_specified_error(
    api: Api, config: dict[str, Any], field: str, value: int, allowed: dict[str, int]
) -> None:
    r = api.http.post("/api/v1/datasets", json={"name": "docs", "dimensions": 4, "index_config": config})
    details = api.error(r, 400, "INVALID_DATASET_CONFIG")["details"]
    assert (details["field"], details["value"], details["allowed_range"]) == (field, value, allowed)
    assert api.names() == []  # nothing created
    # The same rules hold for a reindex's index_config; nothing is started.
    api.create({"name": "live", "dimensions": 4})
    r = api.http.post("/api/v1/datasets/live/reindex", json={"index_config": config, "async": False})
    assert api.error(r, 400, "INVALID_DATASET_CONFIG")["details"]["allowed_range"] == allowed
    assert api.stats("live")["parameters"] == DEFAULT_HNSW


def test_manhattan_alone_picks_an_index_type_that_supports_it(api: Api) -> None:
    body = api.create({"name": "l1", "dimensions": 2, "metric_type": "manhattan"})
    assert (body["metric_type"], body["index_type"]) == ("manhattan", "flat")
    assert api.create({"name": "l1-default", "dimensions": 2, "metric_type": "manhattan",
                       "index_type": "default"})["index_type"] == "flat"
    api.upsert("l1", vec("a", [1, 1]), vec("b", [3, 0]))
    r = api.http.post("/api/v1/datasets/l1/search", json={"vector": [0, 0], "top_k": 2, "consistency": "strong"})
    assert r.status_code == 200, r.text
    assert [(h["id"], h["score"]) for h in r.json()["results"]] == [("a", 2.0), ("b", 3.0)]
    # Asking for an index type without manhattan stays refused, naming the problem.
    r = api.http.post("/api/v1/datasets", json={"name": "l1-hnsw", "dimensions": 2, "metric_type": "manhattan",
                                                "index_type": "hnsw"})
    assert "manhattan" in api.error(r, 400, "INVALID_DATASET_CONFIG")["message"]


# -- 2. multi-dataset search: the specified body -----------------------------------------------------------------


def test_multi_dataset_search_takes_the_specified_body_and_filters(api: Api) -> None:
    for name, points in (("left", [("l1", [1, 0]), ("l2", [3, 0])]), ("right", [("r1", [2, 0])])):
        api.create({"name": name, "dimensions": 2, "metric_type": "euclidean", "index_type": "flat"})
        api.upsert(name, *(vec(i, v) for i, v in points))
    body = {"query_vector": [0, 0], "datasets": ["left", "right"],
            "options": {"top_k": 3, "merge_strategy": "score", "consistency": "strong"}}
    r = api.http.post("/api/v1/search/multi-dataset", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["merge_strategy"], out["top_k"], out["dataset_ids"]) == ("score", 3, ["left", "right"])
    assert [(h["dataset_id"], h["id"], h["score"]) for h in out["results"]] == [
        ("left", "l1", 1.0), ("right", "r1", 2.0), ("left", "l2", 3.0)]

    # Filters apply to every dataset (tests/test_filtered_search.py covers them); a bad one is refused naming
    # its attribute, and an empty one is no filter.
    r = api.http.post("/api/v1/search/multi-dataset",
                      json=body | {"options": body["options"] | {"filters": {"id": {"$in": ["l2", "r1"]}}}})
    assert r.status_code == 200, r.text
    assert [h["id"] for h in r.json()["results"]] == ["r1", "l2"]
    r = api.http.post("/api/v1/search/multi-dataset",
                      json=body | {"options": body["options"] | {"filters": {"id": 5}}})
    error = api.error(r, 400, "VALIDATION_ERROR")
    assert "filters" in error["message"] and error["details"]["field"] == "options.filters"
    assert "'id'" in error["message"]
    r = api.http.post("/api/v1/search/multi-dataset", json=body | {"options": body["options"] | {"filters": {}}})
    assert r.status_code == 200, r.text
    # A dataset given by a name the tenant does not have is not found.
    r = api.http.post("/api/v1/search/multi-dataset", json=body | {"datasets": ["left", "nope"]})
    assert api.error(r, 404, "DATASET_NOT_FOUND")["details"]["dataset_id"] == "nope"
    # Today's body keeps working; mixing the two forms for one value is refused.
    r = api.http.post("/api/v1/search/multi-dataset", json={"dataset_ids": ["right"], "vector": [0, 0],
                                                            "consistency": "strong"})
    assert [h["id"] for h in r.json()["results"]] == ["r1"]
    r = api.http.post("/api/v1/search/multi-dataset", json=body | {"vector": [0, 0]})
    assert api.error(r, 400, "VALIDATION_ERROR")["details"]["field"] == "query_vector"


# -- 3. responses: storage_location, tenant_id, list, delete, errors, dimensions ------------------------------


def test_dataset_objects_and_the_list_carry_storage_location_and_tenant_id(api: Api) -> None:
    created = api.create({"name": "docs", "dimensions": 2})
    got = api.http.get("/api/v1/datasets/docs").json()
    listed = api.http.get("/api/v1/datasets").json()
    for d in (created, got, listed["datasets"][0]):
        assert d["tenant_id"] == api.tenant
        location = urlparse(d["storage_location"])
        assert location.scheme == "file"
        assert location.path.endswith(f"/tenants/{api.tenant}/datasets/docs/")
        assert (Path(location.path) / "dataset_metadata.json").is_file()  # the folder it names is the dataset's
    assert (listed["total"], listed["limit"], listed["offset"], listed["has_more"], listed["tenant_id"]) == (
        1, 100, 0, False, api.tenant)
    api.create({"name": "more", "dimensions": 2})
    page = api.http.get("/api/v1/datasets", params={"limit": 1}).json()
    assert ([d["name"] for d in page["datasets"]], page["total"], page["has_more"]) == (["docs"], 2, True)
    page = api.http.get("/api/v1/datasets", params={"limit": 1, "offset": 1}).json()
    assert ([d["name"] for d in page["datasets"]], page["has_more"]) == (["more"], False)


def test_delete_answers_message_and_deleted_at(api: Api) -> None:
    api.create({"name": "docs", "dimensions": 2})
    before = dt.datetime.now(dt.UTC)
    r = api.http.delete("/api/v1/datasets/docs")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["success"] is True and out["dataset_id"] == "docs"
    assert "docs" in out["message"] and "trash" in out["message"]
    deleted_at = dt.datetime.fromisoformat(out["deleted_at"])
    assert before - dt.timedelta(seconds=5) <= deleted_at <= dt.datetime.now(dt.UTC)
    api.create({"name": "gone", "dimensions": 2})
    out = api.http.delete("/api/v1/datasets/gone", params={"hard": "true"}).json()
    assert "deleted" in out["message"] and out["deleted_at"] and out["soft"] is False


def test_errors_carry_tenant_id_and_action_and_overwrite_works_as_the_hint_says(api: Api) -> None:
    api.error(api.http.get("/api/v1/datasets/nope"), 404, "DATASET_NOT_FOUND")
    api.create({"name": "docs", "dimensions": 2, "description": "old"})
    api.upsert("docs", vec("a", [1, 0]))
    r = api.http.post("/api/v1/datasets", json={"name": "docs", "dimensions": 3})
    hint = api.error(r, 409, "DATASET_ALREADY_EXISTS")["details"]["action"]
    assert "overwrite=true" in hint
    fresh = api.create({"name": "docs", "dimensions": 3, "overwrite": True})  # as the hint says
    assert (fresh["dimensions"], fresh["description"], fresh["vector_count"]) == (3, None, 0)
    api.error(api.http.post("/api/v1/datasets", json={"name": "docs"}), 400, "VALIDATION_ERROR")
    # Before the caller is known, the tenant is null and the hint says how to authenticate.
    r = api.http.get("/api/v1/datasets", headers={"Authorization": "ApiKey nope"})
    assert r.status_code == 401
    assert r.json()["details"]["tenant_id"] is None and "ApiKey" in r.json()["details"]["action"]


@pytest.mark.parametrize("dimensions", [0, 10001, -3])
def test_dimensions_out_of_range_are_an_invalid_config_naming_the_range(api: Api, dimensions: int) -> None:
    r = api.http.post("/api/v1/datasets", json={"name": "docs", "dimensions": dimensions})
    details = api.error(r, 400, "INVALID_DATASET_CONFIG")["details"]
    assert (details["field"], details["value"], details["allowed_range"]) == (
        "dimensions", dimensions, {"min": 1, "max": 10000})


# -- 4. /stats -----------------------------------------------------------------------------------------------


def test_stats_has_the_specified_fields_and_counts_live_vectors_everywhere(api: Api) -> None:
    api.create({"name": "docs", "dimensions": 2, "metric_type": "euclidean", "index_type": "flat"})
    # 8 upserts of 7 ids, then one id deleted (a Vektonn tombstone carries every attribute): 6 live.
    api.upsert("docs",
               vec("a", [1, 0], document_id="d1", metadata={"language": "en", "content_type": "text/markdown"}),
               vec("b", [2, 0], document_id="d1", metadata={"language": "en", "content_type": "text/plain"}),
               vec("c", [3, 0], document_id="d2", metadata={"language": "fr", "content_type": "text/plain"}),
               vec("d", [4, 0], document_id="d3"))
    api.upsert("docs", vec("a", [1, 1], document_id="d1", metadata={"language": "en",
                                                                     "content_type": "text/markdown"}),
               vec("e", [5, 0]), vec("f", [6, 0]), vec("g", [7, 0]))
    tombstone = [{"attributes": [{"key": "id", "value": {"string": "g"}},
                                 {"key": "document_id", "value": {"string": ""}},
                                 {"key": "content", "value": {"string": ""}},
                                 {"key": "metadata", "value": {"string": "null"}}], "isDeleted": True}]
    r = api.http.post("/api/v1/upload/docs/1", json=tombstone)
    assert r.status_code == 200, r.text

    stats = api.stats("docs")
    assert stats["vector_count"] == 6
    assert api.http.get("/api/v1/datasets/docs").json()["vector_count"] == 6  # not the 8 upserts
    assert api.http.get("/api/v1/datasets").json()["datasets"][0]["vector_count"] == 6
    assert stats["tenant_id"] == api.tenant
    assert stats["unique_documents"] == 3
    assert stats["storage_size"] > 0 and stats["parameters"] == {}
    assert stats["metadata_stats"]["languages"] == {"en": 2, "fr": 1}
    assert stats["metadata_stats"]["content_types"] == {"text/markdown": 1, "text/plain": 2}
    assert (stats["memory_usage_bytes"], stats["build_time_seconds"], stats["last_rebuild_at"]) == (0, None, None)
    summary = stats["dataset"]
    assert summary == api.http.get("/api/v1/datasets/docs").json()  # the dataset itself
    assert (summary["name"], summary["vector_count"], summary["index_type"]) == ("docs", 6, "flat")

    # Once built, the served index's files count as its memory; a rebuild records when and how long.
    for shard in api.shoal.get_index("docs", "1").shards:
        ShardBuilder(api.shoal.engine, api.shoal.storage).materialize(shard.id)
    assert api.stats("docs")["memory_usage_bytes"] > 0
    r = api.http.post("/api/v1/datasets/docs/reindex",
                      json={"index_config": {"index_type": "hnsw", "M": 12}, "async": False})
    assert (r.status_code, r.json()["state"]) == (202, "swapped"), r.text
    stats = api.stats("docs")
    assert stats["parameters"] == {"M": 12, "ef_construction": 200, "ef_search": 50}
    assert dt.datetime.fromisoformat(stats["last_rebuild_at"]) <= dt.datetime.now(dt.UTC)
    assert stats["build_time_seconds"] >= 0 and stats["memory_usage_bytes"] > 0
    assert stats["dataset"]["index_type"] == "hnsw"


def test_stats_leave_out_language_and_content_type_counts_when_no_metadata_has_them(api: Api) -> None:
    api.create({"name": "docs", "dimensions": 2})
    api.upsert("docs", vec("a", [1, 0], metadata={"lang": "en"}))
    meta = api.stats("docs")["metadata_stats"]
    assert "languages" not in meta and "content_types" not in meta


# -- 5. custom metadata: types, quota ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "field"),
    [
        ({"quota_limit": 0}, "metadata.quota_limit"),
        ({"quota_limit": -5}, "metadata.quota_limit"),
        ({"quota_limit": "100"}, "metadata.quota_limit"),
        ({"quota_limit": 1.5}, "metadata.quota_limit"),
        ({"quota_limit": True}, "metadata.quota_limit"),
        ({"tags": "a,b"}, "metadata.tags"),
        ({"tags": ["a", 1]}, "metadata.tags"),
        ({"retention_days": -1}, "metadata.retention_days"),
        ({"retention_days": "30"}, "metadata.retention_days"),
    ],
)
def test_custom_metadata_is_type_checked(api: Api, metadata: dict[str, Any], field: str) -> None:
    r = api.http.post("/api/v1/datasets", json={"name": "docs", "dimensions": 2, "metadata": metadata})
    assert api.error(r, 400, "INVALID_DATASET_CONFIG")["details"]["field"] == field
    assert api.names() == []
    good = {"quota_limit": 10, "tags": ["a", "b"], "retention_days": 0, "team": "search"}
    assert api.create({"name": "docs", "dimensions": 2, "metadata": good})["metadata"] == good
    api.error(api.http.put("/api/v1/datasets/docs", json={"metadata": metadata}), 400, "INVALID_DATASET_CONFIG")
    assert api.http.get("/api/v1/datasets/docs").json()["metadata"] == good  # the refused update changed nothing


def test_quota_limit_is_enforced_on_upload(api: Api) -> None:
    api.create({"name": "docs", "dimensions": 2, "metadata": {"quota_limit": 3}})
    api.upsert("docs", vec("a", [1, 0]), vec("b", [2, 0]))
    api.upsert("docs", vec("a", [1, 1]), vec("c", [3, 0]))  # "a" is replaced: 3 live, at the quota
    r = api.http.post("/api/v1/datasets/docs/vectors", json={"vectors": [vec("b", [2, 2]), vec("d", [4, 0])]})
    details = api.error(r, 403, "QUOTA_EXCEEDED")["details"]
    assert (details["quota_limit"], details["vector_count"], details["new_vectors"]) == (3, 3, 1)
    assert "quota_limit" in details["action"]
    assert api.stats("docs")["vector_count"] == 3  # nothing of the refused batch was written
    api.upsert("docs", vec("b", [2, 2]))  # replacing a live vector stays allowed
    # Raising the quota lets the batch in.
    r = api.http.put("/api/v1/datasets/docs", json={"metadata": {"quota_limit": 4}})
    assert r.status_code == 200, r.text
    api.upsert("docs", vec("d", [4, 0]))
    assert api.stats("docs")["vector_count"] == 4
    # A quota lowered below what the dataset holds: the refusal says so, not "0 new vectors would exceed it".
    assert api.http.put("/api/v1/datasets/docs", json={"metadata": {"quota_limit": 2}}).status_code == 200
    r = api.http.post("/api/v1/datasets/docs/vectors", json={"vectors": [vec("a", [5, 5])]})
    message = api.error(r, 403, "QUOTA_EXCEEDED")["message"]
    assert "delete vectors first" in message and "0 new vectors" not in message, message


def test_a_batch_over_the_batch_limit_is_refused_as_such_before_the_quota(make_settings: Any, redis_url: str) -> None:
    """A dataset with a quota answered 403 QUOTA_EXCEEDED to a batch over SHOAL_MAX_BATCH_POINTS (the quota was
    checked first, reading the whole log): the batch limit comes first, as on every upload path."""
    settings = make_settings("local", redis_url=redis_url, max_batch_points=5)
    with Shoal(settings, notify=False) as shoal, serve_api(settings) as url:
        key = create_key(shoal.engine, settings.tenant, "admin")[1]
        with httpx.Client(base_url=url, headers={"Authorization": f"ApiKey {key}"}, timeout=60) as http:
            api = Api(http, shoal, settings)
            api.create({"name": "docs", "dimensions": 2, "metadata": {"quota_limit": 4}})
            r = http.post("/api/v1/datasets/docs/vectors", json={"vectors": [vec(str(i), [i, 0]) for i in range(6)]})
            assert "SHOAL_MAX_BATCH_POINTS" in api.error(r, 400, "VALIDATION_ERROR")["message"]
            assert api.stats("docs")["vector_count"] == 0


# -- 6. names and overwrite ----------------------------------------------------------------------------------


def test_shared_is_reserved_like_default_and_system(api: Api) -> None:
    for name in ("shared", "default", "system"):
        r = api.http.post("/api/v1/datasets", json={"name": name, "dimensions": 2})
        details = api.error(r, 400, "RESERVED_DATASET_NAME")["details"]
        assert name in details["reserved_names"]
    api.error(api.http.get("/api/v1/datasets/shared"), 404, "DATASET_NOT_FOUND")
    assert api.names() == []
