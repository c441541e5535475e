"""Who is calling: `Authorization: ApiKey <key>` (or the anonymous tenant) to the tenant a request is scoped to,
and whether its role allows the route.

What each kind of route needs:

- read: searches, listings, status (`reader_tenant`);
- write: uploads, creates, updates, reindexes, restores (`writer_tenant`);
- write with a key: deletes and drops (`deleter_tenant`); a keyless caller never deletes;
- admin: what cannot be undone at once (`admin_tenant`, `require_admin`): hard deletes, trash purges,
  `overwrite` on create.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from shoal.api.http_protocol import PEER
from shoal.api.metrics import MetricsView
from shoal.api.state import TenantHandle, Tenants
from shoal.auth import Principal, Role, authenticate, cached_principal, require, require_key
from shoal.auth.keys import screen
from shoal.config.settings import Settings
from shoal.errors import AuthenticationError, ConfigurationError, PermissionDeniedError


@dataclass(frozen=True)
class TenantContext:
    """The caller's tenant, role and that tenant's client, and who the caller is."""

    tenant: str
    role: str
    handle: TenantHandle
    principal: Principal | None = None


def _tenant_context(tenants: Tenants, principal: Principal, need: Role) -> TenantContext:
    require(principal, need)
    return TenantContext(principal.tenant_name, principal.role, tenants.get(principal.tenant_name), principal)


def peer_address(scope: Mapping[str, Any]) -> str:
    """The address failed authentications are counted against: the connection's peer (a proxy in front counts as
    one), as Shoal's HTTP protocol records it. Never the ASGI `client`, which uvicorn's proxy middleware rewrites
    from X-Forwarded-For for any loopback peer: a header must not choose the address that is counted. Under
    another server, which records no peer, the ASGI `client`."""
    peer = scope[PEER] if PEER in scope else scope.get("client")
    return str(peer[0]) if peer else "unknown"


def client_address(request: Request) -> str:
    """The address failed authentications of `request` are counted against (`peer_address`)."""
    return peer_address(request.scope)


def _principal(request: Request) -> Principal:
    tenants: Tenants = request.app.state.tenants
    settings = tenants.settings
    return authenticate(
        tenants.engine,
        request.headers.get("Authorization"),
        tenants.anonymous_tenant,
        anonymous_role=tenants.anonymous_role,
        client=client_address(request),
        limiter=tenants.limiter,
        failure_ttl_s=settings.auth_failure_cache_s,
    )


def _context(request: Request, need: Role) -> TenantContext:
    return _tenant_context(request.app.state.tenants, _principal(request), need)


def context_from_cache(tenants: Tenants, authorization: str | None, need: Role) -> TenantContext | None:
    """The caller's context when it is known without I/O (a cached key verdict, a tenant already served), so a
    search can be answered on the event loop; None when `reader_tenant` and the like must run in a thread.
    Raises as they do when the role is not enough."""
    principal = cached_principal(tenants.engine, authorization, tenants.anonymous_tenant, tenants.anonymous_role)
    if principal is None or not tenants.has(principal.tenant_name):
        return None
    return _tenant_context(tenants, principal, need)


def screen_request(tenants: Tenants, scope: Mapping[str, Any], authorization: str | None) -> None:
    """Raise the AuthenticationError (401) or RateLimitedError (429) the routes would answer a request with, when
    its headers alone tell (shoal.auth.keys.screen: no KDF, no catalog), so it is refused before its body is
    read; return when the routes must authenticate it."""
    screen(tenants.engine, authorization, tenants.anonymous_tenant, client=peer_address(scope),
           limiter=tenants.limiter)


def reader_tenant(request: Request) -> TenantContext:
    """The caller, allowed to read."""
    return _context(request, Role.READ)


def writer_tenant(request: Request) -> TenantContext:
    """The caller, allowed to write."""
    return _context(request, Role.WRITE)


def deleter_tenant(request: Request) -> TenantContext:
    """The caller, allowed to delete: a write key (a keyless caller never deletes)."""
    principal = require_key(_principal(request), "delete or drop data")  # said first: the fix is to send a key
    return _tenant_context(request.app.state.tenants, principal, Role.WRITE)


def admin_tenant(request: Request) -> TenantContext:
    """The caller, allowed to administer its tenant and delete for good (an admin key)."""
    principal = require_key(_principal(request), "delete data for good or administer a tenant")
    return _tenant_context(request.app.state.tenants, principal, Role.ADMIN)


def require_admin(ctx: TenantContext, what: str) -> TenantContext:
    """`ctx` when its caller holds an admin key; PermissionDeniedError saying that `what` needs one otherwise."""
    principal = ctx.principal
    if principal is None or principal.anonymous or not principal.allows(Role.ADMIN):
        who = "a request without an API key" if principal is None or principal.anonymous else (
            f"API key {principal.key_id} (role {principal.role.value!r})"
        )
        raise PermissionDeniedError(f"{what} cannot be undone: it needs an admin key, and {who} is not one")
    return ctx


# -- /metrics --------------------------------------------------------------------------------------------------


def metrics_view(request: Request) -> MetricsView:
    """What a /metrics caller may see: every tenant with the metrics token (`Authorization: Bearer <token>`), its
    own tenant's series with an admin key, aggregates without any tenant's name otherwise."""
    tenants: Tenants = request.app.state.tenants
    token = tenants.settings.metrics_token
    header = (request.headers.get("Authorization") or "").strip()
    scheme, _, presented = header.partition(" ")
    if token and scheme.lower() == "bearer":
        # Compared first: it costs nothing, so the right token works from an address over its limit (a scraper
        # behind the proxy others fail through); only a wrong one is limited and counted.
        if hmac.compare_digest(presented.strip().encode(), token.encode()):
            return MetricsView(every_tenant=True)
        address = client_address(request)
        tenants.limiter.check(address)
        tenants.limiter.failed(address)
        raise AuthenticationError("invalid metrics token")
    principal = _principal(request)
    require(principal, Role.READ)
    if not principal.anonymous and principal.allows(Role.ADMIN):
        return MetricsView(tenant=principal.tenant_name)
    return MetricsView()


# -- where the API may listen ----------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """True when `host` only accepts connections from this machine (127.0.0.0/8, ::1, or a name resolving only
    to those); every other address, including 0.0.0.0 and ::, reaches the network."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not host:
        return False
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(found) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in found)


def check_exposure(settings: Settings, host: str) -> None:
    """Refuse (ConfigurationError, saying what to do) to serve anonymous writes on an address beyond loopback
    unless SHOAL_ALLOW_ANONYMOUS_WRITES (`shoal api --allow-anonymous-writes`) says so."""
    anonymous = settings.resolved_anonymous_tenant
    if anonymous is None or settings.anonymous_role != Role.WRITE or settings.allow_anonymous_writes:
        return
    if is_loopback(host):
        return
    raise ConfigurationError(
        f"refusing to listen on {host}: requests without an API key would upload and create as tenant "
        f"{anonymous!r} from the network. Require keys (SHOAL_ANONYMOUS_TENANT=''), make keyless callers "
        "read-only (SHOAL_ANONYMOUS_ROLE=read), listen on 127.0.0.1, or say it is meant with "
        "--allow-anonymous-writes (SHOAL_ALLOW_ANONYMOUS_WRITES=true)"
    )
