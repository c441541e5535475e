"""Tenants, API keys and the caller's identity: `Authorization: ApiKey <key>` to a tenant-scoped Principal.

    tenant_id = create_tenant(engine, "acme")
    record, plaintext = create_key(engine, "acme", "write", "ingest job")   # plaintext shown once
    principal = authenticate(engine, request.headers.get("Authorization"), settings.anonymous_tenant)
    require(principal, "write")
    require_key(principal, "delete")    # anonymous callers upload and search, never delete

Every catalog query of a request is then scoped to `principal.tenant_id` (DESIGN invariant 7).
"""

from __future__ import annotations

from shoal.auth.keys import (
    KeyRecord,
    TenantRecord,
    authenticate,
    cached_principal,
    create_key,
    create_tenant,
    list_keys,
    list_tenants,
    revoke_key,
)
from shoal.auth.limits import FailureLimiter
from shoal.auth.principal import Principal, Role, require, require_key
from shoal.errors import AuthenticationError, PermissionDeniedError, RateLimitedError

__all__ = [
    "AuthenticationError",
    "FailureLimiter",
    "KeyRecord",
    "PermissionDeniedError",
    "RateLimitedError",
    "Principal",
    "Role",
    "TenantRecord",
    "authenticate",
    "cached_principal",
    "create_key",
    "create_tenant",
    "list_keys",
    "list_tenants",
    "require",
    "require_key",
    "revoke_key",
]
