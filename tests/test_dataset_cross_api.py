"""One dataset through every API: what the Vektonn routes write into a dataset's data source is answered by the
dataset API's search, multi-dataset search and `/stats` (metadata text no JSON encoder can answer, or JSON only to
Python's decoder, comes back as the text stored); `shoal trash restore` on the embedded default reaches the API's
dataset cache in the embedded Valkey; and an alias of an index in the trash is not taken over by an alias upsert,
so the restore brings it back.

Real Postgres, Valkey and storage, through HTTP (an API served in this process) and the CLI (Typer's CliRunner
on the SHOAL_* variables of `module_cli_env`: embedded servers, stopped at the end)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import module_cli_env, serve_api
from typer.testing import CliRunner

from shoal import Shoal
from shoal.auth import create_key
from shoal.cli import app
from shoal.cli.probes import embedded_valkey_status
from shoal.config.settings import Settings

runner = CliRunner()


@contextlib.contextmanager
def admin_client(settings: Settings) -> Iterator[httpx.Client]:
    """The API served for `settings`' tenant, called with an admin key of that tenant."""
    with Shoal(settings, notify=False) as shoal:
        key = create_key(shoal.engine, settings.tenant, "admin")[1]
    with serve_api(settings) as url, httpx.Client(
        base_url=url, headers={"Authorization": f"ApiKey {key}"}, timeout=60
    ) as http:
        yield http


@pytest.fixture
def http(make_settings: Callable[..., Settings], redis_url: str) -> Iterator[httpx.Client]:
    """The API on a fresh tenant (local storage, the test session's Valkey as broker and cache)."""
    with admin_client(make_settings("local", redis_url=redis_url)) as client:
        yield client


def vektonn_point(pid: str, y: float, metadata: str) -> dict[str, Any]:
    """A Vektonn upload's point for a dataset's data source, its metadata given as the raw text stored."""
    attrs = {"id": pid, "document_id": "", "content": "", "metadata": metadata}
    return {"attributes": [{"key": k, "value": {"string": v}} for k, v in attrs.items()],
            "vector": {"isSparse": False, "coordinates": [0.0, y]}}


def upload(http: httpx.Client, dataset: str, *points: dict[str, Any]) -> None:
    r = http.post(f"/api/v1/upload/{dataset}/1", json=list(points))
    assert r.status_code == 200, r.text


def metadata_by_id(http: httpx.Client, dataset: str) -> dict[str, Any]:
    """Each vector's `metadata` as the dataset API's search answers it (every vector of a small dataset)."""
    r = http.post(f"/api/v1/datasets/{dataset}/search", json={"vector": [0, 1], "top_k": 10, "consistency": "strong"})
    assert r.status_code == 200, r.text
    return {m["id"]: m["metadata"] for m in r.json()["results"]}


# -- metadata the dataset API cannot answer as JSON -------------------------------------------------------------


def test_metadata_with_escaped_lone_surrogates_is_answered_as_the_text_stored(http: httpx.Client) -> None:
    r = http.post("/api/v1/datasets", json={"name": "ds", "dimensions": 2, "index_type": "flat"})
    assert r.status_code == 201, r.text
    # Valid JSON text whose escapes decode to lone surrogates, which no UTF-8 answer can carry.
    stored = {"a": '{"k": "\\ud800"}', "b": '{"\\ud800": 1, "language": "\\udc00"}',
              "c": '{"language": "en", "smile": "\\ud83d\\ude00"}'}  # a valid pair decodes
    upload(http, "ds", *(vektonn_point(pid, 1.0 + i, text) for i, (pid, text) in enumerate(stored.items())))
    assert metadata_by_id(http, "ds") == {"a": stored["a"], "b": stored["b"], "c": {"language": "en", "smile": "😀"}}

    r = http.post("/api/v1/search/multi-dataset",
                  json={"query_vector": [0, 1], "datasets": ["ds"], "options": {"consistency": "strong"}})
    assert r.status_code == 200, r.text
    assert {m["id"]: m["metadata"] for m in r.json()["results"]}["a"] == stored["a"]

    r = http.get("/api/v1/datasets/ds/stats")
    assert r.status_code == 200, r.text
    stats = r.json()["metadata_stats"]
    # Only c's metadata is an object: a and b count as no metadata, their keys and languages nowhere.
    assert (stats["vectors_with_metadata"], stats["metadata_keys"]) == (1, {"language": 1, "smile": 1}), stats
    assert stats["languages"] == {"en": 1}, stats


def test_metadata_json_only_to_python_is_answered_as_the_text_stored(http: httpx.Client) -> None:
    r = http.post("/api/v1/datasets", json={"name": "ds", "dimensions": 2, "index_type": "flat"})
    assert r.status_code == 201, r.text
    # NaN, Infinity and numbers beyond a float's range are no JSON (RFC 8259), though Python's decoder takes them.
    stored = {"a": "-Infinity", "b": '{"x": NaN, "y": 1e400}', "c": "[Infinity]", "d": "not json",
              "e": '{"x": 1.5, "y": 1e300, "z": -1e-400}'}
    upload(http, "ds", *(vektonn_point(pid, 1.0 + i, text) for i, (pid, text) in enumerate(stored.items())))
    answered = metadata_by_id(http, "ds")
    assert {k: answered[k] for k in "abcd"} == {k: stored[k] for k in "abcd"}, answered
    assert answered["e"] == {"x": 1.5, "y": 1e300, "z": -0.0}  # JSON numbers a float holds stay numbers

    r = http.get("/api/v1/datasets/ds/stats")
    assert r.status_code == 200, r.text
    assert r.json()["metadata_stats"]["vectors_with_metadata"] == 1  # only e's is an object


# -- aliases of an index in the trash ---------------------------------------------------------------------------


def test_an_alias_of_an_index_in_the_trash_is_not_taken_over_and_comes_back_with_the_restore(
    http: httpx.Client,
) -> None:
    for name in ("ds", "other"):
        assert http.post("/api/v1/datasets", json={"name": name, "dimensions": 2}).status_code == 201
    r = http.put("/api/v1/aliases/al", json={"indexName": "ds", "indexVersion": "1"})
    assert r.status_code == 200, r.text
    assert http.delete("/api/v1/datasets/ds").status_code == 200
    assert http.get("/api/v1/aliases/al").status_code == 404  # hidden with its index

    r = http.put("/api/v1/aliases/al", json={"indexName": "other", "indexVersion": "1"})
    assert r.status_code == 409, r.text
    message = r.json()["errorMessages"][0]
    assert "alias 'al'" in message and "index 'ds' version '1'" in message and "in the trash" in message, message
    assert http.delete("/api/v1/aliases/al").status_code == 404  # still hidden, not dropped

    r = http.post("/api/v1/trash/ds/restore")
    assert r.status_code == 200, r.text
    r = http.get("/api/v1/aliases/al")
    assert r.status_code == 200 and (r.json()["indexName"], r.json()["indexVersion"]) == ("ds", "1"), r.text

    # Once purged from the trash, the name is free.
    assert http.delete("/api/v1/datasets/ds").status_code == 200
    r = http.delete("/api/v1/trash/ds")
    assert r.status_code == 200, r.text
    r = http.put("/api/v1/aliases/al", json={"indexName": "other", "indexVersion": "1"})
    assert r.status_code == 200 and r.json()["indexName"] == "other", r.text


# -- `shoal trash restore` and the API's dataset cache on the embedded default ----------------------------------


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """SHOAL_* variables for the CLI tests: a fresh data dir (embedded Postgres and Valkey), stopped at the end."""
    with module_cli_env(tmp_path_factory, "cross-api") as data_dir:
        yield data_dir


def test_cli_trash_restore_reaches_the_api_dataset_cache_in_the_embedded_valkey(cli_env: Path) -> None:
    tenant = "x" + uuid.uuid4().hex[:12]
    settings = Settings(tenant=tenant)
    assert settings.redis_url is None  # the embedded default: the API caches in the data dir's Valkey
    with admin_client(settings) as http:
        assert http.post("/api/v1/datasets", json={"name": "ds", "dimensions": 2}).status_code == 201
        assert http.delete("/api/v1/datasets/ds").status_code == 200
        assert http.get("/api/v1/datasets").json()["datasets"] == []  # the page the API caches
        result = runner.invoke(app, ["trash", "restore", "ds"], env={"SHOAL_TENANT": tenant})
        assert result.exit_code == 0, result.output
        assert http.get("/api/v1/datasets/ds").status_code == 200
        assert [d["name"] for d in http.get("/api/v1/datasets").json()["datasets"]] == ["ds"]


def test_cli_trash_restore_starts_no_embedded_valkey(tmp_path_factory: pytest.TempPathFactory) -> None:
    # A data dir of its own, so no other test's Valkey runs in it.
    with module_cli_env(tmp_path_factory, "cross-api-quiet") as data_dir:
        tenant = "x" + uuid.uuid4().hex[:12]
        with Shoal(Settings(tenant=tenant), notify=False) as shoal:
            from shoal.datasets.service import DatasetService

            searcher = shoal.searcher(follow=False)
            try:
                service = DatasetService(shoal, searcher)
                service.create("ds", 2)
                service.delete("ds")
            finally:
                searcher.close()
        assert embedded_valkey_status(data_dir)[0] == "stopped"
        result = runner.invoke(app, ["trash", "restore", "ds"], env={"SHOAL_TENANT": tenant})
        assert result.exit_code == 0, result.output
        assert embedded_valkey_status(data_dir)[0] == "stopped"
