"""The HTTP service: Vektonn-compatible routes, health, and errors in Vektonn's shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import version
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from shoal.api import health, manage, vektonn
from shoal.api.datasets import install as install_datasets
from shoal.api.fastpath import FastSearchAPI
from shoal.api.health import HealthMonitor
from shoal.api.metrics import Metrics
from shoal.api.security import TenantContext, reader_tenant
from shoal.api.state import Tenants
from shoal.config.settings import Settings
from shoal.errors import (
    AlreadyExistsError,
    AuthenticationError,
    BackpressureError,
    CapacityError,
    ConfigurationError,
    NotFoundError,
    PermissionDeniedError,
    ReindexConflictError,
    ShoalError,
    ValidationError,
)


def _errors(status: int, messages: list[str]) -> JSONResponse:
    return JSONResponse(status_code=status, content={"errorMessages": messages})


def create_app(settings: Settings | None = None) -> FastAPI:
    """The FastAPI application over the catalog, storage and broker the settings name."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.tenants = Tenants(settings)
        app.state.runtime = app.state.tenants.runtime
        monitor = HealthMonitor(app.state.runtime)  # the API's log says when nothing indexes
        monitor.start()
        try:
            yield
        finally:
            monitor.stop()
            app.state.tenants.close()

    # FastAPI, with the hot search route answered before its middleware and routing (shoal.api.fastpath).
    app = FastSearchAPI(title="Shoal", version=version("shoal"), lifespan=lifespan)
    app.state.metrics = Metrics()
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
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        messages = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            messages.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return _errors(400, messages or ["invalid request"])

    @app.exception_handler(ValidationError)
    async def _invalid(_: Request, exc: ValidationError) -> JSONResponse:
        return _errors(400, [f"{exc.prefix}: {p}" for p in exc.problems])

    @app.exception_handler(AuthenticationError)
    async def _unauthenticated(_: Request, exc: AuthenticationError) -> JSONResponse:
        response = _errors(401, [str(exc)])
        response.headers["WWW-Authenticate"] = "ApiKey"
        return response

    @app.exception_handler(PermissionDeniedError)
    async def _forbidden(_: Request, exc: PermissionDeniedError) -> JSONResponse:
        return _errors(403, [str(exc)])

    @app.exception_handler(NotFoundError)
    async def _not_found(_: Request, exc: NotFoundError) -> JSONResponse:
        return _errors(404, [str(exc)])

    @app.exception_handler(ReindexConflictError)
    async def _reindex_conflict(_: Request, exc: ReindexConflictError) -> JSONResponse:
        return _errors(409, [str(exc)])

    @app.exception_handler(AlreadyExistsError)
    async def _conflict(_: Request, exc: AlreadyExistsError) -> JSONResponse:
        return _errors(409, [str(exc)])

    @app.exception_handler(ConfigurationError)
    async def _unavailable(_: Request, exc: ConfigurationError) -> JSONResponse:
        return _errors(503, [str(exc)])

    @app.exception_handler(CapacityError)
    async def _over_capacity(_: Request, exc: CapacityError) -> JSONResponse:
        return _errors(503, [str(exc)])

    @app.exception_handler(BackpressureError)
    async def _too_many(_: Request, exc: BackpressureError) -> JSONResponse:
        response = _errors(429, [str(exc)])
        response.headers["Retry-After"] = str(exc.retry_after)
        return response

    @app.exception_handler(ShoalError)
    async def _shoal_error(_: Request, exc: ShoalError) -> JSONResponse:
        return _errors(500, [str(exc)])

    @app.get("/metrics", tags=["ops"], response_class=PlainTextResponse)
    def metrics(ctx: Annotated[TenantContext, Depends(reader_tenant)]) -> PlainTextResponse:
        """Prometheus metrics: upload rate, search latency, and the caller's tenant's lag per shard."""
        body = app.state.metrics.exposition(ctx.handle.shoal.engine, ctx.tenant, app.state.runtime.segment_cache)
        return PlainTextResponse(body, media_type=CONTENT_TYPE_LATEST)

    return app
