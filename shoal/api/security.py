"""Who is calling: the tenant a request is scoped to, and whether it may write."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from shoal.api.state import TenantHandle, Tenants


@dataclass(frozen=True)
class TenantContext:
    """The caller's tenant, role and that tenant's client."""

    tenant: str
    role: str
    handle: TenantHandle


def _context(request: Request, need: str) -> TenantContext:
    tenants: Tenants = request.app.state.tenants
    # Until API keys land every request is served as the anonymous tenant (the embedded default's setting).
    tenant = tenants.settings.tenant
    return TenantContext(tenant, "write", tenants.get(tenant))


def reader_tenant(request: Request) -> TenantContext:
    """The caller, allowed to read."""
    return _context(request, "read")


def writer_tenant(request: Request) -> TenantContext:
    """The caller, allowed to write."""
    return _context(request, "write")
