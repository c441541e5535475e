"""Vektonn-compatible routes: upload to a data source, search an index. Existing Vektonn clients work as they are.

Both routes read the raw body and decode it with orjson straight into columns (shoal.vektonn.wire): no pydantic
object per point or hit. A search of a loaded index at eventual consistency, by a caller whose key verdict is
cached, is answered on the event loop before routing (shoal.api.fastpath): it touches neither the catalog nor
storage. Anything that may block (authentication, a first load, a stronger consistency, an upload) runs here,
in one threadpool hop.

Extensions Vektonn clients ignore: every upload answers with its write token in `X-Shoal-Write-Token` and may
carry an `Idempotency-Key` (its batch id: a retry writes nothing twice) or an Arrow IPC stream body; a search
may ask for `X-Shoal-Consistency: eventual|strong|at_least` and `X-Shoal-Required-Token: <seq>`, and search
older versions with `X-Shoal-Tag` or `X-Shoal-As-Of`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from pydantic import TypeAdapter
from starlette.concurrency import run_in_threadpool

from shoal.api.fanout import (
    NEARER_HEADER,
    PIN_HEADER,
    SEQ_HEADER,
    SHARDS_HEADER,
    FanOut,
    LocalPart,
    parse_shards,
)
from shoal.api.process_tuning import collector_paused
from shoal.api.security import TenantContext, reader_tenant, writer_tenant
from shoal.api.time_travel import int_header, time_travel
from shoal.config.settings import Settings
from shoal.errors import BatchIdReusedError, NotFoundError, QueryError, ValidationError
from shoal.intake.producer import check_batch_id
from shoal.log.commit import held_batches
from shoal.searcher.consistency import Consistency
from shoal.searcher.searcher import AnsweredAt
from shoal.vektonn import wire
from shoal.vektonn.dto import ErrorDto, InputDataPointOrTombstoneDto, SearchQueryDto, SearchResultDto
from shoal.vektonn.upload_json import EmptyUploadError

router = APIRouter(prefix="/api/v1", tags=["vektonn"])
ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": ErrorDto} for s in (400, 401, 403, 404, 503)}
TOKEN_HEADER = "X-Shoal-Write-Token"
IDEMPOTENCY_HEADER = "Idempotency-Key"
JSON = "application/json"
ARROW = "application/vnd.apache.arrow.stream"

# JSON bodies are decoded one at a time: a decode holds the GIL from start to end, so decodes running side by
# side only take turns every switch interval, each turn a hand-off that costs and spoils the caches (bench/api.py,
# 8 clients). A waiting thread sleeps on the lock without the GIL; the other work goes on meanwhile. The lock also
# makes collector_paused's pause and resume pairs never interleave.
_JSON_DECODES = threading.Lock()

# The request bodies, documented in the OpenAPI document although the routes read the raw bytes.
REF = "#/components/schemas/{model}"
UPLOAD_SCHEMA = TypeAdapter(list[InputDataPointOrTombstoneDto]).json_schema(ref_template=REF)
SEARCH_SCHEMA = TypeAdapter(SearchQueryDto).json_schema(ref_template=REF)


def body_definitions() -> dict[str, Any]:
    """The schemas the documented bodies refer to (merged into the OpenAPI components by the app)."""
    return {**UPLOAD_SCHEMA.get("$defs", {}), **SEARCH_SCHEMA.get("$defs", {}), "SearchQueryDto": _bare(SEARCH_SCHEMA)}


def _bare(schema: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in schema.items() if k != "$defs"}


def _header_doc(name: str, description: str, kind: str = "string") -> dict[str, Any]:
    return {"name": name, "in": "header", "required": False, "schema": {"type": kind}, "description": description}


UPLOAD_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            JSON: {"schema": _bare(UPLOAD_SCHEMA)},
            ARROW: {"schema": {"type": "string", "format": "binary"}},
        },
    },
    "parameters": [_header_doc(IDEMPOTENCY_HEADER, "The batch id: a repeated upload writes nothing twice.")],
}
SEARCH_DOC = {
    "requestBody": {"required": True, "content": {JSON: {"schema": {"$ref": REF.format(model="SearchQueryDto")}}}},
    "parameters": [
        _header_doc("X-Shoal-Consistency", "eventual (default), strong or at_least"),
        _header_doc("X-Shoal-Required-Token", "a write token (seq) the results must reflect", "integer"),
        _header_doc("X-Shoal-Tag", "search the versions a tag pinned"),
        _header_doc("X-Shoal-As-Of", "search as of this seq", "integer"),
    ],
}


# -- upload ------------------------------------------------------------------------------------------------


@router.post("/upload/{dataSourceName}/{dataSourceVersion}", responses=ERRORS, status_code=200,
             openapi_extra=UPLOAD_DOC)
async def upload(dataSourceName: str, dataSourceVersion: str, request: Request) -> Response:  # noqa: N803
    """Append data points and tombstones, all or nothing; 200 with an empty body once they are durable.

    The body is Vektonn's JSON, or an Arrow IPC stream (`Content-Type: application/vnd.apache.arrow.stream`:
    a `vector` column, one column per attribute, optional boolean `is_deleted`; `__vector` / `__is_deleted` when
    the data source has an attribute of the plain name, though a body without vectors takes a plain boolean
    `is_deleted` as the flags). An `Idempotency-Key` header
    becomes the batch id: a retry of an upload whose answer was lost returns the same token, writing nothing.
    """
    body = await request.body()
    return await run_in_threadpool(_upload, request, dataSourceName, dataSourceVersion, body)


def _upload(request: Request, name: str, version: str, body: bytes) -> Response:
    ctx = writer_tenant(request)
    shoal = ctx.handle.shoal
    shoal.check_backpressure(name, version)
    producer = shoal.producer(name, version, fresh=False)
    try:
        table = _decode_upload(request, producer.spec, body, shoal.settings)
    except EmptyUploadError:
        return _empty_upload(shoal, name, version, request.headers.get(IDEMPOTENCY_HEADER))
    except ValidationError:
        # The definition may be one this process reused for a moment (runtime.SOURCE_TTL_S): a source dropped
        # or trashed meanwhile answers 404, as it would have before any body was read; one made again under
        # the name (another dimension or other attributes, perhaps) judges the batch by its own definition.
        record = shoal.get_data_source(name, version)
        if record.id == producer.source.id:
            raise
        shoal.runtime.forget_source(producer.source.id)
        producer = shoal.producer(name, version)
        table = _decode_upload(request, producer.spec, body, shoal.settings)
    key = request.headers.get(IDEMPOTENCY_HEADER)
    try:
        token = producer.append_tables([(table, key)], client=True)[0]
    except NotFoundError:
        # The definition this process reused may be of a source dropped since (nothing was written): read
        # it again; a source of that name made meanwhile takes the batch, checked against its own definition
        # (another dimension or other attributes, perhaps), else the 404 stands.
        shoal.runtime.forget_source(producer.source.id)
        producer = shoal.producer(name, version)
        table = _decode_upload(request, producer.spec, body, shoal.settings)
        token = producer.append_tables([(table, key)], client=True)[0]
    request.app.state.metrics.uploaded.labels(ctx.tenant).inc(table.num_rows)
    return Response(status_code=200, headers={TOKEN_HEADER: str(token.seq)})


def _empty_upload(shoal: Any, name: str, version: str, key: str | None) -> Response:
    """The answer to an empty upload (`[]`): Vektonn answers it 200 and writes nothing, so does this, with the
    data source's head as the token (a search at it reflects every write so far). Its `Idempotency-Key` is held
    to the rules of any other upload's: 1 to 200 characters, no prefix Shoal keeps for its own batches, and a
    key already used for a batch is refused (400 naming it): an empty body is never a repeat of one, since no
    batch is empty. A key committed before batches were fingerprinted answers its token (any body repeats
    those). A fresh key is not recorded: nothing was written under it."""
    if key is not None:
        key = check_batch_id(key, client=True)
    # Read afresh: a source gone answers 404.
    record = shoal.get_data_source(name, version)
    if key is not None:
        with shoal.engine.connect() as conn:
            held = held_batches(conn, record.id, [key]).get(key)
        if held is not None:
            if held.fingerprint is not None:
                raise BatchIdReusedError(key, held.token)
            return Response(status_code=200, headers={TOKEN_HEADER: str(held.token)})
    return Response(status_code=200, headers={TOKEN_HEADER: str(record.head_seq)})


def _decode_upload(request: Request, spec: Any, body: bytes, settings: Settings) -> Any:
    kind = (request.headers.get("content-type") or JSON).split(";")[0].strip().lower()
    max_points = settings.max_batch_points
    if kind == ARROW:
        return wire.decode_arrow_upload(spec, body, max_points, settings.body_limit_bytes)
    if kind == JSON or kind.endswith("+json") or kind in ("", "text/plain"):
        with _JSON_DECODES, collector_paused():
            # Vektonn's rules: a sparse vector needs a coordinate (the Python producer takes an all-zero one).
            return wire.decode_upload(spec, body, max_points, empty_sparse=False)
    raise ValidationError(f"unsupported Content-Type {kind!r}: send {JSON} or {ARROW}")


# -- search ------------------------------------------------------------------------------------------------


def _consistency(headers: Mapping[str, str]) -> Consistency:
    """The level the headers ask for, as the dataset API reads `consistency` and `min_write_token`: `strong` if
    asked (it reflects every committed write, so whatever token is sent too); else at least the required token
    when one is sent, `eventual` included (the token is checked: one past the log head is refused); else
    eventual."""
    level = headers.get("x-shoal-consistency")
    token = int_header(headers, "X-Shoal-Required-Token")
    if level not in (None, "eventual", "strong", "at_least"):
        raise ValidationError(f"unknown X-Shoal-Consistency {level!r}: use eventual, strong or at_least")
    if level == "strong":
        return Consistency.strong()
    if token is not None:
        return Consistency.at_least(token)
    if level == "at_least":
        raise ValidationError("X-Shoal-Consistency at_least needs X-Shoal-Required-Token")
    return Consistency.eventual()


def plain_search(headers: Mapping[str, str]) -> bool:
    """True for an eventual search of the active versions (no stronger level, token or time travel asked)."""
    if any(h in headers for h in ("x-shoal-required-token", "x-shoal-tag", "x-shoal-as-of")):
        return False
    return headers.get("x-shoal-consistency", "eventual") == "eventual"


def search_content(
    ctx: TenantContext, metrics: Any, name: str, version: str, body: bytes, headers: Mapping[str, str],
    shards: list[int] | None = None,
) -> tuple[bytes, dict[str, str]]:
    """The JSON answer to one Vektonn search for the caller's tenant (lower-case `headers`), as the fast path
    answers it (shoal.api.fastpath), from the shards an `X-Shoal-Shards` header or `shards` names (else every
    shard: this process must serve them all), and the headers it is answered with (`part_headers`: none for a
    search that is no part). A search that breaks a rule raises a QueryError (400), whose message does not claim
    that nothing was written: a search writes nothing.

    The search is observed in `shoal_search_seconds` only when it answers: the fast path declines whatever
    raises, and the route that then answers the error observes it (`_search_blocking`), so each request counts
    once. A part asked by another node is not observed (`_timed`)."""
    started = time.perf_counter()
    answer = _search_answer(ctx, name, version, body, headers, shards)
    if shards is None and SHARDS_HEADER not in headers:
        metrics.observe_search(ctx.tenant, time.perf_counter() - started)
    return answer.content, part_headers(answer)


def part_headers(answer: _Answer) -> dict[str, str]:
    """The headers a part of a fanned-out search is answered with, whichever path answers it: the seq it reflects
    (X-Shoal-Seq, at_least and strong) and which way its generation's metric ranks (X-Shoal-Nearer). Without the
    latter the node fanning out merges by its own view's metric, which may be another generation's (a reindex or
    rollback that changed the metric, swapped in there first): hits merged the wrong way round, answered 200."""
    extra = {SEQ_HEADER: str(answer.seq)} if answer.seq is not None else {}
    if answer.higher_is_nearer is not None:
        extra[NEARER_HEADER] = "higher" if answer.higher_is_nearer else "lower"
    return extra


def _timed(metrics: Any, tenant: str, headers: Mapping[str, str]) -> AbstractContextManager[Any]:
    """The timer of one search in `shoal_search_seconds`; none for a part another node asked for (X-Shoal-Shards):
    the node that fanned the search out times it whole, so one search counts once however many nodes answer it."""
    if SHARDS_HEADER in headers:
        return nullcontext()
    timer: AbstractContextManager[Any] = metrics.search_timer(tenant)
    return timer


@dataclass(frozen=True)
class _Answer:
    content: bytes  # the SearchResultDto list
    k: int
    seq: int | None  # a part's: the seq it reflects (at_least and strong only; shoal.api.fanout)
    higher_is_nearer: bool | None  # a part's: the direction of the metric of the generation it searched


def _search_answer(
    ctx: TenantContext, name: str, version: str, body: bytes, headers: Mapping[str, str],
    shards: list[int] | None, pin: int | None = None,
) -> _Answer:
    """`search_content` (not timed: its callers time it), with the search's k and, for a part of a fanned-out
    search (`shards`, or an `X-Shoal-Shards` header), the seq it answered at: exactly at `pin` (or an
    `X-Shoal-Answer-Seq` header) or the lowest seq past it that it can, when given."""
    settings = ctx.handle.shoal.settings
    try:
        query = wire.decode_search(body, settings.max_query_vectors)
        consistency = _consistency(headers)
        travel = time_travel(headers)
        if shards is None and (raw := headers.get(SHARDS_HEADER)) is not None:
            try:
                shards = parse_shards(raw)
            except ValueError:
                raise ValidationError(f"header X-Shoal-Shards: must list shard numbers as 0,2,3; got {raw!r}")\
                    from None
            pin = int_header(headers, PIN_HEADER)
        answered = AnsweredAt() if shards is not None else None
        searcher = ctx.handle.searcher
        # The searcher's view holds the definitions: an eventual search makes no catalog round trip.
        source = searcher.view(name, version).source.spec
        vectors = wire.query_vectors(source, query, empty_sparse=False)  # Vektonn's rule, as on upload
        results = searcher.search(
            name, version, vectors, query.k,
            split_filter=wire.split_filter(source, query),
            retrieve_vectors=query.retrieve_vectors,
            consistency=consistency,
            tag=travel.tag,
            as_of=travel.as_of,
            filters=query.filter,
            shards=shards,
            max_hits=settings.max_search_hits,
            pin=pin,
            answered=answered,
        )
    except ValidationError as exc:
        raise QueryError.of(exc) from None
    # Each result echoes its query vector as sent (not as the float32 the search used), as Vektonn does.
    content = wire.encode_search_results(source, query.query_vectors, results, query.retrieve_vectors)
    if answered is None:
        return _Answer(content, query.k, None, None)
    return _Answer(content, query.k, answered.seq, answered.higher_is_nearer)


def _local_part(ctx: TenantContext, name: str, version: str, body: bytes, headers: Mapping[str, str],
                shards: list[int], pin: int | None = None) -> LocalPart:
    """This process's part of a fanned-out search (shoal.api.fanout); not timed: `fanned_out` times the whole."""
    answer = _search_answer(ctx, name, version, body, headers, shards, pin)
    view = ctx.handle.searcher.view(name, version)
    nearer = view.higher_is_nearer if answer.higher_is_nearer is None else answer.higher_is_nearer
    return LocalPart(orjson.loads(answer.content), answer.k, nearer, len(view.index.shards), answer.seq,
                     answer.higher_is_nearer is not None)


async def fanned_out(fanout: FanOut, ctx: TenantContext, metrics: Any, name: str, version: str, body: bytes,
                     headers: Mapping[str, str], *, inline: bool = False) -> Response:
    """The answer to a Vektonn search of an index placed across nodes, this process's part included, observed
    once in `shoal_search_seconds` from the first part asked to the merged answer (what the caller waits for)."""
    local = partial(_local_part, ctx, name, version, body, headers)
    with metrics.search_timer(ctx.tenant):
        return await fanout.search(ctx, name, version, body, headers, local, inline=inline)


def _search_blocking(request: Request, name: str, version: str, body: bytes,
                     ctx: TenantContext | None = None) -> Response:
    ctx = ctx or reader_tenant(request)
    # Timed here, whether it answers or raises: the fast path observed nothing of a search it passed on.
    with _timed(request.app.state.metrics, ctx.tenant, request.headers):
        answer = _search_answer(ctx, name, version, body, request.headers, None)
    return Response(answer.content, media_type=JSON, headers=part_headers(answer) or None)


async def _search(request: Request, name: str, version: str) -> Response:
    # The fast cases never get here: shoal.api.fastpath answers them before routing.
    body = await request.body()
    fanout = request.app.state.fanout
    if fanout is None or SHARDS_HEADER in request.headers:  # no placement, or a part asked by another node
        return await run_in_threadpool(_search_blocking, request, name, version, body)
    ctx = await run_in_threadpool(reader_tenant, request)
    if not fanout.spans(ctx.tenant, name, version):
        return await run_in_threadpool(_search_blocking, request, name, version, body, ctx)
    return await fanned_out(fanout, ctx, request.app.state.metrics, name, version, body, request.headers)


SEARCH = "/search/{indexName}/{indexVersion}"


@router.post(SEARCH, responses=ERRORS, response_model=list[SearchResultDto], openapi_extra=SEARCH_DOC)
async def search_post(indexName: str, indexVersion: str, request: Request) -> Response:  # noqa: N803
    """The k nearest data points for each query vector, nearest first. `X-Shoal-Tag` or `X-Shoal-As-Of`
    search older versions (time travel)."""
    return await _search(request, indexName, indexVersion)


@router.get(SEARCH, responses=ERRORS, response_model=list[SearchResultDto], openapi_extra=SEARCH_DOC)
async def search_get(indexName: str, indexVersion: str, request: Request) -> Response:  # noqa: N803
    """The same search as POST (Vektonn's client sends it as GET with a body)."""
    return await _search(request, indexName, indexVersion)


@router.post("/aliases/{alias}/search", responses=ERRORS, response_model=list[SearchResultDto],
             openapi_extra=SEARCH_DOC)
async def search_alias(alias: str, request: Request) -> Response:
    """A search of the index the alias names now (resolved once per request), as POST /search does."""
    body = await request.body()
    if request.app.state.fanout is not None:  # the index may be placed across nodes: resolve, then search it
        target = await run_in_threadpool(_alias_target, request, alias)
        return await _search(request, target.index_name, target.index_version)
    return await run_in_threadpool(_search_alias, request, alias, body)


def _alias_target(request: Request, alias: str) -> Any:
    return reader_tenant(request).handle.shoal.get_alias(alias)


def _search_alias(request: Request, alias: str, body: bytes) -> Response:
    target = reader_tenant(request).handle.shoal.get_alias(alias)
    return _search_blocking(request, target.index_name, target.index_version, body)
