"""Vektonn-compatible routes: upload to a data source, search an index. Existing Vektonn clients work as they are.

Extensions Vektonn clients ignore: every upload answers with its write token in `X-Shoal-Write-Token`; a search
may ask for `X-Shoal-Consistency: eventual|strong|at_least` and `X-Shoal-Required-Token: <seq>`.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Depends, Header, Request, Response

from shoal.api.convert import hit_dto, points_from_dtos, query_vectors, split_filter, vector_dto
from shoal.api.dto import ErrorDto, InputDataPointOrTombstoneDto, SearchQueryDto, SearchResultDto
from shoal.api.security import TenantContext, reader_tenant, writer_tenant
from shoal.errors import ValidationError
from shoal.searcher.consistency import Consistency

router = APIRouter(prefix="/api/v1", tags=["vektonn"])
ERRORS = {400: {"model": ErrorDto}, 404: {"model": ErrorDto}}
TOKEN_HEADER = "X-Shoal-Write-Token"


@router.post("/upload/{dataSourceName}/{dataSourceVersion}", responses=ERRORS, status_code=200)
def upload(
    dataSourceName: str,  # noqa: N803 - Vektonn's path parameter names
    dataSourceVersion: str,  # noqa: N803
    body: Annotated[list[InputDataPointOrTombstoneDto], Body()],
    ctx: Annotated[TenantContext, Depends(writer_tenant)],
    request: Request,
) -> Response:
    """Append data points and tombstones, all or nothing; 200 with an empty body once they are durable."""
    ctx.handle.shoal.check_backpressure(dataSourceName, dataSourceVersion)
    producer = ctx.handle.shoal.producer(dataSourceName, dataSourceVersion)
    token = producer.upload(points_from_dtos(producer.spec, body))
    request.app.state.metrics.uploaded.labels(ctx.tenant).inc(len(body))
    return Response(status_code=200, headers={TOKEN_HEADER: str(token.seq)})


def _consistency(level: str | None, token: int | None) -> Consistency:
    if token is not None and level in (None, "at_least"):
        return Consistency.at_least(token)
    if level in (None, "eventual"):
        return Consistency.eventual()
    if level == "strong":
        return Consistency.strong()
    if level == "at_least":
        raise ValidationError("X-Shoal-Consistency at_least needs X-Shoal-Required-Token")
    raise ValidationError(f"unknown X-Shoal-Consistency {level!r}: use eventual, strong or at_least")


def _history(
    x_shoal_tag: Annotated[str | None, Header()] = None, x_shoal_as_of: Annotated[int | None, Header()] = None
) -> tuple[str | None, int | None]:
    """Time travel: search the versions a tag pinned, or as of a seq."""
    return x_shoal_tag, x_shoal_as_of


History = Annotated[tuple[str | None, int | None], Depends(_history)]


def _search(
    index_name: str,
    index_version: str,
    query: SearchQueryDto,
    ctx: TenantContext,
    level: str | None,
    token: int | None,
    request: Request,
    history: tuple[str | None, int | None] = (None, None),
) -> list[SearchResultDto]:
    with request.app.state.metrics.search_seconds.labels(ctx.tenant).time():
        return _search_now(index_name, index_version, query, ctx, level, token, history)


def _search_now(
    index_name: str, index_version: str, query: SearchQueryDto, ctx: TenantContext, level: str | None,
    token: int | None, history: tuple[str | None, int | None] = (None, None),
) -> list[SearchResultDto]:
    # The searcher's view holds the definitions already: no catalog round trip per request (bench/api.py).
    source = ctx.handle.searcher.view(index_name, index_version).source.spec
    if query.k <= 0:
        raise ValidationError(f"k must be positive, got {query.k}")
    vectors = query_vectors(source, query.queryVectors)
    results = ctx.handle.searcher.search(
        index_name,
        index_version,
        vectors,
        query.k,
        split_filter=split_filter(source, query.splitFilter),
        retrieve_vectors=query.retrieveVectors,
        consistency=_consistency(level, token),
        tag=history[0],
        as_of=history[1],
    )
    return [
        SearchResultDto(queryVector=vector_dto(v), nearestDataPoints=[hit_dto(source, h) for h in hits])
        for v, hits in zip(vectors, results, strict=True)
    ]


SEARCH = "/search/{indexName}/{indexVersion}"


@router.post(SEARCH, responses=ERRORS, response_model=list[SearchResultDto], response_model_exclude_none=True)
def search_post(
    indexName: str,  # noqa: N803
    indexVersion: str,  # noqa: N803
    query: Annotated[SearchQueryDto, Body()],
    ctx: Annotated[TenantContext, Depends(reader_tenant)],
    request: Request,
    x_shoal_consistency: Annotated[str | None, Header()] = None,
    x_shoal_required_token: Annotated[int | None, Header()] = None,
    history: History = (None, None),
) -> list[SearchResultDto]:
    """The k nearest data points for each query vector, nearest first. `X-Shoal-Tag` or `X-Shoal-As-Of`
    search older versions (time travel)."""
    return _search(indexName, indexVersion, query, ctx, x_shoal_consistency, x_shoal_required_token, request,
                   history)


@router.get(SEARCH, responses=ERRORS, response_model=list[SearchResultDto], response_model_exclude_none=True)
def search_get(
    indexName: str,  # noqa: N803
    indexVersion: str,  # noqa: N803
    query: Annotated[SearchQueryDto, Body()],
    ctx: Annotated[TenantContext, Depends(reader_tenant)],
    request: Request,
    x_shoal_consistency: Annotated[str | None, Header()] = None,
    x_shoal_required_token: Annotated[int | None, Header()] = None,
    history: History = (None, None),
) -> list[SearchResultDto]:
    """The same search as POST (Vektonn's client sends it as GET with a body)."""
    return _search(indexName, indexVersion, query, ctx, x_shoal_consistency, x_shoal_required_token, request,
                   history)


@router.post(
    "/aliases/{alias}/search", responses=ERRORS, response_model=list[SearchResultDto], response_model_exclude_none=True
)
def search_alias(
    alias: str,
    query: Annotated[SearchQueryDto, Body()],
    ctx: Annotated[TenantContext, Depends(reader_tenant)],
    request: Request,
    x_shoal_consistency: Annotated[str | None, Header()] = None,
    x_shoal_required_token: Annotated[int | None, Header()] = None,
) -> list[SearchResultDto]:
    """A search of the index the alias names now (resolved once per request), as POST /search does."""
    target = ctx.handle.shoal.get_alias(alias)
    return _search(target.index_name, target.index_version, query, ctx, x_shoal_consistency, x_shoal_required_token,
                   request)
