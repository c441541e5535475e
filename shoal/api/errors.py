"""The one error map: what every core error (`shoal.errors`) answers over HTTP, in both shapes the API speaks.

- Vektonn's shape `{"errorMessages": [...]}` answers on every route but the dataset API's; `install` registers
  it as the app's exception handlers.
- The dataset API's shape `{"success": false, "error_code", "message", "details"}` answers on the dataset
  routes only; their route class calls `dataset_response` for every exception they raise.

Both read the status of a core error from `CORE` (the nearest class in the error's MRO), so one error never
answers with two statuses; the dataset API's codes and their statuses are `DATASET_STATUS`. A catalog that
cannot be reached (the driver's connection errors, raised anywhere, or a commit that gave up on them) answers
as CatalogUnavailableError in both shapes: 503 with Retry-After, and no driver message, host or socket path. A
storage that cannot be reached (StorageUnavailableError, or a commit that gave up on it) answers the same way, as
StorageUnavailableError with its PUBLIC message (the reason, which may name the S3 endpoint, goes to the log).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sqlalchemy.exc import DBAPIError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

from shoal.catalog.db import catalog_unreachable
from shoal.datasets.errors import ErrorCode, action_of
from shoal.errors import (
    AlreadyExistsError,
    AuthenticationError,
    BackpressureError,
    CapacityError,
    CatalogUnavailableError,
    CommitError,
    ConfigurationError,
    ConflictError,
    CorruptArtifactError,
    CorruptSegmentError,
    DatasetError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitedError,
    ReindexConflictError,
    ShardsUnavailableError,
    ShoalError,
    StateUnknownError,
    StorageUnavailableError,
    ValidationError,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Answer:
    """How a core error answers: its HTTP status, and its `error_code` in the dataset API (None: not part of
    that API's contract, so a dataset route answers it as an unexpected 500 INTERNAL_ERROR, logged)."""

    status: int
    code: ErrorCode | None


CORE: dict[type[ShoalError], Answer] = {
    ValidationError: Answer(400, ErrorCode.VALIDATION_ERROR),
    AuthenticationError: Answer(401, ErrorCode.UNAUTHORIZED),
    PermissionDeniedError: Answer(403, ErrorCode.FORBIDDEN),
    NotFoundError: Answer(404, ErrorCode.DATASET_NOT_FOUND),
    AlreadyExistsError: Answer(409, ErrorCode.DATASET_ALREADY_EXISTS),
    ReindexConflictError: Answer(409, None),  # the dataset service raises REINDEX_CONFLICT itself
    ConflictError: Answer(409, None),  # lost a race (a lease, a swap): reload and retry (dataset routes: 503)
    # A dataset upload checks the lag as a Vektonn one does: the dataset API's 429 code, not an internal error.
    BackpressureError: Answer(429, ErrorCode.TOO_MANY_REQUESTS),
    RateLimitedError: Answer(429, ErrorCode.TOO_MANY_REQUESTS),
    ConfigurationError: Answer(503, ErrorCode.SERVICE_UNAVAILABLE),
    CatalogUnavailableError: Answer(503, ErrorCode.SERVICE_UNAVAILABLE),
    StorageUnavailableError: Answer(503, ErrorCode.SERVICE_UNAVAILABLE),
    # The catalog went away during a commit: it may have landed; the message says to retry with the batch id.
    StateUnknownError: Answer(503, ErrorCode.SERVICE_UNAVAILABLE),
    CapacityError: Answer(503, ErrorCode.SERVICE_UNAVAILABLE),
    ShardsUnavailableError: Answer(503, ErrorCode.SERVICE_UNAVAILABLE),
    ShoalError: Answer(500, None),
}

DATASET_STATUS: dict[ErrorCode, int] = {
    ErrorCode.DATASET_NOT_FOUND: 404,
    ErrorCode.DATASET_ALREADY_EXISTS: 409,
    ErrorCode.INVALID_DATASET_CONFIG: 400,
    ErrorCode.INVALID_DATASET_NAME: 400,
    ErrorCode.RESERVED_DATASET_NAME: 400,
    ErrorCode.INVALID_DIMENSIONS: 400,
    ErrorCode.VALIDATION_ERROR: 400,
    ErrorCode.NOT_IMPLEMENTED: 501,
    ErrorCode.REINDEX_CONFLICT: 409,
    ErrorCode.QUOTA_EXCEEDED: 403,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.TOO_MANY_REQUESTS: 429,
    ErrorCode.SERVICE_UNAVAILABLE: 503,
    ErrorCode.INTERNAL_ERROR: 500,
}

# A request body field whose type check fails gets the dataset code of the rule it belongs to.
FIELD_CODES = {
    "name": ErrorCode.INVALID_DATASET_NAME,
    "dimensions": ErrorCode.INVALID_DIMENSIONS,
    "metric_type": ErrorCode.INVALID_DATASET_CONFIG,
    "index_type": ErrorCode.INVALID_DATASET_CONFIG,
    "index_params": ErrorCode.INVALID_DATASET_CONFIG,
    "index_config": ErrorCode.INVALID_DATASET_CONFIG,
    "description": ErrorCode.INVALID_DATASET_CONFIG,
    "metadata": ErrorCode.INVALID_DATASET_CONFIG,
}
# Starlette's own HTTP errors (no route, wrong method, ...) in the dataset API's shape.
HTTP_CODES = {401: "UNAUTHORIZED", 403: "FORBIDDEN", 404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED",
              413: "PAYLOAD_TOO_LARGE", 429: "TOO_MANY_REQUESTS"}
# The tag of the dataset API's routes (shoal.api.datasets' router): a route carrying it answers in that API's shape.
DATASET_TAG = "datasets"


def _storage_outage(exc: BaseException | None) -> StorageUnavailableError | None:
    """The StorageUnavailableError that `exc` is, or was raised from (a commit that gave up on it); else None."""
    for _ in range(8):  # a short cause chain; never a loop
        if exc is None or isinstance(exc, StorageUnavailableError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def core_error(exc: BaseException) -> BaseException:
    """`exc` as the core error it stands for: a catalog outage (the driver's error itself, or a commit that
    gave up because of it) becomes CatalogUnavailableError, and a storage outage StorageUnavailableError with
    its public message, each logged here with its cause; anything else is returned as it is."""
    if isinstance(exc, StorageUnavailableError) or (
        isinstance(exc, CommitError) and not isinstance(exc, StateUnknownError)
    ):
        storage = _storage_outage(exc)
        if storage is not None:
            if str(storage) != StorageUnavailableError.PUBLIC:  # not answered yet: its reason goes to the log
                log.warning("the storage is unavailable: %s", storage)
            return StorageUnavailableError()
    # Of Shoal's own errors only a CommitError hides the driver's (its message quotes it); StateUnknownError
    # says what to do and answers 503 as it is.
    if isinstance(exc, ShoalError) and (not isinstance(exc, CommitError) or isinstance(exc, StateUnknownError)):
        return exc
    if not catalog_unreachable(exc):
        return exc
    log.warning("the catalog is unavailable: %s", exc)  # the reason (it may name hosts) goes to the log only
    return CatalogUnavailableError()


def answer(exc: ShoalError) -> Answer:
    """The status and dataset code of a core error."""
    if isinstance(exc, DatasetError):
        try:
            code = ErrorCode(exc.code)
        except ValueError:  # a code no one gave a status: a bug, answered as one
            return CORE[ShoalError]
        return Answer(DATASET_STATUS[code], code)
    for cls in type(exc).__mro__:
        if cls in CORE:
            return CORE[cls]  # type: ignore[index]
    return CORE[ShoalError]


def extra_headers(exc: ShoalError) -> dict[str, str]:
    """Headers a core error answers with in either shape (what a client needs to act on it)."""
    if isinstance(exc, AuthenticationError):
        return {"WWW-Authenticate": "ApiKey"}
    if isinstance(exc, (BackpressureError, CatalogUnavailableError, RateLimitedError, StorageUnavailableError)):
        return {"Retry-After": str(exc.retry_after)}
    if isinstance(exc, StateUnknownError):
        return {"Retry-After": str(CatalogUnavailableError().retry_after)}
    if isinstance(exc, ShardsUnavailableError):
        missing = {"X-Shoal-Missing-Shards": ",".join(map(str, exc.shards))}
        # Nodes that did not answer now (one restarting): worth a retry, as the dataset API's hint for the code
        # says; shards this process is not placed to serve stay so until the placement changes: no Retry-After.
        return missing if exc.retry_after is None else missing | {"Retry-After": str(exc.retry_after)}
    return {}


class ErrorJSON(JSONResponse):
    """An error body that always encodes. A message may quote the caller's text, which can hold a lone
    surrogate (JSON escapes one as \\ud800; UTF-8 cannot encode it): such a body is sent with non-ASCII escaped,
    where the plain rendering raised and turned a 400 into a 500."""

    def render(self, content: Any) -> bytes:
        """The body as UTF-8 JSON, or as ASCII JSON (every non-ASCII character escaped) when UTF-8 cannot
        encode it."""
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


# -- Vektonn's shape -----------------------------------------------------------------------------------------


def _vektonn(status: int, messages: list[str], headers: dict[str, str] | None = None) -> JSONResponse:
    response = ErrorJSON(status_code=status, content={"errorMessages": messages})
    for name, value in (headers or {}).items():  # after the body's headers, as clients have always seen them
        response.headers[name] = value
    return response


def vektonn_error(status: int, messages: list[str]) -> JSONResponse:
    """An error in Vektonn's shape that no core error stands for (a body over the limit, answered before
    routing)."""
    return _vektonn(status, messages)


def vektonn_response(exc: ShoalError) -> JSONResponse:
    """A core error in Vektonn's shape: its status, one message per validation problem (else one message)."""
    status = answer(exc).status
    if isinstance(exc, CorruptSegmentError | CorruptArtifactError):
        # A file the catalog names gone missing or damaged: logged in full, answered naming nothing internal (its
        # storage path, an object key), as the dataset API answers it.
        log.error("internal error answered %d: %s", status, exc)
        return _vektonn(status, ["internal error"], extra_headers(exc))
    if isinstance(exc, ValidationError):
        messages = [f"{exc.prefix}: {p}" for p in exc.problems]
    else:
        messages = [str(exc)]
    return _vektonn(status, messages, extra_headers(exc))


def vektonn_request_error(exc: RequestValidationError) -> JSONResponse:
    """A request FastAPI could not parse, in Vektonn's shape (400, one message per problem)."""
    messages = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        messages.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return _vektonn(400, messages or ["invalid request"])


async def _on_core_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ShoalError)
    core = core_error(exc)
    assert isinstance(core, ShoalError)
    return vektonn_response(core)


async def _on_driver_error(request: Request, exc: Exception) -> JSONResponse:
    core = core_error(exc)
    if isinstance(core, ShoalError):
        return vektonn_response(core)
    # Not an outage (a bug, a constraint nobody expected): a 500 that names nothing of the driver's.
    log.error("unexpected catalog error on %s %s", request.method, request.url.path, exc_info=exc)
    return _vektonn(500, ["internal error"])


async def _on_request_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return vektonn_request_error(exc)


def vektonn_http_error(exc: StarletteHTTPException) -> Response:
    """An HTTP error of Starlette's or FastAPI's own (no such route, a method the route lacks, a body that is
    no JSON it can read) in Vektonn's shape, with its status and headers (`Allow` on a 405): Vektonn's client
    reads `errorMessages` from any error, and fails on `{"detail": ...}` ("Failed to parse json")."""
    headers = dict(exc.headers or {})
    if exc.status_code < 200 or exc.status_code in (204, 205, 304):  # a status that carries no body
        return Response(status_code=exc.status_code, headers=headers)
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 400 and exc.__cause__ is not None:
        # FastAPI's "There was an error parsing the body": say why (not UTF-8, an integer of more than 4300
        # digits, nesting past the decoder's limit), as the dataset routes do.
        message = f"invalid request: the body could not be parsed: {str(exc.__cause__).split(';')[0][:200]}"
    return _vektonn(exc.status_code, [message], headers)


def _dataset_route(route: BaseRoute | None) -> bool:
    return DATASET_TAG in (getattr(route, "tags", None) or ())


# Paths only the dataset API serves: one of them that no route matches (a 404 with no route) answers in its shape.
_DATASET_PATHS = ("/api/v1/datasets", "/api/v1/trash", "/api/v1/search/multi-dataset")


def _dataset_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in _DATASET_PATHS)


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def _allowed_methods(request: Request) -> str | None:
    """Every method some route of the app serves at this request's path, for a 405's `Allow`: Starlette names
    only the first route that matched the path, while one path is often served by several (GET and POST)."""
    routes = request.app.router.routes
    # A route (or an included router) matches FULL only for a method it serves at this path.
    allowed = [m for m in _METHODS if any(r.matches({**request.scope, "method": m})[0] is Match.FULL for r in routes)]
    return ", ".join(allowed) or None


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 405:
        allowed = _allowed_methods(request)
        if allowed is not None:
            exc = StarletteHTTPException(405, exc.detail, {**dict(exc.headers or {}), "Allow": allowed})
    # The route the path matched (fully, or but for the method: a 405), when one did; Starlette records it.
    route = request.scope.get("route")
    if route is None and exc.status_code == 404 and _dataset_path(request.url.path):
        exc = StarletteHTTPException(404, f"no route matches {request.method} {request.url.path}", exc.headers)
        return dataset_response(request, exc) or vektonn_http_error(exc)
    if _dataset_route(route):
        response = dataset_response(request, exc)
        if response is not None:
            return response
    if route is None and exc.status_code == 404:  # no route: say which request found none
        exc = StarletteHTTPException(404, f"no route matches {request.method} {request.url.path}", exc.headers)
    return vektonn_http_error(exc)


def install(app: FastAPI) -> None:
    """Answer every core error (and unparsable requests, unknown routes, methods a route lacks) in Vektonn's
    shape, app-wide; the dataset routes answer their own in theirs: those raised in the route, before these
    handlers see them, and a method one of them lacks here."""
    app.add_exception_handler(RequestValidationError, _on_request_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    for cls in CORE:
        app.add_exception_handler(cls, _on_core_error)
    app.add_exception_handler(DBAPIError, _on_driver_error)


# -- the dataset API's shape ---------------------------------------------------------------------------------


def dataset_error(status: int, code: str, message: str, details: dict[str, Any] | None = None,
                  headers: dict[str, str] | None = None, *, tenant_id: str | None = None) -> JSONResponse:
    """One error in the dataset API's shape; its details always carry `tenant_id` (the caller's tenant, null
    before it is known) and an `action` hint (the error's own, else its code's)."""
    details = dict(details or {})
    details.setdefault("tenant_id", tenant_id)
    details.setdefault("action", action_of(code))
    body = {"success": False, "error_code": code, "message": message, "details": details}
    return ErrorJSON(status_code=status, content=body, headers=headers)


def _dataset_request_error(exc: RequestValidationError, tenant_id: str | None) -> JSONResponse:
    errors = []
    codes = set()
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ())]
        errors.append({"loc": ".".join(loc), "msg": str(err.get("msg", "")), "type": str(err.get("type", ""))})
        top = loc[1] if len(loc) >= 2 and loc[0] == "body" and err.get("type") != "missing" else ""
        codes.add(FIELD_CODES.get(top, ErrorCode.VALIDATION_ERROR))
    code = codes.pop() if len(codes) == 1 else ErrorCode.VALIDATION_ERROR
    shown = "; ".join(f"{e['loc']}: {e['msg']}" if e["loc"] else e["msg"] for e in errors[:10])
    return dataset_error(DATASET_STATUS[code], code.value, f"invalid request: {shown or 'malformed body'}",
                         {"errors": errors[:100]}, tenant_id=tenant_id)


# The 503s no retry mends: SERVICE_UNAVAILABLE's own hint (retry after Retry-After) would send clients into a loop.
OPERATOR_ACTIONS: dict[type[ShoalError], str] = {
    CapacityError: "an operator must raise SHOAL_SEARCHER_CACHE_BYTES or serve the index's shards from more "
    "processes; retrying will not help until then",
    ConfigurationError: "an operator must correct the setting the message names; retrying will not help until then",
    ShardsUnavailableError: "search through a process that fans out, or have an operator place the shards "
    "(SHOAL_PLACEMENT_FILE); retrying will not help until then",
}


def _details(exc: ShoalError) -> dict[str, Any]:
    if isinstance(exc, DatasetError):
        return dict(exc.details)
    if isinstance(exc, ValidationError):
        return {"problems": [str(p) for p in exc.problems]}
    if isinstance(exc, ShardsUnavailableError) and exc.retry_after is not None:
        return {}  # the code's own hint: retry after Retry-After
    for cls, action in OPERATOR_ACTIONS.items():
        if isinstance(exc, cls):
            return {"action": action}
    return {}


def _app_handles(request: Request, exc: Exception) -> bool:
    handlers = getattr(request.app, "exception_handlers", {})
    return any(cls in handlers for cls in type(exc).__mro__ if cls not in (Exception, BaseException))


def dataset_response(request: Request, exc: Exception) -> JSONResponse | None:
    """The dataset API's answer to an exception raised on one of its routes, or None when the app's own
    handler should answer it (an exception that is not Shoal's and that the app has a handler for)."""
    exc = core_error(exc)
    # The dataset routes' tenant dependencies record the caller's tenant; unset when authentication failed.
    tenant_id = getattr(request.state, "dataset_tenant", None)
    if isinstance(exc, RequestValidationError):
        return _dataset_request_error(exc, tenant_id)
    if isinstance(exc, StarletteHTTPException):
        code = HTTP_CODES.get(exc.status_code, "HTTP_ERROR")
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return dataset_error(exc.status_code, code, detail, {}, dict(exc.headers or {}), tenant_id=tenant_id)
    if isinstance(exc, ConflictError):
        # A race lost after the retries inside (a search overtaken by compactions or swaps, a commit whose head
        # kept moving): nothing was written and a retry succeeds. The dataset API has no 409 of its own for it.
        return dataset_error(503, ErrorCode.SERVICE_UNAVAILABLE.value, str(exc), {}, {"Retry-After": "1"},
                             tenant_id=tenant_id)
    if isinstance(exc, ShoalError):
        known = answer(exc)
        if known.code is not None:
            return dataset_error(known.status, known.code.value, str(exc), _details(exc), extra_headers(exc) or None,
                                 tenant_id=tenant_id)
    elif _app_handles(request, exc) and not isinstance(exc, DBAPIError):  # the driver's: answered here, as a bug
        return None
    log.exception("dataset API: unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return dataset_error(500, ErrorCode.INTERNAL_ERROR.value, "internal error", {}, tenant_id=tenant_id)
