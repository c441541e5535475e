"""Who is calling: `Authorization: ApiKey <key>` (or the anonymous tenant) to the tenant a request is scoped to,
and whether its role allows the route."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from shoal.api.state import TenantHandle, Tenants
from shoal.auth import Role, authenticate, require


@dataclass(frozen=True)
class TenantContext:
    """The caller's tenant, role and that tenant's client."""

    tenant: str
    role: str
    handle: TenantHandle


def _context(request: Request, need: Role) -> TenantContext:
    tenants: Tenants = request.app.state.tenants
    principal = authenticate(
        tenants.engine, request.headers.get("Authorization"), tenants.settings.resolved_anonymous_tenant
    )
    require(principal, need)
    return TenantContext(principal.tenant_name, principal.role, tenants.get(principal.tenant_name))


def reader_tenant(request: Request) -> TenantContext:
    """The caller, allowed to read."""
    return _context(request, Role.READ)


def admin_tenant(request: Request) -> TenantContext:
    """The caller, allowed to administer its tenant."""
    return _context(request, Role.ADMIN)


def writer_tenant(request: Request) -> TenantContext:
    """The caller, allowed to write."""
    return _context(request, Role.WRITE)
