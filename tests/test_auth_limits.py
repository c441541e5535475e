"""The failed-authentication limit (README "Tenants and keys"): what it counts, what it spares, and that a refused
caller is answered before its request body is read; key names and ids the catalog cannot store."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from conftest import serve_api, settings_env

from shoal import Shoal
from shoal.auth import (
    AuthenticationError,
    FailureLimiter,
    RateLimitedError,
    authenticate,
    create_key,
    create_tenant,
    list_keys,
    revoke_key,
)
from shoal.auth.cache import VerifiedKeys, cache_for
from shoal.auth.keys import screen
from shoal.config.settings import Settings
from shoal.errors import NotFoundError, ValidationError

API = "/api/v1"


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _bogus() -> str:
    """A well-formed key no tenant has."""
    return f"shoal_{uuid.uuid4().hex[:12]}_{uuid.uuid4().hex}"


def _tenant_with_keys(settings: Settings, *roles: str) -> tuple[str, list[tuple[str, str]]]:
    """A fresh tenant and, per role, a key's (id, plaintext)."""
    name = f"lim-{uuid.uuid4().hex[:8]}"
    with Shoal(settings, notify=False) as shoal:
        create_tenant(shoal.engine, name)
        keys = [create_key(shoal.engine, name, role) for role in roles]
    return name, [(record.key_id, plaintext) for record, plaintext in keys]


@pytest.fixture
def settings(make_settings: Callable[..., Settings]) -> Settings:
    """Settings without an anonymous tenant (every caller needs a key)."""
    return make_settings("local", anonymous_tenant="")


# -- the limiter and the key cache, on injected clocks ---------------------------------------------------------


def test_a_key_that_worked_keeps_working_from_a_limited_address_after_its_verdict_expires(settings: Settings) -> None:
    """The verdict cache (30 s) is shorter than the failure window (60 s): a key verified before an address was
    limited must not be refused 429 when its verdict expires and it is verified again (README: keys an address
    used successfully keep working)."""
    tenant, [(good_id, good), (_, unused)] = _tenant_with_keys(settings, "read", "read")
    clock = FakeClock()
    cache = VerifiedKeys(ttl_s=30, clock=clock)
    limiter = FailureLimiter(3, 600, clock=clock)
    with Shoal(settings, notify=False) as shoal:
        engine = shoal.engine

        def auth(key: str) -> str:
            return authenticate(engine, f"ApiKey {key}", cache=cache, client="10.0.0.1", limiter=limiter).tenant_name

        assert auth(good) == tenant
        for _ in range(3):
            with pytest.raises(AuthenticationError, match="invalid API key"):
                auth(_bogus())
        with pytest.raises(RateLimitedError):
            auth(_bogus())
        clock.now += 31  # the verdict has expired; the address's window has not
        assert auth(good) == tenant  # verified again (the KDF), not refused
        with pytest.raises(RateLimitedError):
            auth(unused)  # never verified: it waits like any other key
        # Revoked: refused once for what it is (by the KDF), then limited like any other key.
        revoke_key(engine, good_id)
        clock.now += 31
        with pytest.raises(AuthenticationError, match="revoked"):
            auth(good)
        with pytest.raises(RateLimitedError):
            auth(good)


def test_a_key_counts_as_verified_recently_for_the_window_after_its_verdict(settings: Settings) -> None:
    """How long a verified key is spared: while its verdict holds, and a failure window after it."""
    tenant, [(_, idle), (_, busy)] = _tenant_with_keys(settings, "read", "read")
    clock = FakeClock()
    cache = VerifiedKeys(ttl_s=30, clock=clock)
    limiter = FailureLimiter(1, 60, clock=clock)
    with Shoal(settings, notify=False) as shoal:

        def auth(key: str) -> str:
            return authenticate(shoal.engine, f"ApiKey {key}", cache=cache, client="10.0.0.2",
                                limiter=limiter).tenant_name

        assert auth(idle) == tenant
        clock.now += 60
        assert auth(busy) == tenant
        clock.now += 31  # idle: verified 91 s ago (> 30 + 60); busy: 31 s ago, its verdict just expired
        with pytest.raises(AuthenticationError):
            auth(_bogus())
        with pytest.raises(RateLimitedError):
            auth(idle)
        assert auth(busy) == tenant


def test_screen_refuses_from_the_headers_alone_what_authenticate_would(settings: Settings) -> None:
    """`screen` answers without the KDF or the catalog, counting failures as `authenticate` does; it returns
    whenever `authenticate` must decide."""
    _, [(_, good), (_, unverified)] = _tenant_with_keys(settings, "read", "read")
    clock = FakeClock()
    cache = VerifiedKeys(ttl_s=30, clock=clock)
    limiter = FailureLimiter(2, 60, clock=clock)
    with Shoal(settings, notify=False) as shoal:
        engine = shoal.engine

        def check(header: str | None, anonymous: str | None = None) -> None:
            screen(engine, header, anonymous, cache=cache, client="10.0.0.3", limiter=limiter)

        with pytest.raises(AuthenticationError, match="missing API key"):
            check(None)
        check(None, "anon")  # the anonymous tenant: authenticate decides
        check(f"ApiKey {unverified}")  # a key to hash: authenticate decides
        authenticate(engine, f"ApiKey {good}", cache=cache, client="10.0.0.3", limiter=limiter)
        bad = _bogus()
        with pytest.raises(AuthenticationError):
            authenticate(engine, f"ApiKey {bad}", cache=cache, client="10.0.0.3", limiter=limiter)
        with pytest.raises(AuthenticationError, match="invalid API key"):
            check(f"ApiKey {bad}")  # rejected moments ago: no KDF; the second failure of the address
        with pytest.raises(RateLimitedError):
            check(f"ApiKey {unverified}")
        with pytest.raises(RateLimitedError):
            check("Basic dXNlcjpwYXNz")  # a malformed header from a limited address
        check(f"ApiKey {good}")  # cached: it passes
        check(None, "anon")


# -- through a served app --------------------------------------------------------------------------------------


def test_a_limited_address_keeps_its_verified_keys_and_the_metrics_token(settings: Settings) -> None:
    token = "scrape-" + uuid.uuid4().hex
    settings = settings.model_copy(update={"auth_failure_limit": 3, "metrics_token": token})
    _, [(_, good), (_, unused)] = _tenant_with_keys(settings, "admin", "read")
    scrape = {"Authorization": f"Bearer {token}"}
    with Shoal(settings, notify=False) as shoal:
        cache = cache_for(shoal.engine)  # the served app's: one cache per catalog and process
    real_clock = cache.clock
    with serve_api(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert http.get(f"{API}/data-sources", headers={"Authorization": f"ApiKey {good}"}).status_code == 200
        statuses = [http.get(f"{API}/data-sources", headers={"Authorization": f"ApiKey {_bogus()}"}).status_code
                    for _ in range(4)]
        assert statuses == [401, 401, 401, 429]
        # The metrics token is compared before the limit is checked: right, it works; wrong, it is limited.
        assert http.get("/metrics", headers=scrape).status_code == 200
        assert http.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 429
        try:
            cache.clock = lambda: real_clock() + 31  # 31 s on: the key's verdict expired, the window did not
            r = http.get(f"{API}/data-sources", headers={"Authorization": f"ApiKey {good}"})
            assert r.status_code == 200, r.text
            assert http.get(f"{API}/data-sources", headers={"Authorization": f"ApiKey {unused}"}).status_code == 429
        finally:
            cache.clock = real_clock


def test_the_limit_counts_the_connection_s_peer_not_x_forwarded_for(settings: Settings) -> None:
    """uvicorn trusts X-Forwarded-For from loopback peers; the limit must count the peer all the same (README:
    the address is the connection's peer), or any local caller picks a fresh address per attempt."""
    settings = settings.model_copy(update={"auth_failure_limit": 3})
    with serve_api(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        statuses = [http.get(f"{API}/data-sources", headers={"Authorization": f"ApiKey {_bogus()}",
                                                             "X-Forwarded-For": f"10.9.0.{i}"}).status_code
                    for i in range(5)]
    assert statuses == [401, 401, 401, 429, 429]


def _send_head(port: int, path: str, length: int, *headers: str) -> socket.socket:
    """A connection that has sent a request's head declaring `length` body bytes, and none of the body."""
    sock = socket.create_connection(("127.0.0.1", port))
    head = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json", f"Content-Length: {length}",
            *headers]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
    return sock


def _response(sock: socket.socket) -> tuple[int, dict[str, str], Any]:
    """The status, headers and JSON body of the answer; socket.timeout when none comes within 10 s."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, json.loads(body)


def test_a_refused_caller_is_answered_before_its_body_is_read(settings: Settings) -> None:
    """401 and 429 come from the headers: the body (here 50 MB declared, none sent) is never waited for nor
    buffered, in either error shape. A cached key's request is read and routed as always."""
    settings = settings.model_copy(update={"auth_failure_limit": 1, "max_body_bytes": 60_000_000})
    _, [(_, good)] = _tenant_with_keys(settings, "write")
    upload = f"{API}/upload/Nothing.Here/1"
    with serve_api(settings) as url:
        port = int(url.rsplit(":", 1)[1])
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.get(f"{API}/data-sources", headers={"Authorization": f"ApiKey {good}"}).status_code == 200

        with _send_head(port, upload, 50_000_000) as sock:  # no key, no anonymous tenant
            status, headers, body = _response(sock)
        assert (status, headers["www-authenticate"]) == (401, "ApiKey")
        assert "missing API key" in body["errorMessages"][0]

        with _send_head(port, upload, 50_000_000, "Authorization: ApiKey") as sock:  # malformed: counted
            status, _, body = _response(sock)
        assert status == 401 and "malformed Authorization header" in body["errorMessages"][0], body

        with _send_head(port, upload, 50_000_000, f"Authorization: ApiKey {_bogus()}") as sock:
            status, headers, body = _response(sock)
        assert status == 429 and 0 < int(headers["retry-after"]) <= 60
        assert "too many failed authentications" in body["errorMessages"][0]

        with _send_head(port, f"{API}/datasets", 50_000_000, f"Authorization: ApiKey {_bogus()}") as sock:
            status, headers, body = _response(sock)
        assert status == 429 and "retry-after" in headers
        assert (body["success"], body["error_code"]) == (False, "TOO_MANY_REQUESTS"), body

        # A key verified already still works from the limited address, its body read and routed.
        with httpx.Client(base_url=url, timeout=30) as http:
            r = http.post(upload, headers={"Authorization": f"ApiKey {good}"}, content=b"[]")
            assert r.status_code == 404 and "Nothing.Here" in r.text, r.text


# -- key names and ids the catalog cannot store ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["caf\udce9", "a\x00b"])
def test_a_key_name_the_catalog_cannot_store_is_a_validation_error(settings: Settings, name: str) -> None:
    tenant, _ = _tenant_with_keys(settings)
    with Shoal(settings, notify=False) as shoal:
        with pytest.raises(ValidationError, match="key name must be valid Unicode without NUL"):
            create_key(shoal.engine, tenant, "read", name)
        for key_id in ("\udce9", "0123456789a\x00", "0123456789AB"):
            with pytest.raises(NotFoundError, match="not found"):
                revoke_key(shoal.engine, key_id)


def test_the_cli_reports_a_name_or_id_that_is_not_utf8_in_one_line(settings: Settings) -> None:
    """`shoal key create --name` / `key revoke` with a byte of a latin-1 terminal (not UTF-8) in argv."""
    tenant, _ = _tenant_with_keys(settings)
    env = os.environ | settings_env(settings) | {"COLUMNS": "200"}
    for args in ([b"key", b"create", b"--tenant", tenant.encode(), b"--role", b"read", b"--name", b"caf\xe9"],
                 [b"key", b"revoke", b"\xe9"]):
        done = subprocess.run([sys.executable.encode(), b"-m", b"shoal.cli", *args], env=env, capture_output=True,
                              timeout=120)
        stderr = done.stderr.decode(errors="replace")
        assert done.returncode == 1, stderr
        assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
        assert stderr.startswith("error: ") and ("key name must be valid Unicode" in stderr or "not found" in stderr)
    with Shoal(settings, notify=False) as shoal:
        assert list_keys(shoal.engine, tenant) == []
