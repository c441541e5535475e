"""Issue 13, safe defaults and limits (items 4-8), each through the real served API on the real catalog and a
real embedded Valkey: keyless callers in a tenant of their own that never delete and stay on loopback; the
admin role enforced; /metrics naming tenants only to those allowed; a Valkey with a password and a dataset
cache that trusts no entry of another tenant; failed authentications cached and rate-limited per address."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from conftest import api_process, serve_api

from shoal import DataSourceSpec, Shoal
from shoal.auth import create_key, create_tenant
from shoal.config.settings import Settings
from shoal.log.records import IndexSpec
from shoal.servers.embedded import ensure_valkey, stop_embedded

API = "/api/v1"


# -- helpers ---------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tenant_with_keys(settings: Settings, prefix: str, *roles: str) -> tuple[str, dict[str, str]]:
    """A fresh tenant and one key per role."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    with Shoal(settings, notify=False) as shoal:
        create_tenant(shoal.engine, name)
        return name, {role: create_key(shoal.engine, name, role)[1] for role in roles}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"ApiKey {key}"}


def _point(i: int, vector: list[float]) -> dict[str, Any]:
    return {"attributes": [{"key": "id", "value": {"int64": i}}], "vector": {"isSparse": False, "coordinates": vector}}


def _source_and_index(settings: Settings, tenant: str, name: str) -> None:
    """A 2-d data source `{name}.Source/1` and its flat index `{name}.Index/1` in `tenant`."""
    with Shoal(settings, tenant=tenant, notify=False) as shoal:
        shoal.create_data_source(DataSourceSpec(f"{name}.Source", "1", 2, {"id": "int64"}, ["id"]))
        shoal.create_index(IndexSpec(f"{name}.Index", "1", f"{name}.Source", "1", algorithm="FaissIndex.L2"))


def _dataset_error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["success"] is False and body["error_code"] == code, body
    return str(body["message"])


@pytest.fixture
def keyed(make_settings: Callable[..., Settings]) -> Iterator[tuple[str, Settings]]:
    """The API with no anonymous tenant (every caller needs a key), on a loopback port."""
    settings = make_settings("local")
    with serve_api(settings) as url:
        yield url, settings


# -- 4. anonymous callers ----------------------------------------------------------------------------------------


def test_anonymous_callers_have_their_own_tenant_never_delete_and_stay_on_loopback(
    served: tuple[str, Settings], tmp_path: Path
) -> None:
    url, settings = served  # keyless callers are settings.tenant, the tenant the Python API and CLI work in
    _source_and_index(settings, settings.tenant, "Cli")
    with httpx.Client(base_url=url, timeout=30) as http:
        # What the CLI created, a keyless caller cannot delete or drop, whatever the route.
        for method, path in [("DELETE", f"{API}/data-sources/Cli.Source/1"), ("DELETE", f"{API}/indexes/Cli.Index/1")]:
            r = http.request(method, path)
            assert r.status_code == 403, (path, r.status_code, r.text)
            assert "without an API key" in r.json()["errorMessages"][0]
        assert http.get(f"{API}/data-sources/Cli.Source/1").status_code == 200
        assert http.get(f"{API}/indexes/Cli.Index/1").status_code == 200

        # The Vektonn flow still works without a key: upload (tombstones included) and search.
        assert http.post(f"{API}/upload/Cli.Source/1", json=[_point(1, [0, 1]), _point(2, [1, 0])]).status_code == 200
        found = http.post(f"{API}/search/Cli.Index/1", headers={"X-Shoal-Consistency": "strong"},
                          json={"k": 2, "queryVectors": [{"coordinates": [0, 1]}]})
        assert found.status_code == 200 and len(found.json()[0]["nearestDataPoints"]) == 2

        # Datasets: created, but never deleted, hard-deleted, purged or overwritten by a keyless caller.
        assert http.post(f"{API}/datasets", json={"name": "docs", "dimensions": 2}).status_code == 201
        for r in (http.delete(f"{API}/datasets/docs", params={"hard": "true"}),
                  http.delete(f"{API}/datasets/docs"),
                  http.delete(f"{API}/trash/docs"),
                  http.post(f"{API}/datasets", json={"name": "docs", "dimensions": 2, "overwrite": True})):
            assert "without an API key" in _dataset_error(r, 403, "FORBIDDEN") or "admin key" in r.text
        assert http.get(f"{API}/datasets/docs").status_code == 200

    # The embedded default serves keyless callers as a tenant of their own, never the CLI's.
    embedded = Settings(data_dir=tmp_path / "embedded", database_url=None, anonymous_tenant=None, tenant="default")
    assert embedded.resolved_anonymous_tenant == "anonymous" != embedded.tenant

    # Beyond loopback with keyless writes on, `shoal api` refuses to start, saying why and what to do.
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", "api", "--host", "0.0.0.0", "--port", str(port), "--no-access-log"],
        env=settings.child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("shoal api --host 0.0.0.0 served keyless writes to the network instead of refusing to start")
    assert proc.returncode == 1, (out, err)
    message = " ".join(err.split())
    assert "refusing to listen on 0.0.0.0" in message and "--allow-anonymous-writes" in message, err
    # ... unless told it is meant.
    with api_process(settings, "--host", "0.0.0.0", "--allow-anonymous-writes") as (_, served_url):
        assert httpx.get(f"{served_url}/healthz", timeout=10).status_code == 200


# -- 5. the admin role -------------------------------------------------------------------------------------------


def test_hard_deletes_purges_and_overwrites_need_an_admin_key(keyed: tuple[str, Settings]) -> None:
    url, settings = keyed
    _, keys = _tenant_with_keys(settings, "adm", "write", "admin")
    with httpx.Client(base_url=url + API, headers=_auth(keys["write"]), timeout=30) as write, \
            httpx.Client(base_url=url + API, headers=_auth(keys["admin"]), timeout=30) as admin:
        assert write.post("/datasets", json={"name": "docs", "dimensions": 2}).status_code == 201
        assert "admin key" in _dataset_error(write.delete("/datasets/docs", params={"hard": "true"}), 403, "FORBIDDEN")
        assert "admin key" in _dataset_error(
            write.post("/datasets", json={"name": "docs", "dimensions": 2, "overwrite": True}), 403, "FORBIDDEN")
        assert write.get("/datasets/docs").status_code == 200  # nothing happened

        # A write key moves a dataset to the trash; only an admin key empties it.
        assert write.delete("/datasets/docs").json()["soft"] is True
        _dataset_error(write.delete("/trash/docs"), 403, "FORBIDDEN")
        assert [d["id"] for d in write.get("/trash").json()["datasets"]] == ["docs"]
        assert admin.delete("/trash/docs").status_code == 200
        assert write.get("/trash").json()["total"] == 0

        # An admin key hard-deletes and overwrites.
        assert admin.post("/datasets", json={"name": "docs", "dimensions": 2}).status_code == 201
        assert admin.post("/datasets", json={"name": "docs", "dimensions": 3, "overwrite": True}).status_code == 201
        assert admin.delete("/datasets/docs", params={"hard": "true"}).json()["soft"] is False
        assert write.get("/datasets/docs").status_code == 404


# -- 6. /metrics -------------------------------------------------------------------------------------------------


def test_metrics_name_tenants_only_to_admins_and_the_metrics_token(served: tuple[str, Settings]) -> None:
    url, settings = served
    token = "metrics-" + uuid.uuid4().hex
    alpha = settings.tenant  # also the keyless callers' tenant
    beta, beta_keys = _tenant_with_keys(settings, "beta", "write")
    with Shoal(settings, notify=False) as shoal:
        alpha_admin = create_key(shoal.engine, alpha, "admin")[1]
    _source_and_index(settings, alpha, "AlphaSecret")
    _source_and_index(settings, beta, "BetaSecret")
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.post(f"{API}/upload/AlphaSecret.Source/1", json=[_point(1, [0, 1])]).status_code == 200
        assert http.post(f"{API}/upload/BetaSecret.Source/1", headers=_auth(beta_keys["write"]),
                         json=[_point(1, [0, 1]), _point(2, [1, 0])]).status_code == 200
        for who, key in (("alpha", None), ("beta", beta_keys["write"])):
            assert http.post(f"{API}/search/{who.capitalize()}Secret.Index/1",
                             headers={"X-Shoal-Consistency": "strong"} | (_auth(key) if key else {}),
                             json={"k": 1, "queryVectors": [{"coordinates": [0, 1]}]}).status_code == 200

        # Keyless, and with a key of role write: totals only, no tenant, index or data source named.
        for headers in ({}, _auth(beta_keys["write"])):
            r = http.get("/metrics", headers=headers)
            assert r.status_code == 200, r.text
            for secret in ("tenant=", alpha, beta, "AlphaSecret", "BetaSecret"):
                assert secret not in r.text, (secret, headers)
            assert "shoal_upload_points_total 3.0" in r.text
            assert "shoal_search_seconds_count 2.0" in r.text
            assert "shoal_index_built_lag_seqs_max " in r.text

    # An admin key: its own tenant's series, never another tenant's.
    served_metrics = settings.model_copy(update={"metrics_token": token})
    with serve_api(served_metrics) as url2, httpx.Client(base_url=url2, timeout=30) as http:
        assert http.post(f"{API}/upload/AlphaSecret.Source/1", json=[_point(2, [1, 1])]).status_code == 200
        assert http.post(f"{API}/upload/BetaSecret.Source/1", headers=_auth(beta_keys["write"]),
                         json=[_point(3, [1, 1])]).status_code == 200
        mine = http.get("/metrics", headers=_auth(alpha_admin)).text
        assert f'shoal_upload_points_total{{tenant="{alpha}"}} 1.0' in mine
        assert 'index="AlphaSecret.Index"' in mine
        assert beta not in mine and "BetaSecret" not in mine
        # The metrics token: every tenant.
        everything = http.get("/metrics", headers={"Authorization": f"Bearer {token}"}).text
        assert f'tenant="{alpha}"' in everything and f'tenant="{beta}"' in everything
        assert 'index="BetaSecret.Index"' in everything
        assert http.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401


# -- 7. the embedded Valkey and the dataset cache ----------------------------------------------------------------


@pytest.fixture
def valkey(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A fresh embedded Valkey of its own data dir (its URL as the embedded default gives it), stopped after."""
    data_dir = tmp_path / "valkey-home"
    try:
        yield data_dir, ensure_valkey(data_dir)
    finally:
        stop_embedded(data_dir)


def test_the_embedded_valkey_needs_its_password_and_no_tenant_reads_another_s_cache_entry(
    valkey: tuple[Path, str], make_settings: Callable[..., Settings]
) -> None:
    data_dir, broker = valkey
    port = redis.Redis.from_url(broker).connection_pool.connection_kwargs["port"]
    stranger = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
    with pytest.raises(redis.AuthenticationError):
        stranger.ping()  # anyone on the machine could read and write the broker and the cache
    stranger.close()
    password_file = data_dir / "valkey" / "password"
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
    assert password_file.read_text().strip() not in " ".join(_command_lines())
    # Every client the embedded default builds uses it: the runtime's, and what a new process finds.
    with Shoal(make_settings("local", data_dir=data_dir, redis_url=None), notify=False) as shoal:
        assert shoal.broker_url() == broker and shoal.runtime.redis().ping()
    assert ensure_valkey(data_dir) == broker

    # Tenants alpha and beta each have a dataset `docs`; a poisoned entry must not show alpha beta's.
    settings = make_settings("local", redis_url=broker)
    _, alpha = _tenant_with_keys(settings, "alpha", "write")
    _, beta = _tenant_with_keys(settings, "beta", "write")
    cache = redis.Redis.from_url(broker)
    with serve_api(settings) as url, \
            httpx.Client(base_url=url + API, headers=_auth(alpha["write"]), timeout=30) as a, \
            httpx.Client(base_url=url + API, headers=_auth(beta["write"]), timeout=30) as b:
        assert a.post("/datasets", json={"name": "docs", "dimensions": 2, "description": "alpha's",
                                         "metric_type": "euclidean", "index_type": "flat"}).status_code == 201
        assert b.post("/datasets", json={"name": "docs", "dimensions": 3, "description": "beta's",
                                         "metric_type": "cosine", "index_type": "hnsw"}).status_code == 201
        assert b.post("/datasets/docs/vectors", json={"vectors": [
            {"id": str(i), "values": [1.0, float(i), 0.5]} for i in range(3)]}).status_code == 200
        assert b.get("/datasets/docs").json()["description"] == "beta's"
        before = set(cache.keys("dataset:info:*"))  # this Valkey is the test's own: beta's entry only
        assert a.get("/datasets/docs").json()["description"] == "alpha's"
        (alpha_key,) = set(cache.keys("dataset:info:*")) - before
        (beta_key,) = before

        cache.set(alpha_key, cache.get(beta_key), ex=3600)  # beta's entry where alpha's belongs
        stats = a.get("/datasets/docs/stats").json()
        assert (stats["vector_count"], stats["index_stats"]["index_type"]) == (0, "flat"), stats
        assert a.get("/datasets/docs").json()["description"] == "alpha's"
        assert json.loads(cache.get(alpha_key) or b"{}").get("description") != "beta's"
        assert b.get("/datasets/docs").json()["description"] == "beta's"
    cache.close()


def _command_lines() -> list[str]:
    """Every process's command line readable here (where a password must never appear)."""
    lines = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                lines.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                continue
    return lines


# -- 8. failed authentications -----------------------------------------------------------------------------------


def test_failed_authentications_are_cached_and_rate_limited_per_address(served: tuple[str, Settings]) -> None:
    url, settings = served
    tenant, keys = _tenant_with_keys(settings, "lim", "write")
    search = {"k": 1, "queryVectors": [{"coordinates": [0, 1]}]}
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.get(f"{API}/data-sources", headers=_auth(keys["write"])).status_code == 200  # verified, cached
        bogus = [f"shoal_{uuid.uuid4().hex[:12]}_{uuid.uuid4().hex}" for _ in range(25)]
        statuses = [http.get(f"{API}/data-sources", headers=_auth(k)).status_code for k in bogus]
        # The default limit: 20 failures per address and minute; then 429 before any key is hashed.
        assert statuses == [401] * 20 + [429] * 5, statuses
        limited = http.post(f"{API}/search/Any.Index/1", headers=_auth(bogus[0]), json=search)
        assert limited.status_code == 429 and 0 < int(limited.headers["Retry-After"]) <= 60
        assert "too many failed authentications" in limited.json()["errorMessages"][0]
        _dataset_error(http.get(f"{API}/datasets", headers=_auth(bogus[1])), 429, "TOO_MANY_REQUESTS")

        # A key verified already still works from that address (it costs nothing); keyless callers too.
        assert http.get(f"{API}/data-sources", headers=_auth(keys["write"])).status_code == 200
        assert http.get(f"{API}/data-sources").status_code == 200
        # A good key not yet verified waits like any other: telling it apart would take the hash.
        with Shoal(settings, notify=False) as shoal:
            fresh = create_key(shoal.engine, tenant, "read")[1]
        assert http.get(f"{API}/data-sources", headers=_auth(fresh)).status_code == 429

    # A rejected key is remembered for a while (SHOAL_AUTH_FAILURE_CACHE_S): presenting it again costs no hash.
    from shoal.auth.cache import cache_for, digest

    with Shoal(settings, notify=False) as shoal:
        assert cache_for(shoal.engine).failure(digest(bogus[19])) == "invalid API key"
