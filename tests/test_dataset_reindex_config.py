"""A dataset's reindex through HTTP with the specified body `{"index_config": {...}, "async": true}` (issue 15):
the new params are the ones built, and once the new generation serves, the dataset (GET, /stats, the list and
its `dataset_metadata.json`) shows its index type and params, also through a warm Redis cache and after the
cache is cleared. A real worker runs the asynchronous reindex; real Postgres and Valkey throughout."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import redis
from conftest import serve_api, start_worker, stop_process, wait_for

from shoal import Shoal
from shoal.auth import create_key
from shoal.config.settings import Settings
from shoal.storage.layout import dataset_metadata_path

HNSW16 = {"M": 16, "ef_construction": 200, "ef_search": 64}
HNSW32 = {"M": 32, "ef_construction": 200, "ef_search": 64}
DIM = 8


class Api:
    """A served API (dataset routes) for a fresh tenant, with an admin key, a Shoal client and Redis."""

    def __init__(self, http: httpx.Client, shoal: Shoal, cache: redis.Redis, settings: Settings) -> None:
        self.http, self.shoal, self.cache, self.settings = http, shoal, cache, settings
        self.tenant_id = shoal.catalog.tenant_id

    def create(self, name: str, **extra: Any) -> None:
        r = self.http.post("/api/v1/datasets", json={"name": name, "dimensions": DIM, **extra})
        assert r.status_code == 201, r.text
        rng = np.random.default_rng(7)
        vectors = [{"id": f"v{i}", "values": rng.standard_normal(DIM).tolist()} for i in range(60)]
        r = self.http.post(f"/api/v1/datasets/{name}/vectors", json={"vectors": vectors})
        assert r.status_code == 200, r.text

    def dataset(self, name: str) -> dict[str, Any]:
        r = self.http.get(f"/api/v1/datasets/{name}")
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def index_stats(self, name: str) -> dict[str, Any]:
        r = self.http.get(f"/api/v1/datasets/{name}/stats")
        assert r.status_code == 200, r.text
        return r.json()["index_stats"]  # type: ignore[no-any-return]

    def listed(self, name: str) -> dict[str, Any]:
        r = self.http.get("/api/v1/datasets")
        assert r.status_code == 200, r.text
        return next(d for d in r.json()["datasets"] if d["id"] == name)

    def mirror(self, name: str) -> dict[str, Any]:
        data = self.shoal.storage.read(dataset_metadata_path(self.settings.tenant, name))
        return json.loads(data.to_pybytes())  # type: ignore[no-any-return]

    def cached(self, name: str) -> dict[str, Any] | None:
        raw = self.cache.get(f"dataset:info:{self.tenant_id}:{name}")
        return json.loads(raw) if raw is not None else None

    def clear_cache(self, name: str) -> None:
        self.cache.delete(f"dataset:info:{self.tenant_id}:{name}", f"dataset:list:{self.tenant_id}")

    def jobs(self, name: str) -> list[dict[str, Any]]:
        r = self.http.get(f"/api/v1/indexes/{name}/1/reindex")
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def wait_swapped(self, name: str, job: int) -> None:
        def swapped() -> bool:
            state = next(j["state"] for j in self.jobs(name) if j["job"] == job)
            assert state in ("building", "swapped"), self.jobs(name)
            return state == "swapped"

        wait_for(swapped, 120, f"reindex job {job} of {name} to swap its generation in")
        # The mirror is written just after the swap's commit (the catalog is the source of truth), by the
        # process that swapped: wait for the worker to have written it.
        serving = self.shoal.get_index(name, "1").spec

        def mirrored() -> bool:
            mirror = self.mirror(name)
            return (mirror["index_type"], mirror["index_params"]) == (serving.algorithm, dict(serving.params))

        wait_for(mirrored, 30, f"the mirror of {name} to show the generation swapped in")

    def assert_shows(self, name: str, index_type: str, params: dict[str, Any]) -> None:
        """GET, the list, /stats and the mirror all show this index type and these params."""
        assert self.dataset(name)["index_type"] == index_type
        assert self.listed(name)["index_type"] == index_type
        stats = self.index_stats(name)
        assert (stats["index_type"], stats["index_params"]) == (index_type, params)
        mirror = self.mirror(name)
        assert (mirror["index_type"], mirror["index_params"]) == (index_type, params)
        assert mirror["index"]["algorithm"] == index_type
        cached = self.cached(name)  # whatever the cache holds now is no stale entry
        assert cached is None or (cached["index_type"], cached["index_params"]) == (index_type, params)


@pytest.fixture
def api(make_settings: Any, redis_url: str) -> Iterator[Api]:
    settings = make_settings("local", redis_url=redis_url)
    with Shoal(settings, notify=False) as shoal, serve_api(settings) as url:
        key = create_key(shoal.engine, settings.tenant, "admin")[1]
        cache = redis.Redis.from_url(redis_url)
        with httpx.Client(base_url=url, headers={"Authorization": f"ApiKey {key}"}, timeout=60) as http:
            try:
                yield Api(http, shoal, cache, settings)
            finally:
                cache.close()


def test_async_reindex_with_index_config_builds_the_new_params_and_the_dataset_shows_them(api: Api) -> None:
    api.create("docs", index_type="hnsw", index_params=HNSW16)
    api.assert_shows("docs", "hnsw", HNSW16)
    assert api.cached("docs") is not None  # warm: the cache holds the entry from before the reindex

    worker = start_worker(api.settings)
    try:
        # M 16 -> 32 with the specified body; `async` from the body.
        r = api.http.post("/api/v1/datasets/docs/reindex", json={"index_config": HNSW32, "async": True})
        assert r.status_code == 202, r.text
        job = r.json()
        assert job["state"] == "building"
        assert (job["definition"]["algorithm"], job["definition"]["params"]) == ("hnsw", HNSW32)
        api.wait_swapped("docs", job["job"])
        assert api.shoal.get_index("docs", "1").spec.params == HNSW32  # what serves was built with M 32
        api.assert_shows("docs", "hnsw", HNSW32)
        api.clear_cache("docs")
        api.assert_shows("docs", "hnsw", HNSW32)

        # A switch to flat, the type given inside index_config; the cache is warm again beforehand.
        assert api.cached("docs") is not None
        r = api.http.post("/api/v1/datasets/docs/reindex", json={"index_config": {"index_type": "flat"},
                                                                  "async": True})
        assert r.status_code == 202, r.text
        assert r.json()["definition"]["algorithm"] == "flat"
        api.wait_swapped("docs", r.json()["job"])
        assert api.shoal.get_index("docs", "1").spec.algorithm == "flat"
        api.assert_shows("docs", "flat", {})
        api.clear_cache("docs")
        api.assert_shows("docs", "flat", {})
    finally:
        stop_process(worker)


def test_async_false_in_the_body_runs_the_reindex_before_answering(api: Api) -> None:
    api.create("docs", index_type="hnsw", index_params=HNSW16)
    api.assert_shows("docs", "hnsw", HNSW16)
    r = api.http.post("/api/v1/datasets/docs/reindex", json={"index_config": HNSW32, "async": False})
    assert r.status_code == 202, r.text
    assert (r.json()["state"], r.json()["definition"]["params"]) == ("swapped", HNSW32)
    api.assert_shows("docs", "hnsw", HNSW32)
    # Today's forms keep working: `async` as a query parameter, with index_config or index_type/index_params.
    r = api.http.post("/api/v1/datasets/docs/reindex?async=false", json={"index_config": {"index_type": "flat"}})
    assert (r.status_code, r.json()["state"]) == (202, "swapped"), r.text
    api.assert_shows("docs", "flat", {})
    r = api.http.post("/api/v1/datasets/docs/reindex?async=false",
                      json={"index_type": "hnsw", "index_params": HNSW16})
    assert (r.status_code, r.json()["state"]) == (202, "swapped"), r.text
    api.assert_shows("docs", "hnsw", HNSW16)
    # The body and the query disagreeing on `async` is refused.
    r = api.http.post("/api/v1/datasets/docs/reindex?async=true", json={"index_config": HNSW32, "async": False})
    assert r.status_code == 400, r.text
    assert r.json()["details"]["field"] == "async"


@pytest.mark.parametrize(
    ("body", "field", "hint"),
    [
        ({"index_config": "fast"}, "index_config", "JSON object"),
        ({"index_config": ["M", 32]}, "index_config", "JSON object"),
        ({"index_config": {"index_type": "annoy"}, "async": True}, "index_config.index_type", "annoy"),
        ({"index_config": {"M": "big", "ef_construction": 200, "ef_search": 64}, "async": True}, "index_config",
         "'M'"),
        ({"index_config": {"M": 32, "ef_construction": 200, "ef_search": 64, "nlist": 4}}, "index_config", "nlist"),
        ({"index_config": {"index_type": "flat", "M": 32}}, "index_config", "'M'"),
        ({"index_config": HNSW32, "index_params": HNSW32}, "index_params", "not both"),
        ({"index_type": "flat", "index_config": {"index_type": "ivf"}}, "index_config.index_type", "disagree"),
    ],
)
def test_a_bad_index_config_is_refused_naming_the_field_and_starts_nothing(
    api: Api, body: dict[str, Any], field: str, hint: str
) -> None:
    api.create("docs", index_type="hnsw", index_params=HNSW16)
    before = api.shoal.get_index("docs", "1")
    r = api.http.post("/api/v1/datasets/docs/reindex", json=body)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["error_code"] == "INVALID_DATASET_CONFIG", error
    assert error["details"]["field"] == field, error
    assert hint in error["message"], error
    assert api.jobs("docs") == []  # no job recorded, no generation made
    assert api.shoal.get_index("docs", "1") == before
    api.assert_shows("docs", "hnsw", HNSW16)


def test_a_reindex_in_todays_form_shows_in_the_dataset_and_its_cache(api: Api) -> None:
    """Item 1 alone, with a body the route always took: after the swap the dataset shows what serves (the
    cache was warm before; the mirror is written again; a rollback shows the old generation again)."""
    api.create("docs", index_type="hnsw", index_params=HNSW16)
    api.assert_shows("docs", "hnsw", HNSW16)
    r = api.http.post("/api/v1/datasets/docs/reindex?async=false", json={"index_type": "flat"})
    assert (r.status_code, r.json()["state"]) == (202, "swapped"), r.text
    api.assert_shows("docs", "flat", {})
    r = api.http.post("/api/v1/indexes/docs/1/rollback")
    assert r.status_code == 200, r.text
    api.assert_shows("docs", "hnsw", HNSW16)
