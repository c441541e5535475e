"""What the HTTP service keeps per tenant: a Shoal client and a searcher that follows new versions."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from shoal.catalog.db import make_engine, resolve_database_url
from shoal.client import Shoal, ensure_migrated
from shoal.config.settings import Settings
from shoal.searcher.searcher import Searcher


@dataclass
class TenantHandle:
    """One tenant's client and searcher."""

    shoal: Shoal
    searcher: Searcher


class Tenants:
    """Per-tenant clients, made on first use and kept for the life of the service."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        url = resolve_database_url(settings)
        ensure_migrated(url)
        self.engine = make_engine(url)  # for authentication, before the caller's tenant is known
        self._handles: dict[str, TenantHandle] = {}
        self._lock = threading.Lock()

    def get(self, tenant: str) -> TenantHandle:
        """The tenant's handle (created, with its tenant row, on first use)."""
        with self._lock:
            handle = self._handles.get(tenant)
            if handle is None:
                shoal = Shoal(self.settings, tenant=tenant)
                handle = TenantHandle(shoal, shoal.searcher())
                self._handles[tenant] = handle
            return handle

    def close(self) -> None:
        """Stop every searcher and release connections."""
        with self._lock:
            for h in self._handles.values():
                h.searcher.close()
                h.shoal.close()
            self._handles.clear()
        self.engine.dispose()
