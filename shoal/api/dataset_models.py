"""The dataset API's request and response bodies (pydantic): what `shoal.api.datasets` reads and answers.

Request bodies refuse unknown fields (except an update's, which the service refuses with its own code);
response models fix the order and types of every field a route answers with.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from shoal.datasets import rules
from shoal.log.records import MAX_SEQ


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


MetricType = Literal["cosine", "euclidean", "manhattan", "dot_product"]
IndexType = Literal["flat", "hnsw", "ivf", "default"]
MergeStrategy = Literal["interleave", "score", "round_robin"]


class CreateDatasetRequest(_Body):
    """A new dataset. Unknown fields are refused. `index_type` left out or "default" is hnsw (flat for
    manhattan); the index parameters come in `index_config` (the specified form; it may name the type too) or
    `index_params` (the older one), those left out from the defaults. `index_config` is typed loosely so that
    the service refuses a bad one with INVALID_DATASET_CONFIG naming the field."""

    name: str = Field(json_schema_extra={"pattern": rules.NAME_RE.pattern, "maxLength": 100})
    dimensions: StrictInt = Field(json_schema_extra={"minimum": rules.MIN_DIMENSIONS, "maximum": rules.MAX_DIMENSIONS})
    metric_type: MetricType = "cosine"
    index_type: IndexType | None = None
    description: str | None = None
    metadata: dict[str, Any] | None = None
    index_params: dict[str, Any] | None = None
    index_config: Any = None
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
    tenant_id: str
    storage_location: str


class DatasetListOut(BaseModel):
    """A page of datasets by name: `total` in all, `has_more` when a later page holds more."""

    datasets: list[DatasetOut]
    total: int
    limit: int
    offset: int
    has_more: bool
    tenant_id: str


class DeleteOut(BaseModel):
    """What a delete did: `soft` (moved to the trash, restorable until `purge_after`, `trash_id` names it
    there) or hard (`files_deleted` files deleted at once); `message` says so, `deleted_at` when."""

    success: bool
    message: str
    dataset_id: str
    deleted: bool
    deleted_at: str
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
    has_more: bool
    tenant_id: str


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
    """Exact live vector count, bytes in storage, distinct documents, the serving index's parameters, memory
    and last rebuild (null: never rebuilt), metadata stats, index stats, and the dataset itself."""

    dataset_id: str
    tenant_id: str
    vector_count: int
    storage_size: int
    unique_documents: int
    parameters: dict[str, Any]
    memory_usage_bytes: int
    build_time_seconds: float | None
    last_rebuild_at: str | None
    storage: dict[str, int]
    metadata_stats: dict[str, Any]
    index_stats: IndexStatsOut
    dataset: DatasetOut


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
    # A token beyond a Postgres bigint names no write (and would fail the catalog query).
    min_write_token: StrictInt | None = Field(default=None, le=MAX_SEQ)
    # Attribute and metadata filters (shoal.searcher.filters), checked by the service: 400 naming what is wrong.
    filters: dict[str, Any] | None = None


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


class MultiSearchOptions(_Body):
    """How a multi-dataset search runs; `filters` (shoal.searcher.filters) apply to every dataset searched.
    Unknown options are refused, never ignored."""

    top_k: StrictInt | None = None
    merge_strategy: MergeStrategy | None = None
    consistency: Literal["eventual", "strong"] | None = None
    filters: Any = None


class MultiSearchRequest(_Body):
    """One query over several datasets, merged (see `shoal.datasets.merge` for the strategies): the specified
    form `{query_vector, datasets: [names], options: {top_k, merge_strategy, ...}}`, or the older one
    `{vector, dataset_ids, top_k, merge_strategy, consistency}`; a value given in both forms is refused."""

    query_vector: list[StrictFloat] | None = None
    datasets: list[str] | None = None
    options: MultiSearchOptions | None = None
    vector: list[StrictFloat] | None = None
    dataset_ids: list[str] | None = None
    top_k: StrictInt | None = None
    merge_strategy: MergeStrategy | None = None
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


# A rebuild of a dataset's index, optionally with another index type or params (no docstring: it would
# become the schema's description in the OpenAPI document, which has none for it). `index_config` is the
# specified form (the params, optionally with `index_type`), `index_type` and `index_params` the older one;
# `async` may come here or as the query parameter. `index_config` is typed loosely so that the service
# refuses a bad one with INVALID_DATASET_CONFIG naming the field. Unknown fields are refused: a field
# ignored silently is how a reindex with the old params once answered 202.
class ReindexRequest(_Body):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    index_type: str | None = None
    index_params: dict[str, Any] | None = None
    index_config: Any = None
    run_async: StrictBool | None = Field(default=None, alias="async")
