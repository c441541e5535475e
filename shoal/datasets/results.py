"""What the dataset service answers: frozen values, not HTTP bodies (the API renders them, `shoal.api.datasets`)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from shoal.client import ShardStatus
from shoal.datasets.catalog import DatasetRecord, LogTotals
from shoal.index.generations import JobRecord

T = TypeVar("T")


@dataclass(frozen=True)
class Dataset:
    """A dataset as its owner sees it: `vector_count` its live vectors (the last write per id, minus deletions),
    `storage_size` its log's bytes (`DatasetStats` adds the index files and the mirror), `tenant_id` the name of
    the tenant owning it, `storage_location` the URI of its folder. Its id is its name."""

    name: str
    description: str | None
    dimensions: int
    metric_type: str
    index_type: str
    metadata: dict[str, Any] | None
    created_at: dt.datetime
    updated_at: dt.datetime
    vector_count: int
    storage_size: int
    tenant_id: str
    storage_location: str

    @classmethod
    def of(cls, record: DatasetRecord, totals: LogTotals, *, live: int | None = None, tenant_id: str,
           storage_location: str) -> Dataset:
        """The dataset of a catalog entry with its log's totals and its live vector count (None: the O(1)
        estimate, upserts minus tombstones, for an entry whose log is not read, e.g. one in the trash)."""
        count = totals.estimated_vector_count if live is None else live
        return cls(record.name, record.description, record.dimensions, record.metric_type, record.index_type,
                   record.metadata, record.created_at, record.updated_at, count, totals.bytes, tenant_id,
                   storage_location)


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a listing: `items` from `offset` on (at most `limit`), of `total`."""

    items: tuple[T, ...]
    total: int
    limit: int
    offset: int


@dataclass(frozen=True)
class TrashEntry:
    """A dataset in the trash: restorable until `purge_after`; `trash_id` tells apart several of one name."""

    dataset: Dataset
    trash_id: int
    deleted_at: dt.datetime
    purge_after: dt.datetime


@dataclass(frozen=True)
class Deletion:
    """What a delete did: `soft` (moved to the trash as `trash_id` until `purge_after`) or hard
    (`files_deleted` files deleted at once)."""

    dataset_id: str
    soft: bool
    files_deleted: int
    trash_id: int | None
    purge_after: dt.datetime | None
    deleted_at: dt.datetime

    @property
    def message(self) -> str:
        """What happened, in a sentence."""
        if self.soft:
            assert self.purge_after is not None
            return (f"dataset {self.dataset_id!r} moved to the trash; restorable until "
                    f"{self.purge_after.isoformat(timespec='seconds')}")
        return f"dataset {self.dataset_id!r} deleted ({self.files_deleted} files)"


@dataclass(frozen=True)
class Purge:
    """A dataset deleted for good from the trash, with how many files and folders went."""

    dataset_id: str
    trash_id: int
    files_deleted: int


@dataclass(frozen=True)
class StorageUse:
    """Bytes a dataset holds in storage, by kind (index files include versions awaiting garbage collection)."""

    log_bytes: int
    index_bytes: int
    index_files: int
    metadata_bytes: int


@dataclass(frozen=True)
class MetadataStats:
    """Counts over the log and the live vectors; `metadata_keys` is sampled (`metadata_sampled_vectors`)."""

    log_entries: int
    log_segments: int
    upserts: int
    tombstones: int
    vectors_with_document_id: int
    distinct_document_ids: int
    vectors_with_content: int
    vectors_with_metadata: int
    metadata_keys: dict[str, int]
    metadata_sampled_vectors: int
    # Live vectors by their metadata's `language` and `content_type` (over the same sample); empty when no
    # vector's metadata has the key.
    languages: dict[str, int]
    content_types: dict[str, int]


@dataclass(frozen=True)
class IndexStats:
    """The default index: type, metric, parameters and freshness per shard."""

    index_type: str
    metric_type: str
    index_params: dict[str, Any]
    shards: tuple[ShardStatus, ...]


@dataclass(frozen=True)
class IndexBuild:
    """The serving index's build: the files a searcher loads to serve it, and its last full rebuild (a
    reindex swapped in), None when it was never rebuilt."""

    memory_usage_bytes: int
    last_rebuild_at: dt.datetime | None
    build_time_seconds: float | None


@dataclass(frozen=True)
class DatasetStats:
    """Exact live vector count, bytes in storage, metadata stats and index stats of one dataset, with the
    dataset itself (`dataset`, its summary)."""

    dataset_id: str
    vector_count: int
    storage: StorageUse
    metadata: MetadataStats
    index: IndexStats
    build: IndexBuild
    dataset: Dataset

    @property
    def storage_size(self) -> int:
        """Every byte the dataset holds: log, index files and metadata mirror."""
        return self.storage.log_bytes + self.storage.index_bytes + self.storage.metadata_bytes


@dataclass(frozen=True)
class Upserted:
    """A durable batch: how many vectors, and the write token a search can require."""

    dataset_id: str
    inserted: int
    write_token: int


@dataclass(frozen=True)
class Match:
    """One nearest vector; `score` is the metric's distance, `metadata` the vector's metadata decoded."""

    id: str | None
    score: float
    content: str | None
    metadata: Any
    document_id: str | None


@dataclass(frozen=True)
class SearchResults:
    """The nearest vectors of one dataset, nearest first (ascending score, descending if `higher_is_better`)."""

    dataset_id: str
    metric_type: str
    higher_is_better: bool
    consistency: str
    matches: tuple[Match, ...]


@dataclass(frozen=True)
class RankedMatch:
    """A merged result: its dataset, and its rank within that dataset's own results (0 = nearest)."""

    dataset_id: str
    rank: int
    match: Match


@dataclass(frozen=True)
class MultiSearchResults:
    """One query over several datasets, merged by `merge_strategy`."""

    merge_strategy: str
    dataset_ids: tuple[str, ...]
    top_k: int
    consistency: str
    matches: tuple[RankedMatch, ...]


@dataclass(frozen=True)
class ReindexStarted:
    """A reindex of a dataset's index: the job (done already when it ran in the caller)."""

    dataset_id: str
    job: JobRecord
