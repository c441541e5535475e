"""Who is calling: `Authorization: ApiKey <key>` (or the anonymous tenant) to the tenant a request is scoped to,
and whether its role allows the route."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from shoal.api.state import TenantHandle, Tenants
from shoal.auth import Principal, Role, authenticate, cached_principal, require


@dataclass(frozen=True)
class TenantContext:
    """The caller's tenant, role and that tenant's client."""

    tenant: str
    role: str
    handle: TenantHandle


def _tenant_context(tenants: Tenants, principal: Principal, need: Role) -> TenantContext:
    require(principal, need)
    return TenantContext(principal.tenant_name, principal.role, tenants.get(principal.tenant_name))


def _context(request: Request, need: Role) -> TenantContext:
    tenants: Tenants = request.app.state.tenants
    principal = authenticate(
        tenants.engine, request.headers.get("Authorization"), tenants.settings.resolved_anonymous_tenant
    )
    return _tenant_context(tenants, principal, need)


def context_from_cache(tenants: Tenants, authorization: str | None, need: Role) -> TenantContext | None:
    """The caller's context when it is known without I/O (a cached key verdict, a tenant already served), so a
    search can be answered on the event loop; None when `reader_tenant` and the like must run in a thread.
    Raises as they do when the role is not enough."""
    principal = cached_principal(tenants.engine, authorization, tenants.settings.resolved_anonymous_tenant)
    if principal is None or not tenants.has(principal.tenant_name):
        return None
    return _tenant_context(tenants, principal, need)


def reader_tenant(request: Request) -> TenantContext:
    """The caller, allowed to read."""
    return _context(request, Role.READ)


def admin_tenant(request: Request) -> TenantContext:
    """The caller, allowed to administer its tenant."""
    return _context(request, Role.ADMIN)


def writer_tenant(request: Request) -> TenantContext:
    """The caller, allowed to write."""
    return _context(request, Role.WRITE)
