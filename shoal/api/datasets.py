"""The dataset API (DeepLake-style) under `/api/v1`, scoped to the caller's tenant.

A thin adapter over `shoal.datasets.service`: each route passes the request's values to the service and
renders the typed result it answers with (the bodies are `shoal.api.dataset_models`).

Errors on these routes, and only these, take the shape `{"success": false, "error_code", "message", "details"}`:
the routes use `DatasetRoute`, which turns every exception raised while serving one of them (request
validation, the tenant dependency, the service) into that shape through the one error map
(`shoal.api.errors.dataset_response`), so the app's Vektonn-shaped handlers never see them. An exception type
the app has its own handler for (other than the Shoal errors) is passed on.

Wire it with `install(app)`. The semantics (schema, names, counts, cache, merge orders) are documented in
`shoal.datasets`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from shoal.api.dataset_models import (
    CreateDatasetRequest,
    DatasetListOut,
    DatasetOut,
    DeleteOut,
    ErrorOut,
    MultiSearchOptions,
    MultiSearchOut,
    MultiSearchRequest,
    PurgeOut,
    ReindexRequest,
    SearchOut,
    SearchRequest,
    StatsOut,
    TrashListOut,
    UpdateDatasetRequest,
    UpsertOut,
    UpsertRequest,
)
from shoal.api.errors import dataset_response
from shoal.api.security import (
    TenantContext,
    admin_tenant,
    context_from_cache,
    deleter_tenant,
    reader_tenant,
    require_admin,
    writer_tenant,
)
from shoal.api.time_travel import AS_OF_HEADER, TAG_HEADER, TimeTravel, sent, time_travel
from shoal.auth import Role
from shoal.client import ShardStatus
from shoal.datasets.cache import DatasetCache
from shoal.datasets.errors import DatasetError, ErrorCode
from shoal.datasets.files import iso_utc
from shoal.datasets.results import (
    Dataset,
    DatasetStats,
    Deletion,
    Match,
    MetadataStats,
    MultiSearchResults,
    Page,
    Purge,
    ReindexStarted,
    SearchResults,
    TrashEntry,
)
from shoal.datasets.service import DatasetService
from shoal.errors import QueryError, ValidationError


class DatasetRoute(APIRoute):
    """A route whose failures answer in the dataset API's error shape (scoped to the routes using it)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                await _note_caller(request)
                return await handler(request)
            except Exception as exc:  # noqa: BLE001 - every failure becomes an error response
                response = dataset_response(request, _body_error(exc))
                if response is None:
                    raise
                return response

        return handle


async def _note_caller(request: Request) -> None:
    """Authenticate the caller first and record its tenant, so that every error of the request after that (a
    role too low, a body that does not parse or validate) carries it in `details.tenant_id`: FastAPI parses the
    body before it resolves the route's dependencies. A key that fails raises here, as the dependency would
    have; the dependency then finds the key's verdict cached."""
    tenants = request.app.state.tenants
    # Role.READ is every caller's: this checks no role (the route's dependency does).
    ctx = context_from_cache(tenants, request.headers.get("Authorization"), Role.READ)
    if ctx is None:
        ctx = await run_in_threadpool(reader_tenant, request)  # hashing a key or querying the catalog blocks
    request.state.dataset_tenant = ctx.tenant


def _body_error(exc: Exception) -> Exception:
    """`exc`, or VALIDATION_ERROR with `field: "body"` when a body is no JSON FastAPI can read: malformed (its
    `json_invalid` validation error), an integer of more than 4300 digits, nesting past the decoder's limit,
    bytes that are no UTF-8 (a 400 of FastAPI's, not an error code of the dataset API's)."""
    if isinstance(exc, RequestValidationError):
        invalid = next((e for e in exc.errors() if e.get("type") == "json_invalid"), None)
        if invalid is None:
            return exc
        # FastAPI's loc is ("body", position): say where, as the decoder does, rather than "body.1".
        loc = invalid.get("loc", ())
        where = f" at position {loc[1]}" if len(loc) == 2 and isinstance(loc[1], int) else ""
        reason = str((invalid.get("ctx") or {}).get("error") or invalid.get("msg", "JSON decode error"))[:200]
        return DatasetError(ErrorCode.VALIDATION_ERROR,
                            f"invalid request: the body could not be parsed: {reason}{where}", {"field": "body"})
    if not isinstance(exc, StarletteHTTPException) or exc.status_code != 400:
        return exc
    cause = exc.__cause__
    reason = str(cause).split(";")[0][:200] if cause is not None else str(exc.detail)
    return DatasetError(ErrorCode.VALIDATION_ERROR, f"invalid request: the body could not be parsed: {reason}",
                        {"field": "body"})


# -- rendering the service's results -------------------------------------------------------------------------


def dataset_json(d: Dataset) -> dict[str, Any]:
    """A dataset object (its id is its name; timestamps as the catalog holds them, to the microsecond)."""
    return {
        "id": d.name,
        "name": d.name,
        "description": d.description,
        "dimensions": d.dimensions,
        "metric_type": d.metric_type,
        "index_type": d.index_type,
        "metadata": d.metadata,
        "created_at": d.created_at.isoformat(timespec="microseconds"),
        "updated_at": d.updated_at.isoformat(timespec="microseconds"),
        "vector_count": d.vector_count,
        "storage_size": d.storage_size,
        "tenant_id": d.tenant_id,
        "storage_location": d.storage_location,
    }


def _page_json(page: Page[Any], render: Callable[[Any], dict[str, Any]], tenant_id: str) -> dict[str, Any]:
    return {"datasets": [render(item) for item in page.items], "total": page.total, "limit": page.limit,
            "offset": page.offset, "has_more": page.offset + len(page.items) < page.total, "tenant_id": tenant_id}


def _trash_entry_json(e: TrashEntry) -> dict[str, Any]:
    return {**dataset_json(e.dataset), "trash_id": e.trash_id, "deleted_at": iso_utc(e.deleted_at),
            "purge_after": iso_utc(e.purge_after)}


def _deletion_json(d: Deletion) -> dict[str, Any]:
    return {"success": True, "message": d.message, "dataset_id": d.dataset_id, "deleted": True,
            "deleted_at": iso_utc(d.deleted_at), "soft": d.soft, "files_deleted": d.files_deleted,
            "trash_id": d.trash_id, "purge_after": iso_utc(d.purge_after) if d.purge_after is not None else None}


def _purge_json(p: Purge) -> dict[str, Any]:
    return {"success": True, "dataset_id": p.dataset_id, "trash_id": p.trash_id, "purged": True,
            "files_deleted": p.files_deleted}


def _shard_json(s: ShardStatus) -> dict[str, Any]:
    return {
        "shard": s.shard,
        "head": s.head,
        "built_watermark": s.built_watermark,
        "served_watermark": s.served_watermark,
        "lag_seqs": s.lag_seqs,
        "built_lag_seqs": s.built_lag_seqs,
        "lag_seconds": s.lag_seconds,
        "segments": s.segments,
        "version_id": s.version_id,
    }


def _metadata_stats_json(m: MetadataStats) -> dict[str, Any]:
    out = asdict(m)
    # Counts by language and content type appear when some vector's metadata has the key.
    for key in ("languages", "content_types"):
        if not out[key]:
            del out[key]
    return out


def _stats_json(s: DatasetStats) -> dict[str, Any]:
    return {
        "dataset_id": s.dataset_id,
        "tenant_id": s.dataset.tenant_id,
        "vector_count": s.vector_count,
        "storage_size": s.storage_size,
        "unique_documents": s.metadata.distinct_document_ids,
        "parameters": s.index.index_params,
        "memory_usage_bytes": s.build.memory_usage_bytes,
        "build_time_seconds": s.build.build_time_seconds,
        "last_rebuild_at": iso_utc(s.build.last_rebuild_at) if s.build.last_rebuild_at is not None else None,
        "storage": asdict(s.storage),
        "metadata_stats": _metadata_stats_json(s.metadata),
        "index_stats": {
            "index_type": s.index.index_type,
            "metric_type": s.index.metric_type,
            "index_params": s.index.index_params,
            "shards": [_shard_json(x) for x in s.index.shards],
        },
        "dataset": dataset_json(s.dataset),
    }


def _match_json(m: Match) -> dict[str, Any]:
    return {"id": m.id, "score": m.score, "content": m.content, "metadata": m.metadata,
            "document_id": m.document_id}


def _search_json(r: SearchResults) -> dict[str, Any]:
    return {"dataset_id": r.dataset_id, "metric_type": r.metric_type, "higher_is_better": r.higher_is_better,
            "consistency": r.consistency, "results": [_match_json(m) for m in r.matches]}


def _multi_search_json(r: MultiSearchResults) -> dict[str, Any]:
    return {
        "merge_strategy": r.merge_strategy,
        "dataset_ids": list(r.dataset_ids),
        "top_k": r.top_k,
        "consistency": r.consistency,
        "results": [{"dataset_id": m.dataset_id, "rank": m.rank, **_match_json(m.match)} for m in r.matches],
    }


def _reindex_json(r: ReindexStarted) -> dict[str, Any]:
    job = r.job
    return {"dataset_id": r.dataset_id, "job": job.id, "state": job.state, "progress": job.progress,
            "recall": job.recall, "gate": job.gate, "error": job.error, "definition": job.definition}


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


def _service(request: Request, ctx: TenantContext) -> DatasetService:
    # The caller's tenant, for the `tenant_id` every error of these routes carries (shoal.api.errors).
    request.state.dataset_tenant = ctx.tenant
    return DatasetService(ctx.handle.shoal, ctx.handle.searcher, _cache(request, ctx))


def read_service(request: Request, ctx: Annotated[TenantContext, Depends(reader_tenant)]) -> DatasetService:
    """The service for a caller allowed to read."""
    return _service(request, ctx)


def write_service(request: Request, ctx: Annotated[TenantContext, Depends(writer_tenant)]) -> DatasetService:
    """The service for a caller allowed to write."""
    return _service(request, ctx)


def delete_service(request: Request, ctx: Annotated[TenantContext, Depends(deleter_tenant)]) -> DatasetService:
    """The service for a caller allowed to delete (a write key; never a keyless caller)."""
    return _service(request, ctx)


def admin_service(request: Request, ctx: Annotated[TenantContext, Depends(admin_tenant)]) -> DatasetService:
    """The service for a caller allowed to delete for good (an admin key)."""
    return _service(request, ctx)


Reader = Annotated[DatasetService, Depends(read_service)]
Writer = Annotated[DatasetService, Depends(write_service)]
Deleter = Annotated[DatasetService, Depends(delete_service)]
Admin = Annotated[DatasetService, Depends(admin_service)]
# The same context the service was made from (FastAPI resolves a dependency once per request).
WriterContext = Annotated[TenantContext, Depends(writer_tenant)]
DeleterContext = Annotated[TenantContext, Depends(deleter_tenant)]


def install(app: FastAPI) -> None:
    """Add the dataset routes to the app (their error handling travels with them: nothing else to register)."""
    app.include_router(router)


# -- routes ------------------------------------------------------------------------------------------------


@router.post("/datasets", status_code=201, response_model=DatasetOut)
def create_dataset(body: Annotated[CreateDatasetRequest, Body()], svc: Writer, ctx: WriterContext) -> dict[str, Any]:
    """Create a dataset: a data source and its default index under one name (`overwrite`, with an admin key,
    replaces one)."""
    if body.overwrite:
        require_admin(ctx, "overwrite (it deletes the dataset it replaces at once, without the trash)")
    return dataset_json(svc.create(
        body.name, body.dimensions, metric_type=body.metric_type, index_type=body.index_type,
        description=body.description, metadata=body.metadata, index_params=body.index_params,
        index_config=body.index_config, overwrite=body.overwrite,
    ))


@router.get("/datasets", response_model=DatasetListOut)
def list_datasets(
    svc: Reader,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> dict[str, Any]:
    """A page of the tenant's datasets, by name."""
    return _page_json(svc.list(limit, offset), dataset_json, svc.tenant)


@router.get("/datasets/{dataset_id}", response_model=DatasetOut)
def get_dataset(dataset_id: str, svc: Reader) -> dict[str, Any]:
    """One dataset."""
    return dataset_json(svc.get(dataset_id))


@router.put("/datasets/{dataset_id}", response_model=DatasetOut)
def update_dataset(dataset_id: str, body: Annotated[UpdateDatasetRequest, Body()], svc: Writer) -> dict[str, Any]:
    """Change the description and/or metadata; anything else is INVALID_DATASET_CONFIG."""
    changes = {k: getattr(body, k) for k in body.model_fields_set if k in UpdateDatasetRequest.model_fields}
    changes.update(body.model_extra or {})
    return dataset_json(svc.update(dataset_id, changes))


@router.delete("/datasets/{dataset_id}", response_model=DeleteOut)
def delete_dataset(
    dataset_id: str, svc: Deleter, ctx: DeleterContext, hard: Annotated[bool, Query()] = False
) -> dict[str, Any]:
    """Move the dataset to the trash (restorable until `purge_after`, SHOAL_TRASH_RETENTION_DAYS after now);
    `?hard=true` (an admin key) deletes it and its files at once."""
    if hard:
        require_admin(ctx, "a hard delete (?hard=true)")
    return _deletion_json(svc.delete(dataset_id, hard=hard))


@router.get("/trash", response_model=TrashListOut)
def list_trash(
    svc: Reader,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> dict[str, Any]:
    """The tenant's datasets in the trash, most recently deleted first, each with its `purge_after`."""
    return _page_json(svc.trash(limit, offset), _trash_entry_json, svc.tenant)


@router.post("/trash/{dataset_id}/restore", response_model=DatasetOut)
def restore_dataset(
    dataset_id: str, svc: Writer, trash_id: Annotated[int | None, Query(ge=0)] = None
) -> dict[str, Any]:
    """Take a dataset out of the trash (the most recently deleted of that name, or the one `trash_id` names);
    409 DATASET_ALREADY_EXISTS if a dataset took the name meanwhile."""
    return dataset_json(svc.restore(dataset_id, trash_id))


@router.delete("/trash/{dataset_id}", response_model=PurgeOut)
def purge_dataset(
    dataset_id: str, svc: Admin, trash_id: Annotated[int | None, Query(ge=0)] = None
) -> dict[str, Any]:
    """Delete for good, now, a dataset in the trash (the most recently deleted of that name, or `trash_id`);
    an admin key only."""
    return _purge_json(svc.purge(dataset_id, trash_id))


@router.get("/datasets/{dataset_id}/stats", response_model=StatsOut)
def dataset_stats(dataset_id: str, svc: Reader) -> dict[str, Any]:
    """Exact live vector count, storage bytes, metadata stats and index freshness per shard."""
    return _stats_json(svc.stats(dataset_id))


@router.post("/datasets/{dataset_id}/reindex", status_code=202)
def reindex_dataset(
    dataset_id: str, svc: Writer, body: Annotated[ReindexRequest | None, Body()] = None, run_async: Annotated[
        bool | None,
        Query(alias="async", description="true (default): a worker runs it, answer at once with the job"),
    ] = None,
) -> dict[str, Any]:
    """Rebuild the dataset's index aside and swap it in (optionally with another index type or params: the
    body's `index_config`, or `index_type` and `index_params`); `async` in the body or the query (true by
    default; both given must agree). The job's progress shows in `GET /api/v1/indexes/{dataset_id}/1/reindex`."""
    body = body or ReindexRequest()
    if body.run_async is not None and run_async is not None and body.run_async != run_async:
        raise DatasetError(ErrorCode.VALIDATION_ERROR, "async is given in the body and the query, differently",
                           {"field": "async"})
    wait = not next((a for a in (body.run_async, run_async) if a is not None), True)
    return _reindex_json(svc.reindex(dataset_id, body.index_type, body.index_params,
                                     index_config=body.index_config, wait=wait))


@router.post("/datasets/{dataset_id}/vectors", response_model=UpsertOut)
def upsert_vectors(
    dataset_id: str, body: Annotated[UpsertRequest, Body()], svc: Writer, request: Request
) -> dict[str, Any]:
    """Upsert vectors, all or nothing; answers once they are durable, with the batch's write token."""
    upserted = svc.upsert(dataset_id, [v.model_dump() for v in body.vectors])
    request.app.state.metrics.uploaded.labels(request.state.dataset_tenant).inc(upserted.inserted)
    return asdict(upserted)


@router.post("/datasets/{dataset_id}/search", response_model=SearchOut)
def search_dataset(
    dataset_id: str, body: Annotated[SearchRequest, Body()], svc: Reader, request: Request
) -> dict[str, Any]:
    """The `top_k` nearest vectors of one dataset; `X-Shoal-Tag` or `X-Shoal-As-Of` search the state its index
    had at that tag or seq (time travel), as the Vektonn search of the dataset's index does."""
    travel = _time_travel(request)
    with request.app.state.metrics.search_timer(request.state.dataset_tenant), _fields_as_headers():
        return _search_json(svc.search(dataset_id, body.vector, body.top_k, consistency=body.consistency,
                                       min_write_token=body.min_write_token, filters=body.filters,
                                       tag=travel.tag, as_of=travel.as_of))


# The service's time-travel parameters, as the headers that carry them over HTTP.
TRAVEL_FIELDS = {"tag": TAG_HEADER, "as_of": AS_OF_HEADER}


def _time_travel(request: Request) -> TimeTravel:
    """The older state the search's headers ask for (`shoal.api.time_travel`, as the Vektonn routes read them);
    a header that is malformed, or both sent, is VALIDATION_ERROR naming the headers sent."""
    try:
        return time_travel(request.headers)
    except ValidationError as exc:
        raise DatasetError(ErrorCode.VALIDATION_ERROR, str(QueryError.of(exc)),
                           {"field": ", ".join(sent(request.headers))}) from None


@contextmanager
def _fields_as_headers() -> Iterator[None]:
    """Errors raised inside name the time-travel headers as their `field`, not the service's parameters."""
    try:
        yield
    except DatasetError as exc:
        field = exc.details.get("field")
        if isinstance(field, str) and field in TRAVEL_FIELDS:
            exc.details["field"] = TRAVEL_FIELDS[field]
        raise


def _no_time_travel(request: Request) -> None:
    """Refuse (VALIDATION_ERROR naming it) a time-travel header on a search over several datasets: a tag or a
    seq belongs to one dataset's index or log, and would mean nothing (or another state) in the others."""
    headers = sent(request.headers)
    if headers:
        named = ", ".join(headers)
        raise DatasetError(
            ErrorCode.VALIDATION_ERROR,
            f"header {named}: multi-dataset search takes no time travel (a tag or a seq belongs to one dataset); "
            "search each dataset with POST /api/v1/datasets/{dataset_id}/search and the header",
            {"field": named},
        )


def _one_of(field: str, specified: Any, older: str, older_value: Any, default: Any = None) -> Any:
    """The value given in the specified form or in the older one (refused when both are given)."""
    if specified is not None and older_value is not None:
        raise DatasetError(ErrorCode.VALIDATION_ERROR, f"give {field} or {older}, not both", {"field": field})
    value = specified if specified is not None else older_value
    return default if value is None else value


@router.post("/search/multi-dataset", response_model=MultiSearchOut)
def search_datasets(body: Annotated[MultiSearchRequest, Body()], svc: Reader, request: Request) -> dict[str, Any]:
    """One query over several datasets (by name), merged by `interleave`, `score` or `round_robin`: the
    specified body `{query_vector, datasets, options: {top_k, merge_strategy, consistency}}` or the older
    `{vector, dataset_ids, top_k, merge_strategy, consistency}`. `options.filters` filters every dataset searched."""
    _no_time_travel(request)
    options = body.options or MultiSearchOptions()
    vector = _one_of("query_vector", body.query_vector, "vector", body.vector)
    names = _one_of("datasets", body.datasets, "dataset_ids", body.dataset_ids)
    if vector is None or names is None:
        missing = "query_vector" if vector is None else "datasets"
        raise DatasetError(ErrorCode.VALIDATION_ERROR, f"{missing} is required", {"field": missing})
    with request.app.state.metrics.search_timer(request.state.dataset_tenant):
        return _multi_search_json(svc.multi_search(
            names, vector, _one_of("options.top_k", options.top_k, "top_k", body.top_k, 10),
            merge_strategy=_one_of("options.merge_strategy", options.merge_strategy, "merge_strategy",
                                   body.merge_strategy, "interleave"),
            consistency=_one_of("options.consistency", options.consistency, "consistency", body.consistency),
            filters=options.filters,
        ))
