"""Management and status routes, /healthz and /metrics over real HTTP; Vektonn's YAML configuration."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from test_api_vektonn import point

from shoal import DataSourceSpec, Shoal
from shoal.auth import create_key
from shoal.config.settings import Settings
from shoal.errors import ValidationError
from shoal.vektonn.yaml_config import read_folder


def test_manage_sources_indexes_status_and_metrics(served: tuple[str, Settings]) -> None:
    url, settings = served
    with Shoal(settings, notify=False) as shoal:  # /metrics names a tenant, and drops need a key: an admin one
        admin = {"Authorization": f"ApiKey {create_key(shoal.engine, settings.tenant, 'admin')[1]}"}
    with httpx.Client(base_url=url, timeout=30) as http:
        health = http.get("/healthz")  # a liveness probe: 200 however the rest is; here no broker listens
        assert health.status_code == 200
        assert health.json()["status"] == "degraded" and "broker" in health.json()["problems"][0]
        r = http.post(
            "/api/v1/data-sources",
            json={
                "name": "Ops.Source",
                "version": "1.0",
                "vectorDimension": 2,
                "attributeValueTypes": {"id": "Int64", "payload": "String"},
                "permanentAttributes": ["id"],
            },
        )
        assert r.status_code == 201, r.text
        assert r.json()["attributeValueTypes"] == {"id": "int64", "payload": "string"}
        assert (
            http.post(
                "/api/v1/data-sources",
                json={
                    "name": "Ops.Source",
                    "version": "1.0",
                    "vectorDimension": 2,
                    "attributeValueTypes": {"id": "Int64"},
                    "permanentAttributes": ["id"],
                },
            ).status_code
            == 409
        )
        bad = http.post(
            "/api/v1/data-sources",
            json={
                "name": "../x",
                "version": "1",
                "vectorDimension": 2,
                "attributeValueTypes": {"id": "int64"},
                "permanentAttributes": ["id"],
            },
        )
        assert bad.status_code == 400 and "invalid name" in bad.json()["errorMessages"][0]
        r = http.post(
            "/api/v1/indexes",
            json={
                "name": "Ops.Index",
                "version": "1.0",
                "dataSourceName": "Ops.Source",
                "dataSourceVersion": "1.0",
                "algorithm": "FaissIndex.L2",
                "shardCount": 2,
            },
        )
        assert r.status_code == 201, r.text
        assert (r.json()["algorithm"], r.json()["metric"]) == ("flat", "l2_squared")
        bad = http.post(
            "/api/v1/indexes",
            json={
                "name": "Ops.Bad",
                "version": "1",
                "dataSourceName": "Ops.Source",
                "dataSourceVersion": "1.0",
                "algorithm": "hnsw",
                "metric": "manhattan",
            },
        )
        assert bad.status_code == 400 and "does not support metric" in bad.json()["errorMessages"][0]
        assert [s["name"] for s in http.get("/api/v1/data-sources").json()] == ["Ops.Source"]
        assert [i["name"] for i in http.get("/api/v1/indexes").json()] == ["Ops.Index"]

        assert http.post(
            "/api/v1/upload/Ops.Source/1.0", json=[point(1, "a", [0, 1]), point(2, "b", [1, 0])]
        ).is_success
        status = http.get("/api/v1/indexes/Ops.Index/1.0/status").json()
        assert [(s["shard"], s["head"], s["built_watermark"], s["lag_seqs"]) for s in status] == [
            (0, 2, 0, 2),
            (1, 2, 0, 2),
        ]
        http.post(
            "/api/v1/search/Ops.Index/1.0",
            json={"k": 1, "queryVectors": [{"coordinates": [0, 1]}]},
            headers={"X-Shoal-Consistency": "strong"},
        )
        metrics = http.get("/metrics", headers=admin).text
        assert 'shoal_upload_points_total{tenant="' in metrics and "} 2.0" in metrics
        assert "shoal_search_seconds_count" in metrics
        assert 'shoal_index_built_lag_seqs{index="Ops.Index",shard="0"' in metrics or (
            'index="Ops.Index"' in metrics and "shoal_index_built_lag_seqs" in metrics
        )

        assert http.delete("/api/v1/indexes/Ops.Index/1.0", headers=admin).status_code == 204
        assert http.get("/api/v1/indexes/Ops.Index/1.0").status_code == 404
        assert http.delete("/api/v1/data-sources/Ops.Source/1.0", headers=admin).status_code == 204
        assert http.get("/api/v1/data-sources/Ops.Source/1.0").status_code == 404


def _write(folder: Path, relative: str, text: str) -> None:
    path = folder / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_vektonn_yaml_folder(tmp_path: Path, make_settings) -> None:  # type: ignore[no-untyped-def]
    _write(
        tmp_path,
        "data-sources/QuickStart.Source/1.0.yaml",
        """
vectorDimension: 2
vectorsAreSparse: false
attributeValueTypes:
  id: Int64
  payload: String
permanentAttributes: [id]
shardersByAttributeKey:
  id: {type: hash}
someFutureKey: ignored
""",
    )
    _write(
        tmp_path,
        "data-sources/QuickStart.Source/1.10.yaml",
        """
vectorDimension: 3
attributeValueTypes: {id: int64}
permanentAttributes: [id]
""",
    )
    _write(
        tmp_path,
        "indices/QuickStart.Index/1.0.yaml",
        """
dataSourceId:
  name: QuickStart.Source
  version: 1.0
indexAlgorithm:
  type: FaissIndex.L2
  params:
    M: 16
    EfConstruction: 100
    EfSearch: 32
idAttributes: [id]
splitAttributes: []
shardsById:
  shard-0: {}
  shard-1: {}
unknownKey: 1
""",
    )
    declared = read_folder(tmp_path)
    assert [(s.name, s.version, s.vector_dimension) for s in declared.sources] == [
        ("QuickStart.Source", "1.0", 2),
        ("QuickStart.Source", "1.10", 3),  # 1.10 stays "1.10", not 1.1
    ]
    [index] = declared.indexes
    # No shard names a shard attribute: the default (the id attributes), whatever the data source's sharders.
    assert (index.source_version, index.shard_count, index.shard_attributes) == ("1.0", 2, ())
    with Shoal(make_settings("local"), notify=False) as shoal:
        for spec in declared.sources:
            shoal.create_data_source(spec, exist_ok=True)
        record = shoal.create_index(index, exist_ok=True)
        assert (record.spec.algorithm, record.spec.metric, record.spec.params["M"]) == ("hnsw", "l2_squared", 16)
        assert record.spec.shard_attributes == ("id",)
        assert len(record.shards) == 2
        # Applying again checks and changes nothing.
        for spec in read_folder(tmp_path).sources:
            assert shoal.create_data_source(spec, exist_ok=True).head_seq == 0
    _write(tmp_path, "data-sources/Broken/1.yaml", "vectorDimension: two\nattributeValueTypes: {id: int64}\n")
    with pytest.raises(ValidationError, match="vectorDimension must be an integer"):
        read_folder(tmp_path)


def test_shoal_api_and_apply_commands(tmp_path: Path, make_settings) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    from conftest import settings_env, stop_process, wait_for
    from test_api_vektonn import _free_port

    settings = make_settings("local")
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    _write(
        tmp_path,
        "cfg/data-sources/Cli.Source/1.0.yaml",
        "vectorDimension: 2\nattributeValueTypes: {id: Int64}\npermanentAttributes: [id]\n",
    )
    _write(
        tmp_path,
        "cfg/indices/Cli.Index/1.0.yaml",
        "dataSourceId: {name: Cli.Source, version: 1.0}\nindexAlgorithm: {type: FaissIndex.IP}\n",
    )
    env = settings_env(settings)
    shoal_cmd = [sys.executable, "-m", "shoal.cli"]
    first = subprocess.run([*shoal_cmd, "apply", str(tmp_path / "cfg")], env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert "data source Cli.Source/1.0: created" in first.stdout and "index Cli.Index/1.0: created" in first.stdout
    again = subprocess.run([*shoal_cmd, "apply", str(tmp_path / "cfg")], env=env, capture_output=True, text=True)
    assert again.returncode == 0 and again.stdout.count("unchanged") == 2

    port = _free_port()
    server = subprocess.Popen(
        [*shoal_cmd, "api", "--port", str(port)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:

        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, 60, "shoal api to answer")
        r = httpx.post(
            f"http://127.0.0.1:{port}/api/v1/upload/Cli.Source/1.0",
            timeout=10,
            json=[{"attributes": [{"key": "id", "value": {"int64": 1}}], "vector": {"coordinates": [1, 0]}}],
        )
        assert r.status_code == 200 and r.headers["X-Shoal-Write-Token"] == "1"
        r = httpx.post(
            f"http://127.0.0.1:{port}/api/v1/search/Cli.Index/1.0",
            timeout=10,
            json={"k": 1, "queryVectors": [{"coordinates": [2, 0]}]},
            headers={"X-Shoal-Consistency": "strong"},
        )
        assert r.json()[0]["nearestDataPoints"][0]["distance"] == 2.0  # inner product, larger is nearer
    finally:
        stop_process(server)


def test_the_dataset_key_in_a_data_sources_metadata_is_refused(served: tuple[str, Settings]) -> None:
    """`shoal.dataset` in custom metadata is where the dataset API keeps a dataset's definition: a data source
    made with it any other way (the management route, the CLI, the Python API) would pass for a broken dataset
    and break the tenant's dataset listing. It is refused, naming the key, and nothing is written."""
    url, settings = served
    body = {"name": "Fake.Dataset", "version": "1", "vectorDimension": 2, "attributeValueTypes": {"id": "int64"},
            "permanentAttributes": ["id"], "customMetadata": {"shoal.dataset": {"x": 1}}}
    with Shoal(settings, notify=False) as shoal:
        admin = {"Authorization": f"ApiKey {create_key(shoal.engine, settings.tenant, 'admin')[1]}"}
        with httpx.Client(base_url=url, timeout=30, headers=admin) as http:
            refused = http.post("/api/v1/data-sources", json=body)
            assert refused.status_code == 400, refused.text
            assert "'shoal.dataset'" in refused.text and "reserved" in refused.text
            listed = http.get("/api/v1/datasets")
            assert listed.status_code == 200, listed.text
        assert [s.spec.name for s in shoal.list_data_sources()] == []
        with pytest.raises(ValidationError, match="reserved"):
            shoal.create_data_source(DataSourceSpec("Fake.Dataset", "1", 2, {"id": "int64"}, ["id"],
                                                    custom_metadata={"shoal.dataset": {}}))


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("data-sources", {"vectorDimension": True}, "vectorDimension"),
        ("data-sources", {"vectorDimension": "3"}, "vectorDimension"),
        ("data-sources", {"vectorDimension": 2.0}, "vectorDimension"),
        ("data-sources", {"vectorDimension": 2, "vectorsAreSparse": "yes"}, "vectorsAreSparse"),
        ("data-sources", {"vectorDimension": 2, "vectorsAreSparse": 1}, "vectorsAreSparse"),
        ("indexes", {"shardCount": True}, "shardCount"),
        ("indexes", {"shardCount": "4"}, "shardCount"),
    ],
)
def test_management_bodies_take_numbers_and_flags_of_their_own_type(
    served: tuple[str, Settings], route: str, body: dict[str, object], field: str
) -> None:
    """The routes coerced loose JSON values and stored the result: `"vectorDimension": true` made a 1-d source,
    "3" a 3-d one, `"vectorsAreSparse": "yes"` a sparse one, `"shardCount": "4"` four shards. Such a value is
    now refused (400 in the route's shape, naming the field), as the Python API's specs refuse it, and nothing
    is written."""
    url, settings = served
    source = {"name": "Lax", "version": "1", "vectorDimension": 2, "attributeValueTypes": {"id": "int64"},
              "permanentAttributes": ["id"]}
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        if route == "indexes":
            assert http.post("/api/v1/data-sources", json=source).status_code == 201
            body = {"name": "Lax.Index", "version": "1", "dataSourceName": "Lax", "dataSourceVersion": "1",
                    "algorithm": "FaissIndex.L2", **body}
        else:
            body = {**source, **body}
        r = http.post(f"/api/v1/{route}", json=body)
        assert r.status_code == 400, r.text
        [message] = r.json()["errorMessages"]
        assert message.startswith(f"{field}: "), message
        assert shoal.list_indexes() == [] and len(shoal.list_data_sources()) == (route == "indexes")


@pytest.mark.parametrize("value", ["²", "8²", "x8"])
def test_an_index_parameter_that_spells_no_ascii_integer_is_a_400(served: tuple[str, Settings], value: str) -> None:
    """`"Hnsw_M": "²"` answered 500 (str.isdigit takes superscripts, int() refuses them); it is refused 400
    naming the parameter, as `"x8"` was, and nothing is written."""
    url, settings = served
    source = {"name": "Sup", "version": "1", "vectorDimension": 2, "attributeValueTypes": {"id": "int64"},
              "permanentAttributes": ["id"]}
    with Shoal(settings, notify=False) as shoal, httpx.Client(base_url=url, timeout=30) as http:
        assert http.post("/api/v1/data-sources", json=source).status_code == 201
        r = http.post("/api/v1/indexes", json={
            "name": "Sup.Index", "version": "1", "dataSourceName": "Sup", "dataSourceVersion": "1",
            "algorithm": "FaissIndex.L2", "params": {"Hnsw_M": value, "Hnsw_EfConstruction": "200",
                                                     "Hnsw_EfSearch": "64"}})
        assert r.status_code == 400, r.text
        assert "M" in r.json()["errorMessages"][0], r.text
        assert shoal.list_indexes() == []
