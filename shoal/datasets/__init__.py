"""The dataset API's service logic (DeepLake-style datasets), free of HTTP; `shoal.api.datasets` serves it.

`service.DatasetService` answers with the frozen values of `results` and raises `DatasetError` with an
`ErrorCode` (or another core error of `shoal.errors`); statuses and bodies are `shoal.api`'s.

A dataset is the tenant-facing convenience of one data source plus its default index under one name
(DESIGN.md). For a dataset named N in tenant T:

- **data source** `N` version `1`, dense, `dimensions` wide, with the fixed schema
  `id` (string, permanent), `document_id` (string, "" for none), `content` (string, "" for none) and
  `metadata` (string: the vector's metadata as JSON text, "null" for none). An upsert of a known `id`
  replaces that vector (last write wins).
- **default index** `N` version `1`: algorithm = `index_type` (flat, hnsw, ivf; none or "default" is hnsw, or
  flat for manhattan), metric = `metric_type` (cosine, euclidean, manhattan, dot_product), parameters from
  `index_config` (or `index_params`) completed with the dataset API's defaults and checked against its ranges
  (`rules.INDEX_DEFAULTS`, `rules.PARAM_RANGES`), then by the engine; id attribute `id`, one shard, every
  attribute as payload. hnsw and ivf do not support manhattan (INVALID_DATASET_CONFIG); flat supports all.
- **catalog**: the dataset's definition (description, metadata, metric and index type, index params, last
  update) lives in the data source row's `custom_metadata` under `shoal.dataset` (`catalog.MARKER`); that key
  is what makes a data source a dataset. `created_at` is the data source's creation time.
- **storage**: `tenants/T/datasets/N/dataset_metadata.json` mirrors the catalog entry (written atomically on
  create and update, removed on delete); the log and the index artifacts stay where DESIGN.md puts them.
- **id**: the dataset's id is its name (unique per tenant, immutable since datasets cannot be renamed).
- **names**: `^[a-z0-9_-]{1,100}$` starting with a letter or digit (data source names must); the reserved
  names `rules.RESERVED_NAMES` are refused on create (RESERVED_DATASET_NAME) and never found otherwise.
- **dimensions**: 1..10000 (the engines' and the catalog's cap).
- **vector_count / storage_size** of a dataset object: the live vectors (the log's id and operation columns
  folded: O(log entries), remembered per process until the log changes, `live`) and the log's bytes; in the
  trash the O(1) estimate (upserts minus tombstones). `/stats` gives the same count and bytes of the log,
  index artifacts (every file under the index's folder, including versions awaiting garbage collection) and
  the metadata mirror.
- **delete** moves the dataset to the tenant's trash (`shoal.upkeep.trash`): hidden everywhere, its name free,
  its files in place, its mirror moved to `tenants/T/trash/{trash_id}/`; restorable until `purge_after`
  (SHOAL_TRASH_RETENTION_DAYS), then purged by beat. `hard=True` (and `overwrite` on create) deletes at once
  the index, the data source, their files and the mirror.
- **reindex** rebuilds the default index as a new generation, swapped in once its recall meets the gate
  (REINDEX_CONFLICT while another runs), with the type and params of `index_config` (or `index_type` and
  `index_params`). From the swap on, the dataset shows the generation serving: its `index_type` and
  `index_params` are read from the serving index row (`catalog`), cached entries are corrected on read, and
  the mirror is written again right after the swap's commit (`shoal.index.reindex.refresh_dataset_mirror`,
  also after a rollback).
- **search**: `score` is the metric's distance as Shoal defines it (smaller is nearer, except dot_product
  where larger is nearer). Consistency: `strong` sees every write committed before the query; otherwise a
  `min_write_token` asks for at least that write; otherwise `eventual`.
- **multi-dataset search**: see `merge` for the exact order of each strategy.
- **cache**: see `cache` (Redis keys, TTLs, invalidation, behaviour when Redis is down).
"""

from shoal.datasets.cache import DatasetCache
from shoal.datasets.catalog import DatasetCatalog, DatasetRecord
from shoal.datasets.errors import DatasetError, ErrorCode
from shoal.datasets.rules import RESERVED_NAMES
from shoal.datasets.service import DatasetService

__all__ = [
    "RESERVED_NAMES",
    "DatasetCache",
    "DatasetCatalog",
    "DatasetError",
    "DatasetRecord",
    "DatasetService",
    "ErrorCode",
]
