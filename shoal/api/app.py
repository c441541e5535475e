"""The HTTP service: Vektonn-compatible routes, management, the dataset API, health; errors answer through
`shoal.api.errors` (Vektonn's shape, and the dataset API's on its routes)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import version
from typing import Annotated, Any

from fastapi import Depends, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from shoal.api import health, manage, vektonn
from shoal.api.datasets import install as install_datasets
from shoal.api.errors import install as install_errors
from shoal.api.fanout import FanOut
from shoal.api.fastpath import FastSearchAPI
from shoal.api.health import HealthMonitor
from shoal.api.metrics import Metrics, MetricsView
from shoal.api.process_tuning import freeze_startup_objects, keep_large_blocks
from shoal.api.security import metrics_view
from shoal.api.state import Tenants
from shoal.config.settings import Settings


def _without_422(document: dict[str, Any]) -> None:
    """Remove the 422 FastAPI documents on every operation with parameters or a body: no route answers it (an
    invalid request is a 400 in the route's error shape, documented beside it), and with it the schemas only
    it refers to (HTTPValidationError, ValidationError)."""
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            if isinstance(operation, dict):
                operation.get("responses", {}).pop("422", None)
    schemas = document.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):  # the first refers to the second
        schema = schemas.pop(name, None)
        if schema is not None and f'"#/components/schemas/{name}"' in json.dumps(document):
            schemas[name] = schema  # still referred to elsewhere: kept


def create_app(settings: Settings | None = None) -> FastAPI:
    """The FastAPI application over the catalog, storage and broker the settings name."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.tenants = Tenants(settings)
        app.state.runtime = app.state.tenants.runtime
        monitor = HealthMonitor(app.state.runtime)  # the API's log says when nothing indexes
        monitor.start()
        placement = app.state.tenants.search.placement
        # Searches of indexes placed across nodes fan out to them (shoal.api.fanout); without a placement, none.
        app.state.fanout = (FanOut(placement, settings.fanout_timeout_s, app.state.metrics,
                                   hedge_s=settings.fanout_hedge_s) if placement.indexes else None)
        # Request bodies of megabytes: reuse their memory, and keep full collections short (shoal.api.process_tuning).
        keep_large_blocks()
        freeze_startup_objects()
        try:
            yield
        finally:
            monitor.stop()
            if app.state.fanout is not None:
                await app.state.fanout.close()
            app.state.tenants.close()

    # FastAPI, with the hot search route answered before its middleware and routing (shoal.api.fastpath).
    app = FastSearchAPI(title="Shoal", version=version("shoal"), lifespan=lifespan,
                        max_body_bytes=settings.body_limit_bytes)
    app.state.metrics = Metrics()
    app.state.fanout = None
    app.include_router(health.router)
    app.include_router(vektonn.router)
    app.include_router(manage.router)
    install_datasets(app)

    def openapi() -> dict[str, Any]:
        # The Vektonn routes read raw bodies (orjson, no pydantic per point): their documented body schemas
        # refer to components that no pydantic parameter brings in, so they are added here.
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in vektonn.body_definitions().items():
                schemas.setdefault(name, schema)
            _without_422(document)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    install_errors(app)  # every core error in Vektonn's shape (the dataset routes answer in their own)

    @app.get("/metrics", tags=["ops"], response_class=PlainTextResponse)
    def metrics(view: Annotated[MetricsView, Depends(metrics_view)]) -> PlainTextResponse:
        """Prometheus metrics: upload rate, search latency, lag and young tier per shard. Per-tenant series only for the
        metrics token (every tenant) or an admin key (its own tenant); totals without names otherwise."""
        search = app.state.tenants.search
        body = app.state.metrics.exposition(app.state.runtime.engine, view, app.state.runtime.segment_cache,
                                            search.young_tier(), search.young_bytes)
        return PlainTextResponse(body, media_type=CONTENT_TYPE_LATEST)

    return app
