"""Management routes, third round: a reindex's metric beside a Vektonn type, misspelt body fields, the reindex
gate's type, an extra index over a dataset's data source, the error shape of requests no route handler sees,
a data source's description bound, and what /openapi.json documents."""

from __future__ import annotations

import datetime as dt

import httpx
import pytest

from shoal import DataPoint, DataSourceSpec, Shoal
from shoal.auth import create_key
from shoal.config.settings import Settings
from shoal.errors import IndexDefinitionError, PermissionDeniedError, ValidationError
from shoal.log.records import MAX_DESCRIPTION, IndexSpec

SOURCE = {"name": "M.Source", "version": "1", "vectorDimension": 2, "attributeValueTypes": {"id": "int64"},
          "permanentAttributes": ["id"]}
INDEX = {"name": "M.Index", "version": "1", "dataSourceName": "M.Source", "dataSourceVersion": "1"}
REINDEX = "/api/v1/indexes/M.Index/1/reindex"


def _keys(settings: Settings, *roles: str) -> dict[str, dict[str, str]]:
    with Shoal(settings, notify=False) as shoal:
        return {r: {"Authorization": f"ApiKey {create_key(shoal.engine, settings.tenant, r)[1]}"} for r in roles}


def _source_and_index(http: httpx.Client) -> None:
    assert http.post("/api/v1/data-sources", json=SOURCE).status_code == 201
    r = http.post("/api/v1/indexes", json={**INDEX, "metric": "cosine"})
    assert r.status_code == 201, r.text


def test_a_reindex_refuses_a_metric_its_vektonn_type_contradicts(served: tuple[str, Settings]) -> None:
    """`{"algorithm": "FaissIndex.L2", "metric": "cosine"}` answered 202 and built l2_squared, where create refuses
    the same pair: the reindex refuses it alike (400, over HTTP and in Python) and starts nothing; the type's own
    metric is still taken."""
    url, settings = served
    with httpx.Client(base_url=url, timeout=30) as http, Shoal(settings, notify=False) as shoal:
        _source_and_index(http)
        r = http.post(REINDEX, json={"algorithm": "FaissIndex.L2", "metric": "cosine"})
        assert r.status_code == 400, r.text
        [message] = r.json()["errorMessages"]
        assert "FaissIndex.L2 carries its own metric (l2_squared), not 'cosine'" in message
        with pytest.raises(IndexDefinitionError, match="not 'dot_product'"):
            shoal.reindex("M.Index", "1", algorithm="FaissIndex.L2", metric="dot_product")
        assert http.get(REINDEX).json() == [] and shoal.reindex_jobs("M.Index", "1") == []
        assert http.get("/api/v1/indexes/M.Index/1").json()["metric"] == "cosine"
        r = http.post(REINDEX, json={"algorithm": "FaissIndex.L2", "metric": "l2_squared"})
        assert r.status_code == 202, r.text
        assert r.json()["definition"]["metric"] == "l2_squared"
        assert http.delete(REINDEX).status_code == 200


@pytest.mark.parametrize(
    ("method", "path", "body", "fields"),
    [
        ("POST", "/api/v1/data-sources", {**SOURCE, "name": "Typo", "vectorsAreSparce": True}, ["vectorsAreSparce"]),
        ("POST", "/api/v1/indexes", {**INDEX, "name": "Typo", "shardcount": 4, "metirc": "euclidean"},
         ["shardcount", "metirc"]),
        ("PUT", "/api/v1/aliases/typo", {"indexName": "M.Index", "indexVersion": "1", "indexversion": "2"},
         ["indexversion"]),
        ("POST", REINDEX, {"algoritm": "hnsw"}, ["algoritm"]),
    ],
)
def test_a_misspelt_field_in_a_management_body_is_refused(
    served: tuple[str, Settings], method: str, path: str, body: dict[str, object], fields: list[str]
) -> None:
    """A field the body does not define was ignored: a dense source for `vectorsAreSparce`, one shard and cosine
    for `shardcount` and `metirc`, a flat rebuild for `algoritm`. It is refused (400 naming each such field, in
    Vektonn's shape) and nothing is written."""
    url, settings = served
    with httpx.Client(base_url=url, timeout=30) as http, Shoal(settings, notify=False) as shoal:
        _source_and_index(http)
        r = http.request(method, path, json=body)
        assert r.status_code == 400, r.text
        assert [m.split(":")[0] for m in r.json()["errorMessages"]] == fields, r.text
        assert [s.spec.name for s in shoal.list_data_sources()] == ["M.Source"]
        assert [i.spec.name for i in shoal.list_indexes()] == ["M.Index"]
        assert shoal.list_aliases() == [] and shoal.reindex_jobs("M.Index", "1") == []


def test_every_field_a_management_body_defines_is_still_taken(served: tuple[str, Settings]) -> None:
    """Forbidding unknown fields refuses none of the defined ones."""
    url, _ = served
    with httpx.Client(base_url=url, timeout=30) as http:
        r = http.post("/api/v1/data-sources", json={
            **SOURCE, "attributeValueTypes": {"id": "int64", "tag": "string"}, "vectorsAreSparse": False,
            "description": "all fields", "customMetadata": {"team": "x"}})
        assert r.status_code == 201, r.text
        r = http.post("/api/v1/indexes", json={
            **INDEX, "algorithm": "flat", "metric": "euclidean", "params": {}, "idAttributes": ["id"],
            "splitAttributes": [], "shardAttributes": ["id"], "payloadAttributes": ["tag"], "shardCount": 2})
        assert r.status_code == 201, r.text
        r = http.put("/api/v1/aliases/all", json={"indexName": "M.Index", "indexVersion": "1"})
        assert r.status_code == 200, r.text
        r = http.post(REINDEX, json={"algorithm": "flat", "metric": "manhattan", "params": {}, "gate": 1})
        assert r.status_code == 202, r.text
        assert r.json()["gate"] == 1.0 and r.json()["definition"]["metric"] == "manhattan"
        assert http.delete(REINDEX).status_code == 200


@pytest.mark.parametrize("gate", [True, "0.5", "1"])
def test_the_reindex_gate_is_a_number_not_a_flag_or_text(served: tuple[str, Settings], gate: object) -> None:
    """`"gate": true` ran as a gate of 1.0 and `"0.5"` as 0.5, where the Python API refuses both: 400 naming the
    field, and no job."""
    url, settings = served
    with httpx.Client(base_url=url, timeout=30) as http, Shoal(settings, notify=False) as shoal:
        _source_and_index(http)
        r = http.post(REINDEX, json={"gate": gate})
        assert r.status_code == 400, r.text
        [message] = r.json()["errorMessages"]
        assert message.startswith("gate: "), message
        assert shoal.reindex_jobs("M.Index", "1") == []


def test_an_extra_index_over_a_datasets_source_can_be_dropped(served: tuple[str, Settings]) -> None:
    """An index made over a dataset's data source (POST /api/v1/indexes) could never be dropped over HTTP (403
    'belongs to dataset', for every key): it is no part of the dataset and drops as any other; the dataset's own
    index and its data source are still refused."""
    url, settings = served
    keys = _keys(settings, "write", "admin")
    with httpx.Client(base_url=url, timeout=30) as http:
        r = http.post("/api/v1/datasets", json={"name": "docs", "dimensions": 2, "index_type": "flat"},
                      headers=keys["write"])
        assert r.status_code == 201, r.text
        r = http.post("/api/v1/indexes", headers=keys["write"], json={
            "name": "docs.l2", "version": "1", "dataSourceName": "docs", "dataSourceVersion": "1",
            "metric": "euclidean"})
        assert r.status_code == 201, r.text
        r = http.delete("/api/v1/indexes/docs.l2/1", headers=keys["write"])
        assert r.status_code == 204, r.text
        assert http.get("/api/v1/indexes/docs.l2/1").status_code == 404
        for path in ("/api/v1/indexes/docs/1", "/api/v1/data-sources/docs/1"):
            r = http.delete(path, headers=keys["admin"])
            assert r.status_code == 403 and "belongs to dataset 'docs'" in r.json()["errorMessages"][0], r.text
        assert http.get("/api/v1/datasets/docs").status_code == 200
        assert http.get("/api/v1/indexes/docs/1").status_code == 200


def _flat_dataset(http: httpx.Client, headers: dict[str, str], name: str) -> None:
    r = http.post("/api/v1/datasets", json={"name": name, "dimensions": 2, "index_type": "flat"}, headers=headers)
    assert r.status_code == 201, r.text


def test_a_datasets_own_index_is_refused_to_the_python_api_and_the_cli_too(served: tuple[str, Settings]) -> None:
    """Only the HTTP route refused to drop a dataset's own index: `Shoal.drop_index` and `shoal index drop` dropped
    it, and the dataset went on listing and taking uploads while its search, /stats and reindex answered 404."""
    from typer.testing import CliRunner

    from shoal.cli import app

    url, settings = served
    keys = _keys(settings, "write")
    with httpx.Client(base_url=url, timeout=30) as http:
        _flat_dataset(http, keys["write"], "kept")
        with Shoal(settings, notify=False) as shoal, pytest.raises(PermissionDeniedError, match="belongs to dataset"):
            shoal.drop_index("kept", "1")
        env = {"SHOAL_DATA_DIR": str(settings.data_dir), "SHOAL_TENANT": settings.tenant,
               "SHOAL_DATABASE_URL": settings.database_url or "", "SHOAL_STORAGE_URI": settings.storage_uri or ""}
        env = {k: v for k, v in env.items() if v}
        result = CliRunner().invoke(app, ["index", "drop", "kept", "1", "--yes"], env=env)
        assert result.exit_code != 0 and "belongs to dataset 'kept'" in result.output, result.output
        # Its data source likewise (it was dropped for good, and the dataset API went on answering it).
        with Shoal(settings, notify=False) as shoal, pytest.raises(PermissionDeniedError, match="belongs to dataset"):
            shoal.drop_data_source("kept", "1")
        result = CliRunner().invoke(app, ["source", "drop", "kept", "1", "--yes"], env=env)
        assert result.exit_code != 0 and "belongs to dataset 'kept'" in result.output, result.output
        r = http.post("/api/v1/datasets/kept/search", json={"vector": [1.0, 0.0], "top_k": 1}, headers=keys["write"])
        assert r.status_code == 200, r.text


def test_a_stale_dataset_entry_never_answers_with_another_sources_index(served: tuple[str, Settings]) -> None:
    """A dataset dropped where its cache entry outlived it (an invalidation lost in a Redis outage), and a plain
    source and index made under its name: the dataset search answered the foreign source's points as the
    dataset's. The index's data source must be the dataset's."""
    from shoal.upkeep.drops import drop_data_source

    url, settings = served
    keys = _keys(settings, "write")
    with httpx.Client(base_url=url, timeout=30) as http:
        _flat_dataset(http, keys["write"], "gone")
        assert http.get("/api/v1/datasets/gone", headers=keys["write"]).status_code == 200  # cached now
        with Shoal(settings, notify=False) as shoal:
            source_id = shoal.get_data_source("gone", "1").id
            drop_data_source(shoal.engine, source_id, delete_after=dt.datetime.now(dt.UTC))  # no invalidation
            shoal.create_data_source(DataSourceSpec("gone", "1", 2, {"id": "string", "secret": "string"}, ["id"]))
            shoal.create_index(IndexSpec("gone", "1", "gone", "1", algorithm="flat", metric="euclidean"))
            shoal.producer("gone", "1").upload([DataPoint({"id": "foreign", "secret": "s"}, [1.0, 0.0])])
        r = http.post("/api/v1/datasets/gone/search", json={"vector": [1.0, 0.0], "top_k": 1, "consistency": "strong"},
                      headers=keys["write"])
        assert r.status_code == 404 and r.json()["error_code"] == "DATASET_NOT_FOUND", r.text


JSON = {"Content-Type": "application/json"}


@pytest.mark.parametrize(
    ("method", "path", "content", "reason"),
    [
        ("POST", "/api/v1/data-sources", b'{"name": "\xff"}', "utf-8"),
        ("POST", "/api/v1/indexes", b'{"shardCount": ' + b"9" * 5000 + b"}", "4300 digits"),
        ("PUT", "/api/v1/aliases/A", b"[" * 100_000 + b"]" * 100_000, "recursion"),
        ("POST", REINDEX, b"[" * 100_000 + b"]" * 100_000, "recursion"),
    ],
)
def test_a_body_no_json_decoder_can_read_answers_in_vektonns_shape(
    served: tuple[str, Settings], method: str, path: str, content: bytes, reason: str
) -> None:
    """A body that is not UTF-8, holds an integer of 5000 digits or nests 100,000 deep answered FastAPI's
    `{"detail": "There was an error parsing the body"}`, which Vektonn's client cannot read ("Failed to parse
    json"): it answers 400 `{"errorMessages": [...]}` saying why."""
    url, _ = served
    with httpx.Client(base_url=url, timeout=30) as http:
        r = http.request(method, path, content=content, headers=JSON)
        assert r.status_code == 400, r.text
        [message] = r.json()["errorMessages"]
        assert message.startswith("invalid request: the body could not be parsed") and reason in message, message


def test_no_route_and_a_wrong_method_answer_in_the_shape_of_the_api_asked(served: tuple[str, Settings]) -> None:
    """Starlette's own 404 (no route) and 405 (a method the route lacks) answered `{"detail": ...}`: outside the
    dataset API they answer Vektonn's shape, on a dataset route that API's, each with its headers (`Allow`)."""
    url, _ = served
    with httpx.Client(base_url=url, timeout=30) as http:
        r = http.post("/api/v1/search/a/b/1", json={"k": 1, "queryVectors": []})  # an index name with a '/'
        assert r.status_code == 404, r.text
        assert r.json() == {"errorMessages": ["no route matches POST /api/v1/search/a/b/1"]}
        r = http.put("/api/v1/data-sources", json={})
        assert r.status_code == 405, r.text
        assert r.json() == {"errorMessages": ["Method Not Allowed"]}
        assert "GET" in r.headers["Allow"]  # Starlette's header, kept as it is
        r = http.request("PATCH", "/api/v1/datasets/docs", json={})
        assert r.status_code == 405, r.text
        assert r.json()["success"] is False and r.json()["error_code"] == "METHOD_NOT_ALLOWED", r.text
        assert "GET" in r.headers["Allow"]
        # The dataset routes' own answer to an unreadable body holds.
        r = http.post("/api/v1/datasets", content=b'{"name": "\xff"}', headers=JSON)
        assert r.status_code == 400 and r.json()["error_code"] == "VALIDATION_ERROR", r.text


def test_the_body_limit_answers_in_both_shapes_as_before(make_settings) -> None:  # type: ignore[no-untyped-def]
    """The 413 answered before routing keeps its shape on either side of the new HTTP error handler."""
    from conftest import serve_api

    settings = make_settings("local", max_body_bytes=1024)
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    with serve_api(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        big = b'{"x": "' + b"y" * 4096 + b'"}'
        r = http.post("/api/v1/data-sources", content=big, headers=JSON)
        assert r.status_code == 413 and "SHOAL_MAX_BODY_BYTES" in r.json()["errorMessages"][0], r.text
        r = http.post("/api/v1/datasets", content=big, headers=JSON)
        assert r.status_code == 413 and r.json()["error_code"] == "PAYLOAD_TOO_LARGE", r.text


def test_a_data_sources_description_is_bounded(served: tuple[str, Settings]) -> None:
    """A 20,000,000-character description was stored, and every later listing carried it: more than
    MAX_DESCRIPTION characters (the dataset API's bound) is refused, 400 naming the field, nothing written;
    exactly MAX_DESCRIPTION is taken."""
    url, settings = served
    with httpx.Client(base_url=url, timeout=30) as http, Shoal(settings, notify=False) as shoal:
        r = http.post("/api/v1/data-sources", json={**SOURCE, "description": "x" * 20_000_000})
        assert r.status_code == 400, r.text[:300]
        [message] = r.json()["errorMessages"]
        assert f"description must be at most {MAX_DESCRIPTION} characters, got 20000000" in message
        with pytest.raises(ValidationError, match="description must be at most"):
            shoal.create_data_source(DataSourceSpec("Py", "1", 2, {"id": "int64"}, ["id"],
                                                    description="x" * (MAX_DESCRIPTION + 1)))
        assert shoal.list_data_sources() == []
        r = http.post("/api/v1/data-sources", json={**SOURCE, "description": "x" * MAX_DESCRIPTION})
        assert r.status_code == 201, r.text[:300]
        assert len(http.get("/api/v1/data-sources").content) < 2 * MAX_DESCRIPTION


def test_openapi_documents_the_errors_the_routes_answer(served: tuple[str, Settings]) -> None:
    """/openapi.json documented 422 HTTPValidationError on every route (never answered: an invalid request is a
    400 in the route's shape) and left out 401, 403 and 503, which the routes do answer."""
    url, _ = served
    with httpx.Client(base_url=url, timeout=30) as http:
        document = http.get("/openapi.json").json()
    dto = {"$ref": "#/components/schemas/ErrorDto"}
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert "422" not in operation["responses"], (method, path)
            if path.startswith("/api/v1/") and "datasets" not in operation.get("tags", []):
                for status in ("400", "401", "403", "404", "503"):
                    schema = operation["responses"][status]["content"]["application/json"]["schema"]
                    assert schema == dto, (method, path, status)
    assert "HTTPValidationError" not in document["components"]["schemas"]
    assert "ValidationError" not in document["components"]["schemas"]
    create = document["paths"]["/api/v1/datasets"]["post"]["responses"]
    assert sorted(create) == ["201", "400", "401", "403", "404", "409", "500", "501", "503"]
    assert create["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorOut"}



def test_a_405_names_every_method_the_path_serves_and_dataset_paths_answer_their_shape(
    served: tuple[str, Settings],
) -> None:
    """A 405's `Allow` named only the first route of the path (`GET` for /api/v1/data-sources, which POST serves
    too), so a client that trusts it never tries POST; and a path under /api/v1/datasets that no route serves
    answered in Vektonn's shape, which a dataset API client cannot read."""
    url, _ = served
    with httpx.Client(base_url=url, timeout=30) as http:
        r = http.put("/api/v1/data-sources", json={})
        assert r.status_code == 405, r.text
        assert {m.strip() for m in r.headers["Allow"].split(",")} >= {"GET", "POST"}, r.headers["Allow"]
        r = http.request("PATCH", "/api/v1/datasets/docs", json={})
        assert r.status_code == 405, r.text
        assert {m.strip() for m in r.headers["Allow"].split(",")} >= {"GET", "PUT", "DELETE"}, r.headers["Allow"]
        for path in ("/api/v1/datasets/docs/nothing-here", "/api/v1/trash/docs/nothing/here"):
            r = http.get(path)
            assert r.status_code == 404, r.text
            body = r.json()
            assert body["success"] is False and body["error_code"] == "NOT_FOUND", r.text
            assert path in body["message"], r.text
        r = http.get("/api/v1/elsewhere")  # outside the dataset API: Vektonn's shape, as before
        assert r.status_code == 404 and r.json() == {"errorMessages": ["no route matches GET /api/v1/elsewhere"]}
