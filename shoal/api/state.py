"""What the HTTP service keeps: one runtime and one search service for the process, and per tenant a cheap
scope over them (a `Shoal` facade and a `Searcher`), made on first use."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from shoal.auth.limits import FailureLimiter
from shoal.auth.principal import Role
from shoal.client import Shoal
from shoal.config.settings import Settings
from shoal.runtime import Runtime
from shoal.searcher.placement import Placement
from shoal.searcher.searcher import Searcher, SearchService


@dataclass(frozen=True)
class TenantHandle:
    """One tenant's client and searcher, both scopes over the process's runtime."""

    shoal: Shoal
    searcher: Searcher


class Tenants:
    """The process's runtime and search service, a handle per tenant over them, and the count of failed
    authentications per client address (429 past SHOAL_AUTH_FAILURE_LIMIT)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        placement = Placement.load(settings.placement_file, settings.node)  # a bad file fails before any I/O
        self.runtime = Runtime(settings)
        self.engine = self.runtime.engine  # for authentication, before the caller's tenant is known
        self.search = SearchService(self.runtime, placement=placement)
        self.limiter = FailureLimiter(settings.auth_failure_limit, settings.auth_failure_window_s)
        self.anonymous_tenant = settings.resolved_anonymous_tenant  # read by every keyless request: resolved once
        self.anonymous_role = Role(settings.anonymous_role)
        self._handles: dict[str, TenantHandle] = {}
        self._lock = threading.Lock()

    def get(self, tenant: str) -> TenantHandle:
        """The tenant's handle (created, with its tenant row, on first use)."""
        handle = self._handles.get(tenant)  # one dict read: handles are only ever added whole
        if handle is None:
            shoal = Shoal(tenant=tenant, runtime=self.runtime)
            with self._lock:
                handle = self._handles.setdefault(tenant, TenantHandle(shoal, self.search.for_tenant(shoal.scope)))
        return handle

    def has(self, tenant: str) -> bool:
        """True when the tenant's handle exists already (getting it costs no I/O)."""
        return tenant in self._handles

    def close(self) -> None:
        """Stop the search service and release every connection."""
        self.search.close()
        with self._lock:
            self._handles.clear()
        self.runtime.close()
