"""Datasets in the catalog: each is a data source row whose custom metadata carries the dataset's definition.

The data source `N` version `1` holds, under the key `MARKER` of its JSONB `custom_metadata`, the dataset's
description, metadata, metric and index type, index parameters and last update time; its `description` column
mirrors the description for the data source listings. Every query is scoped by the tenant.

The index type, parameters and metric a record carries are those of the index `N` version `1` serving now:
a reindex (or a rollback) swaps another generation in under that name in one catalog transaction, so reading
them from the serving index row is right from the moment of the swap, whichever process made it. The values
stored in the definition are the ones the dataset was created with, used only when no serving row is found.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, func, or_, select
from sqlalchemy.orm import Session

from shoal.catalog.locks import lock_source
from shoal.catalog.models import (
    DataSource,
    Index,
    IndexFile,
    IndexShard,
    IndexVersion,
    LogSegment,
    ReindexJob,
    Tenant,
)
from shoal.datasets.errors import not_found
from shoal.datasets.rules import VERSION
from shoal.log.records import DATASET_KEY, GENERATION_MARK

if TYPE_CHECKING:  # only a type here: shoal.client reaches this module through the reindex's mirror refresh
    from shoal.client import Shoal

MARKER = DATASET_KEY  # key of the dataset definition inside the data source's custom metadata
FORMAT = 1  # version of the definition's layout


@dataclass(frozen=True)
class DatasetRecord:
    """A dataset's catalog entry: what the API caches (live counters are not part of it)."""

    name: str
    source_id: int
    description: str | None
    metadata: dict[str, Any] | None
    dimensions: int
    metric_type: str
    index_type: str
    index_params: dict[str, Any]
    created_at: dt.datetime
    updated_at: dt.datetime

    def to_json(self) -> dict[str, Any]:
        """JSON-ready (timestamps in ISO 8601, UTC)."""
        return {
            "name": self.name,
            "source_id": self.source_id,
            "description": self.description,
            "metadata": self.metadata,
            "dimensions": self.dimensions,
            "metric_type": self.metric_type,
            "index_type": self.index_type,
            "index_params": self.index_params,
            "created_at": self.created_at.isoformat(),
            "updated_at": self.updated_at.isoformat(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DatasetRecord:
        """The inverse of `to_json`."""
        return cls(
            name=data["name"],
            source_id=int(data["source_id"]),
            description=data["description"],
            metadata=data["metadata"],
            dimensions=int(data["dimensions"]),
            metric_type=data["metric_type"],
            index_type=data["index_type"],
            index_params=dict(data["index_params"]),
            created_at=dt.datetime.fromisoformat(data["created_at"]),
            updated_at=dt.datetime.fromisoformat(data["updated_at"]),
        )

    def serving(self, index: ServingIndex | None) -> DatasetRecord:
        """The record with the definition of the index serving it (itself when there is none)."""
        if index is None:
            return self
        return dataclasses.replace(self, index_type=index.algorithm, metric_type=index.metric,
                                   index_params=dict(index.params))


@dataclass(frozen=True)
class ServingIndex:
    """The definition of the generation a dataset's index serves now."""

    algorithm: str
    metric: str
    params: dict[str, Any]


def serving_indexes(session: Session, source_ids: Iterable[int]) -> dict[int, ServingIndex]:
    """The serving definition of each dataset's default index (`N` version `1` of the source named N), by data
    source id; sources without one are left out. One query."""
    ids = sorted(set(source_ids))
    if not ids:
        return {}
    rows = session.execute(
        select(Index.data_source_id, Index.algorithm, Index.metric, Index.params)
        .join(DataSource, DataSource.id == Index.data_source_id)
        .where(Index.data_source_id.in_(ids), Index.version == VERSION, Index.name == DataSource.name,
               Index.tenant_id == DataSource.tenant_id)
    )
    return {r[0]: ServingIndex(r[1], r[2], dict(r[3] or {})) for r in rows}


@dataclass(frozen=True)
class LogTotals:
    """Sums over a data source's committed log segments."""

    segments: int = 0
    upserts: int = 0
    tombstones: int = 0
    bytes: int = 0
    head: int = 0  # the last committed seq (0: an empty log)

    @property
    def estimated_vector_count(self) -> int:
        """Upserts minus tombstones: exact while every id is written once and only live ids are deleted;
        re-upserted ids count once per write. O(1) per dataset from the catalog."""
        return max(0, self.upserts - self.tombstones)


def definition(
    description: str | None,
    metadata: dict[str, Any] | None,
    metric_type: str,
    index_type: str,
    index_params: dict[str, Any],
    updated_at: dt.datetime | None = None,
) -> dict[str, Any]:
    """The dataset definition as stored under `MARKER`."""
    return {
        "format": FORMAT,
        "description": description,
        "metadata": metadata,
        "metric_type": metric_type,
        "index_type": index_type,
        "index_params": index_params,
        "updated_at": updated_at.isoformat() if updated_at else None,
    }


def _records(session: Session, rows: Sequence[DataSource]) -> list[DatasetRecord]:
    """The records of dataset rows, each with the definition its index serves now (one more query)."""
    serving = serving_indexes(session, [r.id for r in rows])
    return [_record(r).serving(serving.get(r.id)) for r in rows]


def _record(row: DataSource) -> DatasetRecord:
    d = row.custom_metadata[MARKER]
    updated = d.get("updated_at")
    return DatasetRecord(
        name=row.name,
        source_id=row.id,
        description=d.get("description"),
        metadata=d.get("metadata"),
        dimensions=row.vector_dimension,
        metric_type=d["metric_type"],
        index_type=d["index_type"],
        index_params=dict(d.get("index_params") or {}),
        created_at=row.created_at.astimezone(dt.UTC),
        updated_at=dt.datetime.fromisoformat(updated) if updated else row.created_at.astimezone(dt.UTC),
    )


@dataclass(frozen=True)
class TrashedDataset:
    """A dataset in the trash: its entry, when it was deleted and when the purge may delete it for good."""

    record: DatasetRecord
    deleted_at: dt.datetime
    purge_after: dt.datetime


def _trashed(session: Session, rows: Sequence[DataSource]) -> list[TrashedDataset]:
    out = []
    for row, record in zip(rows, _records(session, rows), strict=True):
        assert row.deleted_at is not None and row.purge_after is not None
        out.append(TrashedDataset(record, row.deleted_at.astimezone(dt.UTC), row.purge_after.astimezone(dt.UTC)))
    return out


def live_dataset(engine: Engine, source_id: int) -> tuple[str, DatasetRecord] | None:
    """(tenant name, record) of the live (not trashed) dataset whose data source is `source_id`; None when that
    source is no dataset, is in the trash or is gone. For callers outside a tenant's scope (a reindex's swap)."""
    with Session(engine) as s:
        found = s.execute(
            select(DataSource, Tenant.name)
            .join(Tenant, Tenant.id == DataSource.tenant_id)
            .where(DataSource.id == source_id, DataSource.version == VERSION, DataSource.deleted_at.is_(None),
                   DataSource.custom_metadata.has_key(MARKER))
        ).one_or_none()
        if found is None:
            return None
        row, tenant = found
        return tenant, _records(s, [row])[0]


class DatasetCatalog:
    """The datasets of the tenant a Shoal client is scoped to."""

    def __init__(self, shoal: Shoal) -> None:
        self.engine = shoal.engine
        self.tenant_id = shoal.catalog.tenant_id

    def _datasets(self, *, trashed: bool = False) -> Any:
        return select(DataSource).where(
            DataSource.tenant_id == self.tenant_id,
            DataSource.version == VERSION,
            DataSource.custom_metadata.has_key(MARKER),
            DataSource.deleted_at.is_not(None) if trashed else DataSource.deleted_at.is_(None),
        )

    def find(self, name: str) -> DatasetRecord | None:
        """The dataset, or None."""
        with Session(self.engine) as s:
            row = s.scalars(self._datasets().where(DataSource.name == name)).one_or_none()
            return _records(s, [row])[0] if row is not None else None

    def get(self, name: str) -> DatasetRecord:
        """The dataset, or DATASET_NOT_FOUND."""
        record = self.find(name)
        if record is None:
            raise not_found(name)
        return record

    def page(self, limit: int, offset: int) -> tuple[list[DatasetRecord], int]:
        """Datasets by name, `limit` of them from `offset`, and how many there are in all."""
        with Session(self.engine) as s:
            total = s.scalar(select(func.count()).select_from(self._datasets().subquery())) or 0
            if offset >= total:  # also keeps offsets beyond Postgres' bigint out of the query
                return [], int(total)
            rows = s.scalars(self._datasets().order_by(DataSource.name).limit(limit).offset(offset)).all()
            return _records(s, rows), int(total)

    def trash_page(self, limit: int, offset: int) -> tuple[list[TrashedDataset], int]:
        """Datasets in the trash, most recently deleted first, `limit` of them from `offset`, and the total."""
        with Session(self.engine) as s:
            q = self._datasets(trashed=True)
            total = s.scalar(select(func.count()).select_from(q.subquery())) or 0
            if offset >= total:
                return [], int(total)
            rows = s.scalars(
                q.order_by(DataSource.deleted_at.desc(), DataSource.id.desc()).limit(limit).offset(offset)
            ).all()
            return _trashed(s, rows), int(total)

    def trashed(self, name: str) -> list[TrashedDataset]:
        """The datasets named `name` in the trash, most recently deleted first."""
        with Session(self.engine) as s:
            rows = s.scalars(
                self._datasets(trashed=True)
                .where(DataSource.name == name)
                .order_by(DataSource.deleted_at.desc(), DataSource.id.desc())
            ).all()
            return _trashed(s, rows)

    def update(self, name: str, changes: dict[str, Any]) -> DatasetRecord:
        """Set the description and/or metadata given in `changes` (row-locked read, modify, write)."""
        with Session(self.engine) as s, s.begin():
            found = s.scalars(self._datasets().where(DataSource.name == name)).one_or_none()
            # Locked, then read again: the read-modify-write below must see the latest metadata.
            locked = lock_source(s, found.id, missing_ok=True) if found is not None else None
            row = s.get(DataSource, locked.id, populate_existing=True) if locked is not None else None
            if row is None or row.deleted_at is not None:  # dropped or trashed before the lock was ours
                raise not_found(name)
            d = dict(row.custom_metadata[MARKER])
            d.update(changes)
            d["updated_at"] = dt.datetime.now(dt.UTC).isoformat()
            row.custom_metadata = {**row.custom_metadata, MARKER: d}
            if "description" in changes:
                row.description = changes["description"] or ""
            s.flush()
            return _records(s, [row])[0]

    def serving(self, source_ids: list[int]) -> dict[int, ServingIndex]:
        """The definition each dataset's index serves now, by data source id (one query)."""
        with Session(self.engine) as s:
            return serving_indexes(s, source_ids)

    def log_totals(self, source_ids: list[int]) -> dict[int, LogTotals]:
        """Segment count, upserts, tombstones and bytes per data source, in one query."""
        if not source_ids:
            return {}
        with Session(self.engine) as s:
            rows = s.execute(
                select(
                    LogSegment.data_source_id,
                    func.count(),
                    func.coalesce(func.sum(LogSegment.upsert_count), 0),
                    func.coalesce(func.sum(LogSegment.tombstone_count), 0),
                    func.coalesce(func.sum(LogSegment.bytes), 0),
                    func.coalesce(func.max(LogSegment.last_seq), 0),
                )
                .where(LogSegment.data_source_id.in_(source_ids))
                .group_by(LogSegment.data_source_id)
            )
            return {r[0]: LogTotals(int(r[1]), int(r[2]), int(r[3]), int(r[4]), int(r[5])) for r in rows}

    def last_rebuild(self, name: str) -> tuple[dt.datetime, dt.datetime] | None:
        """(started, finished) of the reindex that built the generation serving the dataset's index, None when
        that generation was never rebuilt (the dataset's first)."""
        with Session(self.engine) as s:
            row = s.execute(
                select(ReindexJob.created_at, ReindexJob.finished_at)
                .join(Index, Index.id == ReindexJob.to_index_id)
                .where(ReindexJob.tenant_id == self.tenant_id, Index.tenant_id == self.tenant_id,
                       Index.name == name, Index.version == VERSION, Index.deleted_at.is_(None),
                       ReindexJob.finished_at.is_not(None))
                .order_by(ReindexJob.finished_at.desc()).limit(1)
            ).one_or_none()
            if row is None:
                return None
            return row[0].astimezone(dt.UTC), row[1].astimezone(dt.UTC)

    def served_files(self, name: str) -> list[str]:
        """The layout-relative paths of the files the versions serving the dataset's index reference (what a
        searcher loads to serve it)."""
        with Session(self.engine) as s:
            rows = s.scalars(
                select(IndexFile.path)
                .join(IndexShard, IndexShard.active_version_id == IndexFile.version_id)
                .join(Index, Index.id == IndexShard.index_id)
                .where(Index.tenant_id == self.tenant_id, Index.name == name, Index.version == VERSION,
                       Index.deleted_at.is_(None))
            )
            return sorted(set(rows))

    def index_files(self, source_id: int, name: str) -> set[str]:
        """The layout-relative paths of the files the catalog's index versions reference for every generation
        of the dataset's index (`name` version `1` and its hidden `1~g{n}` generations) over its data source
        `source_id`: serving, being built, kept for rollback. One query. An index of the same name over another
        source (a trashed or dropped dataset's, whose files share the folders) is not the dataset's."""
        with Session(self.engine) as s:
            rows = s.scalars(
                select(IndexFile.path)
                .join(IndexVersion, IndexVersion.id == IndexFile.version_id)
                .join(IndexShard, IndexShard.id == IndexVersion.shard_id)
                .join(Index, Index.id == IndexShard.index_id)
                .where(Index.tenant_id == self.tenant_id, Index.data_source_id == source_id, Index.name == name,
                       or_(Index.version == VERSION,
                           Index.version.startswith(VERSION + GENERATION_MARK, autoescape=True)))
            )
            return set(rows)
