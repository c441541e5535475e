"""Management and status routes: data sources, indexes and per-shard freshness of the caller's tenant."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from shoal.api.security import TenantContext, deleter_tenant, reader_tenant, writer_tenant
from shoal.catalog.indexes import AliasRecord, IndexRecord
from shoal.catalog.repo import SourceRecord
from shoal.errors import IndexDefinitionError
from shoal.index.generations import JobRecord
from shoal.index.spec import vektonn_metric_problem
from shoal.log.records import DataSourceSpec, IndexSpec, check_name
from shoal.vektonn.dto import ErrorDto

router = APIRouter(prefix="/api/v1", tags=["management"])
ERRORS: dict[int | str, dict[str, Any]] = {s: {"model": ErrorDto} for s in (400, 401, 403, 404, 409, 503)}


class ManagementBody(BaseModel):
    """A management request body: a field it does not define is refused (400 naming it), not ignored, so a
    misspelt one (`vectorsAreSparce`, `shardcount`) never writes a definition other than the one asked for."""

    model_config = ConfigDict(extra="forbid")


# Numbers and booleans are strict: `true` or "3" for a dimension, "yes" or 1 for a flag, are refused (400 naming
# the field) rather than coerced and stored, as the Python API's DataSourceSpec and IndexSpec refuse them.
class DataSourceBody(ManagementBody):
    name: str
    version: str
    vectorDimension: StrictInt  # noqa: N815 - Vektonn's field names
    vectorsAreSparse: StrictBool = False  # noqa: N815
    attributeValueTypes: dict[str, str]  # noqa: N815
    permanentAttributes: list[str]  # noqa: N815
    description: str = ""
    customMetadata: dict[str, Any] = Field(default_factory=dict)  # noqa: N815


class IndexBody(ManagementBody):
    name: str
    version: str
    dataSourceName: str  # noqa: N815
    dataSourceVersion: str  # noqa: N815
    algorithm: str = "flat"
    metric: str | None = None  # None: the algorithm's (a Vektonn type's own), else IndexSpec's default
    params: dict[str, Any] = Field(default_factory=dict)
    idAttributes: list[str] = Field(default_factory=list)  # noqa: N815
    splitAttributes: list[str] = Field(default_factory=list)  # noqa: N815
    shardAttributes: list[str] = Field(default_factory=list)  # noqa: N815
    payloadAttributes: list[str] | None = None  # noqa: N815
    shardCount: StrictInt = 1  # noqa: N815


def _source(r: SourceRecord) -> dict[str, Any]:
    spec = r.spec
    return {
        "name": spec.name,
        "version": spec.version,
        "vectorDimension": spec.vector_dimension,
        "vectorsAreSparse": spec.vectors_are_sparse,
        "attributeValueTypes": {k: v.value for k, v in spec.attribute_types.items()},
        "permanentAttributes": list(spec.permanent_attributes),
        "description": spec.description,
        "customMetadata": dict(spec.custom_metadata),
        "head": r.head_seq,
        "headCommittedAt": r.head_committed_at.isoformat() if r.head_committed_at else None,
    }


def _index(r: IndexRecord) -> dict[str, Any]:
    spec = r.spec
    return {
        "name": spec.name,
        "version": spec.version,
        "dataSourceName": spec.source_name,
        "dataSourceVersion": spec.source_version,
        "algorithm": spec.algorithm,
        "metric": spec.metric,
        "params": dict(spec.params),
        "idAttributes": list(spec.id_attributes),
        "splitAttributes": list(spec.split_attributes),
        "shardAttributes": list(spec.shard_attributes),
        "payloadAttributes": list(spec.payload_attributes or ()),
        "shardCount": spec.shard_count,
    }


Reader = Annotated[TenantContext, Depends(reader_tenant)]
Writer = Annotated[TenantContext, Depends(writer_tenant)]
# Routes that delete data need a write key: keyless callers never delete (an alias or a tag is no data).
Deleter = Annotated[TenantContext, Depends(deleter_tenant)]


@router.get("/data-sources", responses=ERRORS)
def list_sources(ctx: Reader) -> list[dict[str, Any]]:
    """Every data source of the tenant."""
    return [_source(r) for r in ctx.handle.shoal.list_data_sources()]


@router.post("/data-sources", responses=ERRORS, status_code=201)
def create_source(body: DataSourceBody, ctx: Writer) -> dict[str, Any]:
    """Create a data source (Vektonn's consistency rules apply)."""
    spec = DataSourceSpec(
        name=body.name,
        version=body.version,
        vector_dimension=body.vectorDimension,
        vectors_are_sparse=body.vectorsAreSparse,
        attribute_types={k: v.lower() for k, v in body.attributeValueTypes.items()},
        permanent_attributes=body.permanentAttributes,
        description=body.description,
        custom_metadata=body.customMetadata,
    )
    return _source(ctx.handle.shoal.create_data_source(spec))


@router.get("/data-sources/{name}/{version}", responses=ERRORS)
def get_source(name: str, version: str, ctx: Reader) -> dict[str, Any]:
    """One data source with its head."""
    return _source(ctx.handle.shoal.get_data_source(name, version))


@router.delete("/data-sources/{name}/{version}", responses=ERRORS, status_code=204)
def drop_source(name: str, version: str, ctx: Deleter) -> Response:
    """Delete a data source, its log and (through the catalog) its indexes; not a dataset's (403: Shoal refuses
    it, a dataset is deleted through the dataset API)."""
    ctx.handle.shoal.drop_data_source(name, version)
    return Response(status_code=204)


@router.get("/indexes", responses=ERRORS)
def list_indexes(ctx: Reader) -> list[dict[str, Any]]:
    """Every index of the tenant."""
    return [_index(r) for r in ctx.handle.shoal.list_indexes()]


@router.post("/indexes", responses=ERRORS, status_code=201)
def create_index(body: IndexBody, ctx: Writer) -> dict[str, Any]:
    """Create an index over a data source (Vektonn's rules apply; Vektonn algorithm names accepted, with no
    metric or the one the type implies: any other is refused)."""
    if body.metric is not None and (problem := vektonn_metric_problem(body.algorithm, body.metric)) is not None:
        raise IndexDefinitionError([problem])
    spec = IndexSpec(
        name=body.name,
        version=body.version,
        source_name=body.dataSourceName,
        source_version=body.dataSourceVersion,
        algorithm=body.algorithm,
        **({} if body.metric is None else {"metric": body.metric}),
        params=body.params,
        id_attributes=body.idAttributes,
        split_attributes=body.splitAttributes,
        shard_attributes=body.shardAttributes,
        payload_attributes=body.payloadAttributes,
        shard_count=body.shardCount,
    )
    return _index(ctx.handle.shoal.create_index(spec))


@router.get("/indexes/{name}/{version}", responses=ERRORS)
def get_index(name: str, version: str, ctx: Reader) -> dict[str, Any]:
    """One index definition."""
    return _index(ctx.handle.shoal.get_index(name, version))


@router.delete("/indexes/{name}/{version}", responses=ERRORS, status_code=204)
def drop_index(name: str, version: str, ctx: Deleter) -> Response:
    """Delete an index with its versions and files; not a dataset's own (403: Shoal.drop_index refuses it),
    though other indexes over its data source are dropped as any other."""
    ctx.handle.shoal.drop_index(name, version)
    return Response(status_code=204)


@router.get("/indexes/{name}/{version}/status", responses=ERRORS)
def index_status(name: str, version: str, ctx: Reader) -> list[dict[str, Any]]:
    """Freshness per shard: head, built and served watermarks, lag in seqs and seconds."""
    return [asdict(s) for s in ctx.handle.shoal.index_status(name, version)]


class AliasBody(ManagementBody):
    indexName: str  # noqa: N815 - Vektonn-style field names
    indexVersion: str  # noqa: N815


def _alias(r: AliasRecord) -> dict[str, Any]:
    return {"name": r.name, "indexName": r.index_name, "indexVersion": r.index_version,
            "updatedAt": r.updated_at.isoformat()}


@router.get("/aliases", responses=ERRORS)
def list_aliases(ctx: Reader) -> list[dict[str, Any]]:
    """The tenant's index aliases and the index each names."""
    return [_alias(r) for r in ctx.handle.shoal.list_aliases()]


@router.put("/aliases/{alias}", responses=ERRORS)
def set_alias(alias: str, body: AliasBody, ctx: Writer) -> dict[str, Any]:
    """Point an alias at an index: creates it, or moves it atomically (searches see one index or the other)."""
    # Names checked before the catalog sees them: text it cannot store (a lone surrogate) is a 400, not a 500.
    check_name("index name", body.indexName)
    check_name("index version", body.indexVersion)
    return _alias(ctx.handle.shoal.set_alias(alias, body.indexName, body.indexVersion))


@router.get("/aliases/{alias}", responses=ERRORS)
def get_alias(alias: str, ctx: Reader) -> dict[str, Any]:
    """The index an alias names."""
    return _alias(ctx.handle.shoal.get_alias(alias))


@router.delete("/aliases/{alias}", responses=ERRORS, status_code=204)
def drop_alias(alias: str, ctx: Writer) -> Response:
    """Remove an alias; the index stays."""
    ctx.handle.shoal.drop_alias(alias)
    return Response(status_code=204)


class ReindexBody(ManagementBody):
    algorithm: str | None = None
    metric: str | None = None
    params: dict[str, Any] | None = None
    # A number (an integer is one): `true` or "0.5" is refused, 400 naming the field, as the Python API refuses it.
    gate: StrictFloat | None = None


def _job(j: JobRecord) -> dict[str, Any]:
    return {"job": j.id, "state": j.state, "progress": j.progress, "etaSeconds": j.eta_s, "recall": j.recall,
            "gate": j.gate, "definition": j.definition, "error": j.error, "createdAt": j.created_at.isoformat(),
            "finishedAt": j.finished_at.isoformat() if j.finished_at else None}


@router.post("/indexes/{name}/{version}/reindex", responses=ERRORS, status_code=202)
def reindex_index(name: str, version: str, body: ReindexBody, ctx: Writer) -> dict[str, Any]:
    """Start a reindex (a worker builds the new generation aside and swaps it in once its recall meets the
    gate); 202 with the job, whose progress `GET .../reindex` shows; 409 if one runs already."""
    job = ctx.handle.shoal.reindex(name, version, algorithm=body.algorithm, metric=body.metric, params=body.params,
                                   gate=body.gate)
    return _job(job)


@router.get("/indexes/{name}/{version}/reindex", responses=ERRORS)
def reindex_jobs(name: str, version: str, ctx: Reader) -> list[dict[str, Any]]:
    """The index's reindex jobs, newest first: state, progress, ETA, recall against the gate."""
    return [_job(j) for j in ctx.handle.shoal.reindex_jobs(name, version)]


@router.delete("/indexes/{name}/{version}/reindex", responses=ERRORS)
def cancel_reindex(name: str, version: str, ctx: Writer) -> dict[str, Any]:
    """Cancel the running reindex: the old generation keeps serving; the new one and its files go."""
    return _job(ctx.handle.shoal.cancel_reindex(name, version))


@router.post("/indexes/{name}/{version}/rollback", responses=ERRORS)
def rollback_index(name: str, version: str, ctx: Writer) -> dict[str, Any]:
    """Serve again the generation the last reindex replaced (while it is kept)."""
    ctx.handle.shoal.rollback(name, version)
    return _index(ctx.handle.shoal.get_index(name, version))


@router.put("/indexes/{name}/{version}/tags/{tag}", responses=ERRORS)
def tag_index(name: str, version: str, tag: str, ctx: Writer) -> dict[str, Any]:
    """Pin the versions the index serves now under `tag` (kept by pruning; searchable with X-Shoal-Tag)."""
    versions = ctx.handle.shoal.tag_index(name, version, tag)
    return {"tag": tag, "versions": {str(k): v for k, v in versions.items()}}


@router.get("/indexes/{name}/{version}/tags", responses=ERRORS)
def index_tags(name: str, version: str, ctx: Reader) -> dict[str, dict[str, int | None]]:
    """The index's tags: tag -> shard id -> pinned version id."""
    return {t: {str(k): v for k, v in vs.items()} for t, vs in ctx.handle.shoal.index_tags(name, version).items()}


@router.delete("/indexes/{name}/{version}/tags/{tag}", responses=ERRORS, status_code=204)
def untag_index(name: str, version: str, tag: str, ctx: Writer) -> Response:
    """Remove a tag; its versions become prunable like any other."""
    ctx.handle.shoal.untag_index(name, version, tag)
    return Response(status_code=204)
