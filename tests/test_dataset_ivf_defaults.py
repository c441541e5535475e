"""The dataset API's IVF defaults with a small nlist, through HTTP: an `index_config` giving only `nlist` below the
default nprobe (10) is a complete configuration whose nprobe is that nlist (it was refused, blaming an nprobe the
caller never sent), on create and on reindex; an nprobe the caller gives past nlist is still refused naming it.
Real Postgres, Valkey and storage; the reindex runs in-process (`async: false`) with the real builder."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import serve_api

from shoal import Shoal
from shoal.auth import create_key

DIM = 4


@pytest.fixture
def http(make_settings: Any, redis_url: str) -> Iterator[httpx.Client]:
    """The served API for a fresh tenant, called with an admin key."""
    settings = make_settings("local", redis_url=redis_url)
    with Shoal(settings, notify=False) as shoal, serve_api(settings) as url:
        key = create_key(shoal.engine, settings.tenant, "admin")[1]
        with httpx.Client(base_url=f"{url}/api/v1", headers={"Authorization": f"ApiKey {key}"},
                          timeout=60) as client:
            yield client


def index_of(http: httpx.Client, name: str) -> tuple[str, dict[str, Any]]:
    """The dataset's index type and parameters as its stats show them (GET /datasets/{name} has no params)."""
    r = http.get(f"/datasets/{name}/stats")
    assert r.status_code == 200, r.text
    stats = r.json()
    assert stats["parameters"] == stats["index_stats"]["index_params"], stats
    return stats["index_stats"]["index_type"], stats["parameters"]


def create(http: httpx.Client, name: str, config: dict[str, Any]) -> httpx.Response:
    return http.post("/datasets", json={"name": name, "dimensions": DIM, "index_type": "ivf", "index_config": config})


def upsert(http: httpx.Client, name: str, count: int) -> None:
    rng = np.random.default_rng(3)
    vectors = [{"id": f"v{i}", "values": rng.standard_normal(DIM).tolist()} for i in range(count)]
    r = http.post(f"/datasets/{name}/vectors", json={"vectors": vectors})
    assert r.status_code == 200, r.text


def test_create_with_only_a_small_nlist_probes_every_list(http: httpx.Client) -> None:
    r = create(http, "small", {"nlist": 8})
    assert r.status_code == 201, r.text
    assert index_of(http, "small") == ("ivf", {"nlist": 8, "nprobe": 8})
    # From 10 lists up, the documented default nprobe stands.
    assert create(http, "ten", {"nlist": 10}).status_code == 201
    assert index_of(http, "ten") == ("ivf", {"nlist": 10, "nprobe": 10})
    # The older form follows the same defaults.
    r = http.post("/datasets", json={"name": "older", "dimensions": DIM, "index_type": "ivf",
                                     "index_params": {"nlist": 3}})
    assert r.status_code == 201, r.text
    assert index_of(http, "older") == ("ivf", {"nlist": 3, "nprobe": 3})
    # The dataset serves searches with it.
    upsert(http, "small", 30)
    r = http.post("/datasets/small/search", json={"vector": [0.0] * (DIM - 1) + [1.0], "top_k": 30,
                                                  "consistency": "strong"})
    assert r.status_code == 200, r.text
    assert len(r.json()["results"]) == 30


def test_reindex_to_a_small_nlist_probes_every_list(http: httpx.Client) -> None:
    assert create(http, "docs", {"nlist": 16}).status_code == 201
    assert index_of(http, "docs") == ("ivf", {"nlist": 16, "nprobe": 10})
    upsert(http, "docs", 40)
    r = http.post("/datasets/docs/reindex", json={"index_config": {"nlist": 8}, "async": False})
    assert r.status_code == 202, r.text
    assert (r.json()["state"], r.json()["definition"]["params"]) == ("swapped", {"nlist": 8, "nprobe": 8})
    assert index_of(http, "docs") == ("ivf", {"nlist": 8, "nprobe": 8})


@pytest.mark.parametrize("config", [{"nlist": 8, "nprobe": 9}, {"nlist": 8, "nprobe": 10}])
def test_an_nprobe_given_past_nlist_is_still_refused_naming_it(http: httpx.Client, config: dict[str, Any]) -> None:
    r = create(http, "docs", config)
    assert r.status_code == 400, r.text
    details = r.json()["details"]
    assert (details["field"], details["value"], details["allowed_range"]) == (
        "index_config.nprobe", config["nprobe"], {"min": 1, "max": 8})
    assert "nprobe" in r.json()["message"]
    assert http.get("/datasets/docs").status_code == 404  # nothing created
    # The same on reindex: refused, nothing started, the index as it was.
    assert create(http, "live", {"nlist": 16}).status_code == 201
    r = http.post("/datasets/live/reindex", json={"index_config": config, "async": False})
    assert r.status_code == 400, r.text
    assert (r.json()["details"]["field"], r.json()["details"]["value"]) == ("index_config.nprobe", config["nprobe"])
    assert index_of(http, "live") == ("ivf", {"nlist": 16, "nprobe": 10})
