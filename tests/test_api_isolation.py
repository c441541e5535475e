"""Tenants are isolated over HTTP: a key of tenant A finds nothing of tenant B on any route; a read key cannot
write; no key is refused unless an anonymous tenant is configured."""

from __future__ import annotations

import httpx
import pytest
from test_api_vektonn import _free_port, point

from shoal import DataSourceSpec, Shoal
from shoal.api.app import create_app
from shoal.auth import create_key, create_tenant
from shoal.log.records import IndexSpec


@pytest.fixture
def two_tenants(make_settings):  # type: ignore[no-untyped-def]
    import threading

    import uvicorn
    from conftest import wait_for

    settings = make_settings("local")  # anonymous off: a database URL is configured
    shoal = Shoal(settings, notify=False)
    keys = {}
    for tenant in ("tenant-a", f"b-{settings.tenant}"):
        try:
            create_tenant(shoal.engine, tenant)
        except Exception:  # noqa: BLE001 - tenant-a exists from an earlier test in this session
            pass
        keys[tenant] = {role: create_key(shoal.engine, tenant, role)[1] for role in ("read", "write")}
    b = f"b-{settings.tenant}"
    with Shoal(settings, tenant=b, notify=False) as tb:
        tb.create_data_source(DataSourceSpec("Secret", "1", 2, {"id": "int64"}, ["id"]))
        tb.create_index(IndexSpec("Secret.Index", "1", "Secret", "1", algorithm="FaissIndex.L2"))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "the API server to start")
    yield f"http://127.0.0.1:{port}", keys["tenant-a"], keys[b]
    server.should_exit = True
    thread.join(10)
    shoal.close()


ROUTES = [
    ("POST", "/api/v1/upload/Secret/1", [{"attributes": [{"key": "id", "value": {"int64": 1}}],
                                         "vector": {"coordinates": [0, 0]}}]),
    ("POST", "/api/v1/search/Secret.Index/1", {"k": 1, "queryVectors": [{"coordinates": [0, 0]}]}),
    ("GET", "/api/v1/search/Secret.Index/1", {"k": 1, "queryVectors": [{"coordinates": [0, 0]}]}),
    ("GET", "/api/v1/data-sources/Secret/1", None),
    ("DELETE", "/api/v1/data-sources/Secret/1", None),
    ("GET", "/api/v1/indexes/Secret.Index/1", None),
    ("GET", "/api/v1/indexes/Secret.Index/1/status", None),
    ("DELETE", "/api/v1/indexes/Secret.Index/1", None),
]


def test_a_key_of_one_tenant_never_reaches_another(two_tenants) -> None:  # type: ignore[no-untyped-def]
    url, a_keys, b_keys = two_tenants
    a = {"Authorization": f"ApiKey {a_keys['write']}"}
    with httpx.Client(base_url=url, timeout=30) as http:
        for method, path, body in ROUTES:
            r = http.request(method, path, json=body, headers=a)
            assert r.status_code == 404, (method, path, r.status_code, r.text)
        assert http.get("/api/v1/data-sources", headers=a).json() == []
        assert "Secret" not in http.get("/metrics", headers=a).text
        # Tenant B still has everything, untouched.
        b = {"Authorization": f"ApiKey {b_keys['read']}"}
        assert [s["name"] for s in http.get("/api/v1/data-sources", headers=b).json()] == ["Secret"]
        assert http.get("/api/v1/indexes/Secret.Index/1", headers=b).status_code == 200


def test_roles_and_missing_keys(two_tenants) -> None:  # type: ignore[no-untyped-def]
    url, _, b_keys = two_tenants
    read = {"Authorization": f"ApiKey {b_keys['read']}"}
    write = {"Authorization": f"apikey {b_keys['write']}"}  # the scheme is case-insensitive
    with httpx.Client(base_url=url, timeout=30) as http:
        body = [point(7, "x", [0.0, 1.0])]
        body[0]["attributes"] = body[0]["attributes"][:1]  # type: ignore[index]
        r = http.post("/api/v1/upload/Secret/1", json=body, headers=read)
        assert r.status_code == 403
        assert http.delete("/api/v1/indexes/Secret.Index/1", headers=read).status_code == 403
        assert http.post("/api/v1/upload/Secret/1", json=body, headers=write).status_code == 200
        assert http.post("/api/v1/search/Secret.Index/1", headers=read,
                         json={"k": 1, "queryVectors": [{"coordinates": [0, 1]}]},
                         ).status_code == 200
        r = http.get("/api/v1/data-sources")
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "ApiKey"
        assert http.get("/api/v1/data-sources", headers={"Authorization": "ApiKey shoal_nope_nope"}).status_code == 401
        assert http.get("/healthz").status_code == 200
