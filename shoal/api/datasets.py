"""The dataset API (DeepLake-style) under `/api/v1`, scoped to the caller's tenant.

Errors on these routes, and only these, take the shape `{"success": false, "error_code", "message", "details"}`:
the routes use `DatasetRoute`, which turns every exception raised while serving one of them (request
validation, the tenant dependency, the service) into that shape, so the app's Vektonn-shaped handlers never see
them. An exception type the app has its own handler for (other than the Shoal errors mapped here) is passed on.

Wire it with `install(app)`. The semantics (schema, names, counts, cache, merge orders) are documented in
`shoal.datasets`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt
from starlette.exceptions import HTTPException as StarletteHTTPException

from shoal.api.security import TenantContext, reader_tenant, writer_tenant
from shoal.datasets import rules
from shoal.datasets.cache import DatasetCache
from shoal.datasets.errors import STATUS, DatasetError, ErrorCode
from shoal.datasets.service import DatasetService
from shoal.errors import (
    AlreadyExistsError,
    AuthenticationError,
    ConfigurationError,
    NotFoundError,
    PermissionDeniedError,
    ShoalError,
    ValidationError,
)

log = logging.getLogger(__name__)

# A request body field whose type check fails gets the code of the rule it belongs to.
FIELD_CODES = {
    "name": ErrorCode.INVALID_DATASET_NAME,
    "dimensions": ErrorCode.INVALID_DIMENSIONS,
    "metric_type": ErrorCode.INVALID_DATASET_CONFIG,
    "index_type": ErrorCode.INVALID_DATASET_CONFIG,
    "index_params": ErrorCode.INVALID_DATASET_CONFIG,
    "description": ErrorCode.INVALID_DATASET_CONFIG,
    "metadata": ErrorCode.INVALID_DATASET_CONFIG,
}
HTTP_CODES = {401: "UNAUTHORIZED", 403: "FORBIDDEN", 404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED",
              413: "PAYLOAD_TOO_LARGE", 429: "TOO_MANY_REQUESTS"}


# -- errors ------------------------------------------------------------------------------------------------


def _error(status: int, code: str, message: str, details: dict[str, Any] | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"success": False, "error_code": code, "message": message, "details": details or {}}
    return JSONResponse(status_code=status, content=body, headers=headers)


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    errors = []
    codes = set()
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ())]
        errors.append({"loc": ".".join(loc), "msg": str(err.get("msg", "")), "type": str(err.get("type", ""))})
        top = loc[1] if len(loc) >= 2 and loc[0] == "body" and err.get("type") != "missing" else ""
        codes.add(FIELD_CODES.get(top, ErrorCode.VALIDATION_ERROR))
    code = codes.pop() if len(codes) == 1 else ErrorCode.VALIDATION_ERROR
    shown = "; ".join(f"{e['loc']}: {e['msg']}" if e["loc"] else e["msg"] for e in errors[:10])
    return _error(STATUS[code], code.value, f"invalid request: {shown or 'malformed body'}", {"errors": errors[:100]})


def _app_handles(request: Request, exc: Exception) -> bool:
    handlers = getattr(request.app, "exception_handlers", {})
    return any(cls in handlers for cls in type(exc).__mro__ if cls not in (Exception, BaseException))


def error_response(request: Request, exc: Exception) -> JSONResponse | None:
    """The dataset API's answer to an exception, or None when the app's own handler should answer it."""
    if isinstance(exc, DatasetError):
        return _error(exc.status, exc.code.value, exc.message, exc.details)
    if isinstance(exc, RequestValidationError):
        return _validation_error(exc)
    if isinstance(exc, StarletteHTTPException):
        code = HTTP_CODES.get(exc.status_code, "HTTP_ERROR")
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return _error(exc.status_code, code, detail, {}, dict(exc.headers or {}))
    if isinstance(exc, AuthenticationError):
        return _error(401, ErrorCode.UNAUTHORIZED.value, str(exc), {}, {"WWW-Authenticate": "ApiKey"})
    if isinstance(exc, PermissionDeniedError):
        return _error(403, ErrorCode.FORBIDDEN.value, str(exc))
    if isinstance(exc, NotFoundError):
        return _error(404, ErrorCode.DATASET_NOT_FOUND.value, str(exc))
    if isinstance(exc, ValidationError):
        return _error(400, ErrorCode.VALIDATION_ERROR.value, str(exc), {"problems": [str(p) for p in exc.problems]})
    if isinstance(exc, AlreadyExistsError):
        return _error(409, ErrorCode.DATASET_ALREADY_EXISTS.value, str(exc))
    if isinstance(exc, ConfigurationError):
        return _error(503, ErrorCode.SERVICE_UNAVAILABLE.value, str(exc))
    if not isinstance(exc, ShoalError) and _app_handles(request, exc):
        return None
    log.exception("dataset API: unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return _error(500, ErrorCode.INTERNAL_ERROR.value, "internal error", {})


class DatasetRoute(APIRoute):
    """A route whose failures answer in the dataset API's error shape (scoped to the routes using it)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:  # noqa: BLE001 - every failure becomes an error response
                response = error_response(request, exc)
                if response is None:
                    raise
                return response

        return handle


# -- request and response bodies ---------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


MetricType = Literal["cosine", "euclidean", "manhattan", "dot_product"]
IndexType = Literal["flat", "hnsw", "ivf"]


class CreateDatasetRequest(_Body):
    """A new dataset. Unknown fields are refused."""

    name: str = Field(json_schema_extra={"pattern": rules.NAME_RE.pattern, "maxLength": 100})
    dimensions: StrictInt = Field(json_schema_extra={"minimum": rules.MIN_DIMENSIONS, "maximum": rules.MAX_DIMENSIONS})
    metric_type: MetricType = "cosine"
    index_type: IndexType = "hnsw"
    description: str | None = None
    metadata: dict[str, Any] | None = None
    index_params: dict[str, Any] | None = None
    overwrite: StrictBool = False


class UpdateDatasetRequest(BaseModel):
    """The fields to change; a field left out stays as it is, null clears it. Any other field is refused
    (INVALID_DATASET_CONFIG)."""

    model_config = ConfigDict(extra="allow")

    description: str | None = None
    metadata: dict[str, Any] | None = None


class DatasetOut(BaseModel):
    """A dataset (`vector_count` and `storage_size` are O(1) catalog figures; /stats has exact ones)."""

    id: str
    name: str
    description: str | None
    dimensions: int
    metric_type: str
    index_type: str
    metadata: dict[str, Any] | None
    created_at: str
    updated_at: str
    vector_count: int
    storage_size: int


class DatasetListOut(BaseModel):
    """A page of datasets by name."""

    datasets: list[DatasetOut]
    total: int
    limit: int
    offset: int


class DeleteOut(BaseModel):
    """What a delete did: `soft` (moved to the trash, restorable until `purge_after`, `trash_id` names it
    there) or hard (`files_deleted` files deleted at once)."""

    success: bool
    dataset_id: str
    deleted: bool
    soft: bool
    files_deleted: int
    trash_id: int | None
    purge_after: str | None


class TrashedDatasetOut(DatasetOut):
    """A dataset in the trash: restorable until `purge_after`; `trash_id` tells apart several of one name."""

    trash_id: int
    deleted_at: str
    purge_after: str


class TrashListOut(BaseModel):
    """A page of the trash, most recently deleted first."""

    datasets: list[TrashedDatasetOut]
    total: int
    limit: int
    offset: int


class PurgeOut(BaseModel):
    """A dataset deleted for good from the trash."""

    success: bool
    dataset_id: str
    trash_id: int
    purged: bool
    files_deleted: int


class IndexStatsOut(BaseModel):
    """The default index: type, metric, parameters and freshness per shard."""

    index_type: str
    metric_type: str
    index_params: dict[str, Any]
    shards: list[dict[str, Any]]


class StatsOut(BaseModel):
    """Exact live vector count, bytes in storage, metadata stats, index stats."""

    dataset_id: str
    vector_count: int
    storage_size: int
    storage: dict[str, int]
    metadata_stats: dict[str, Any]
    index_stats: IndexStatsOut


class VectorIn(_Body):
    """One vector to upsert; an `id` already in the dataset is replaced."""

    id: str
    document_id: str | None = None
    content: str | None = None
    metadata: dict[str, Any] | None = None
    values: list[StrictFloat]


class UpsertRequest(_Body):
    """Vectors to upsert, all or nothing."""

    vectors: list[VectorIn]


class UpsertOut(BaseModel):
    """How many vectors were written, and the write token a search can require (`min_write_token`)."""

    dataset_id: str
    inserted: int
    write_token: int


class SearchRequest(_Body):
    """A kNN query."""

    vector: list[StrictFloat]
    top_k: StrictInt = 10
    consistency: Literal["eventual", "strong"] | None = None
    min_write_token: StrictInt | None = None


class ResultOut(BaseModel):
    """One nearest vector; `score` is the metric's distance."""

    id: str | None
    score: float
    content: str | None
    metadata: Any
    document_id: str | None


class SearchOut(BaseModel):
    """Results nearest first (ascending score, or descending when `higher_is_better`)."""

    dataset_id: str
    metric_type: str
    higher_is_better: bool
    consistency: str
    results: list[ResultOut]


class MultiSearchRequest(_Body):
    """One query over several datasets, merged (see `shoal.datasets.merge` for the strategies)."""

    dataset_ids: list[str]
    vector: list[StrictFloat]
    top_k: StrictInt = 10
    merge_strategy: Literal["interleave", "score", "round_robin"] = "interleave"
    consistency: Literal["eventual", "strong"] | None = None


class MultiResultOut(ResultOut):
    """A result tagged with its dataset and its rank within that dataset's own results (0 = nearest)."""

    dataset_id: str
    rank: int


class MultiSearchOut(BaseModel):
    """The merged results."""

    merge_strategy: str
    dataset_ids: list[str]
    top_k: int
    consistency: str
    results: list[MultiResultOut]


class ErrorOut(BaseModel):
    """Every error of the dataset API."""

    success: bool = False
    error_code: str
    message: str
    details: dict[str, Any]


# -- wiring ------------------------------------------------------------------------------------------------

ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorOut} for s in (400, 401, 403, 404, 409, 500, 501, 503)
}
router = APIRouter(prefix="/api/v1", tags=["datasets"], route_class=DatasetRoute, responses=ERRORS)
_cache_lock = threading.Lock()


def _cache(request: Request, ctx: TenantContext) -> DatasetCache:
    state = request.app.state
    with _cache_lock:
        cache = getattr(state, "dataset_cache", None)
        if cache is None:
            cache = DatasetCache(ctx.handle.shoal.broker_url)
            state.dataset_cache = cache
        return cache


def read_service(request: Request, ctx: Annotated[TenantContext, Depends(reader_tenant)]) -> DatasetService:
    """The service for a caller allowed to read."""
    return DatasetService(ctx.handle.shoal, ctx.handle.searcher, _cache(request, ctx))


def write_service(request: Request, ctx: Annotated[TenantContext, Depends(writer_tenant)]) -> DatasetService:
    """The service for a caller allowed to write."""
    return DatasetService(ctx.handle.shoal, ctx.handle.searcher, _cache(request, ctx))


Reader = Annotated[DatasetService, Depends(read_service)]
Writer = Annotated[DatasetService, Depends(write_service)]


def install(app: FastAPI) -> None:
    """Add the dataset routes to the app (their error handling travels with them: nothing else to register)."""
    app.include_router(router)


# -- routes ------------------------------------------------------------------------------------------------


@router.post("/datasets", status_code=201, response_model=DatasetOut)
def create_dataset(body: Annotated[CreateDatasetRequest, Body()], svc: Writer) -> dict[str, Any]:
    """Create a dataset: a data source and its default index under one name (`overwrite` replaces one)."""
    return svc.create(
        body.name, body.dimensions, metric_type=body.metric_type, index_type=body.index_type,
        description=body.description, metadata=body.metadata, index_params=body.index_params,
        overwrite=body.overwrite,
    )


@router.get("/datasets", response_model=DatasetListOut)
def list_datasets(
    svc: Reader,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> dict[str, Any]:
    """A page of the tenant's datasets, by name."""
    return svc.list(limit, offset)


@router.get("/datasets/{dataset_id}", response_model=DatasetOut)
def get_dataset(dataset_id: str, svc: Reader) -> dict[str, Any]:
    """One dataset."""
    return svc.get(dataset_id)


@router.put("/datasets/{dataset_id}", response_model=DatasetOut)
def update_dataset(dataset_id: str, body: Annotated[UpdateDatasetRequest, Body()], svc: Writer) -> dict[str, Any]:
    """Change the description and/or metadata; anything else is INVALID_DATASET_CONFIG."""
    changes = {k: getattr(body, k) for k in body.model_fields_set if k in UpdateDatasetRequest.model_fields}
    changes.update(body.model_extra or {})
    return svc.update(dataset_id, changes)


@router.delete("/datasets/{dataset_id}", response_model=DeleteOut)
def delete_dataset(dataset_id: str, svc: Writer, hard: Annotated[bool, Query()] = False) -> dict[str, Any]:
    """Move the dataset to the trash (restorable until `purge_after`, SHOAL_TRASH_RETENTION_DAYS after now);
    `?hard=true` deletes it and its files at once."""
    return svc.delete(dataset_id, hard=hard)


@router.get("/trash", response_model=TrashListOut)
def list_trash(
    svc: Reader,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> dict[str, Any]:
    """The tenant's datasets in the trash, most recently deleted first, each with its `purge_after`."""
    return svc.trash(limit, offset)


@router.post("/trash/{dataset_id}/restore", response_model=DatasetOut)
def restore_dataset(
    dataset_id: str, svc: Writer, trash_id: Annotated[int | None, Query(ge=0)] = None
) -> dict[str, Any]:
    """Take a dataset out of the trash (the most recently deleted of that name, or the one `trash_id` names);
    409 DATASET_ALREADY_EXISTS if a dataset took the name meanwhile."""
    return svc.restore(dataset_id, trash_id)


@router.delete("/trash/{dataset_id}", response_model=PurgeOut)
def purge_dataset(
    dataset_id: str, svc: Writer, trash_id: Annotated[int | None, Query(ge=0)] = None
) -> dict[str, Any]:
    """Delete for good, now, a dataset in the trash (the most recently deleted of that name, or `trash_id`)."""
    return svc.purge(dataset_id, trash_id)


@router.get("/datasets/{dataset_id}/stats", response_model=StatsOut)
def dataset_stats(dataset_id: str, svc: Reader) -> dict[str, Any]:
    """Exact live vector count, storage bytes, metadata stats and index freshness per shard."""
    return svc.stats(dataset_id)


class ReindexRequest(BaseModel):
    index_type: str | None = None
    index_params: dict[str, Any] | None = None


@router.post("/datasets/{dataset_id}/reindex", status_code=202)
def reindex_dataset(
    dataset_id: str, svc: Writer, body: Annotated[ReindexRequest | None, Body()] = None, run_async: Annotated[
        bool, Query(alias="async", description="true (default): a worker runs it, answer at once with the job")
    ] = True,
) -> dict[str, Any]:
    """Rebuild the dataset's index aside and swap it in (optionally with another index_type or params);
    the job's progress shows in `GET /api/v1/indexes/{dataset_id}/1/reindex`."""
    body = body or ReindexRequest()
    return svc.reindex(dataset_id, body.index_type, body.index_params, wait=not run_async)


@router.post("/datasets/{dataset_id}/vectors", response_model=UpsertOut)
def upsert_vectors(dataset_id: str, body: Annotated[UpsertRequest, Body()], svc: Writer) -> dict[str, Any]:
    """Upsert vectors, all or nothing; answers once they are durable, with the batch's write token."""
    return svc.upsert(dataset_id, [v.model_dump() for v in body.vectors])


@router.post("/datasets/{dataset_id}/search", response_model=SearchOut)
def search_dataset(dataset_id: str, body: Annotated[SearchRequest, Body()], svc: Reader) -> dict[str, Any]:
    """The `top_k` nearest vectors of one dataset."""
    return svc.search(dataset_id, body.vector, body.top_k, consistency=body.consistency,
                      min_write_token=body.min_write_token)


@router.post("/search/multi-dataset", response_model=MultiSearchOut)
def search_datasets(body: Annotated[MultiSearchRequest, Body()], svc: Reader) -> dict[str, Any]:
    """One query over several datasets, merged by `interleave`, `score` or `round_robin`."""
    return svc.multi_search(body.dataset_ids, body.vector, body.top_k, merge_strategy=body.merge_strategy,
                            consistency=body.consistency)
