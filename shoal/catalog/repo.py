"""Catalog reads and definition changes, every one scoped by tenant."""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass

from sqlalchemy import Engine, exists, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from shoal.catalog.models import DataSource, Index, LogSegment, Tenant
from shoal.errors import AlreadyExistsError, NotFoundError
from shoal.log.records import DataSourceSpec, check_tenant_name


@dataclass(frozen=True)
class SourceRecord:
    """A data source as the catalog holds it: identity, definition and log head."""

    id: int
    tenant: str
    spec: DataSourceSpec
    head_seq: int
    head_committed_at: dt.datetime | None
    created_at: dt.datetime


@dataclass(frozen=True)
class SegmentRecord:
    """One committed log segment."""

    id: uuid.UUID
    first_seq: int
    last_seq: int
    upsert_count: int
    tombstone_count: int
    bytes: int
    checksum: str
    path: str
    committed_at: dt.datetime


def _spec(row: DataSource) -> DataSourceSpec:
    return DataSourceSpec(
        name=row.name,
        version=row.version,
        vector_dimension=row.vector_dimension,
        vectors_are_sparse=row.vectors_are_sparse,
        attribute_types=row.attribute_types,  # type: ignore[arg-type]
        permanent_attributes=row.permanent_attributes,
        description=row.description,
        custom_metadata=row.custom_metadata,
    )


def _record(row: DataSource, tenant: str) -> SourceRecord:
    return SourceRecord(row.id, tenant, _spec(row), row.head_seq, row.head_committed_at, row.created_at)


def _segment(row: LogSegment) -> SegmentRecord:
    return SegmentRecord(
        row.id, row.first_seq, row.last_seq, row.upsert_count, row.tombstone_count, row.bytes,
        row.checksum, row.path, row.committed_at,
    )



def tenant_exists(engine: Engine, name: str) -> bool:
    """Whether the catalog holds the tenant `name` (a lookup that creates nothing)."""
    with Session(engine) as s:
        return s.scalar(select(Tenant.id).where(Tenant.name == name)) is not None


class Catalog:
    """Repository over the catalog tables for one tenant."""

    def __init__(self, engine: Engine, tenant: str) -> None:
        self.engine = engine
        self.tenant = check_tenant_name(tenant)
        self.tenant_id = self._ensure_tenant()

    def _ensure_tenant(self) -> int:
        with Session(self.engine) as s, s.begin():
            s.execute(insert(Tenant).values(name=self.tenant).on_conflict_do_nothing(index_elements=["name"]))
            return s.scalars(select(Tenant.id).where(Tenant.name == self.tenant)).one()

    def _row(self, s: Session, name: str, version: str) -> DataSource:
        row = s.scalars(
            select(DataSource).where(
                DataSource.tenant_id == self.tenant_id,
                DataSource.name == name,
                DataSource.version == version,
                DataSource.deleted_at.is_(None),  # a source in the trash is not found, as a missing one
            )
        ).one_or_none()
        if row is None:
            raise NotFoundError(f"data source {name!r} version {version!r} not found in tenant {self.tenant!r}")
        return row

    def create_data_source(self, spec: DataSourceSpec, *, exist_ok: bool = False) -> SourceRecord:
        """Create the data source; with `exist_ok`, an identical definition already there is returned."""
        spec.check_storable()  # before anything is written: metadata every reader can answer with
        with Session(self.engine) as s, s.begin():
            stmt = (
                insert(DataSource)
                .values(
                    tenant_id=self.tenant_id,
                    name=spec.name,
                    version=spec.version,
                    vector_dimension=spec.vector_dimension,
                    vectors_are_sparse=spec.vectors_are_sparse,
                    attribute_types={k: v.value for k, v in spec.attribute_types.items()},
                    permanent_attributes=list(spec.permanent_attributes),
                    description=spec.description,
                    custom_metadata=dict(spec.custom_metadata),
                )
                .on_conflict_do_nothing(
                    index_elements=["tenant_id", "name", "version"], index_where=DataSource.deleted_at.is_(None)
                )
                .returning(DataSource.id)
            )
            created = s.execute(stmt).scalar_one_or_none()
        record = self.get_data_source(spec.name, spec.version)
        if created is None:
            if not exist_ok:
                raise AlreadyExistsError(f"data source {spec.name!r} version {spec.version!r} already exists")
            if not record.spec.same_definition(spec):
                raise AlreadyExistsError(
                    f"data source {spec.name!r} version {spec.version!r} exists with another definition"
                )
        return record

    def get_data_source(self, name: str, version: str) -> SourceRecord:
        """The data source, or NotFoundError."""
        with Session(self.engine) as s:
            return _record(self._row(s, name, version), self.tenant)

    def list_data_sources(self) -> list[SourceRecord]:
        """Every live data source of the tenant (none in the trash), by name and version."""
        with Session(self.engine) as s:
            rows = s.scalars(
                select(DataSource)
                .where(DataSource.tenant_id == self.tenant_id, DataSource.deleted_at.is_(None))
                .order_by(DataSource.name, DataSource.version)
            ).all()
            return [_record(r, self.tenant) for r in rows]

    def segments(self, source_id: int, after_seq: int = 0, up_to_seq: int | None = None) -> list[SegmentRecord]:
        """Committed segments holding any seq in (after_seq, up_to_seq], in seq order."""
        return list_segments(self.engine, source_id, after_seq, up_to_seq)


def list_segments(
    engine: Engine, source_id: int, after_seq: int = 0, up_to_seq: int | None = None
) -> list[SegmentRecord]:
    """Committed segments of a data source holding any seq in (after_seq, up_to_seq], in seq order."""
    with Session(engine) as s:
        q = select(LogSegment).where(LogSegment.data_source_id == source_id, LogSegment.last_seq > after_seq)
        if up_to_seq is not None:
            q = q.where(LogSegment.first_seq <= up_to_seq)
        return [_segment(r) for r in s.scalars(q.order_by(LogSegment.first_seq))]


def seqs_committed_within(engine: Engine, source_id: int, seconds: float) -> int:
    """How many seqs the data source's commits added in the last `seconds`, by the catalog's clock (the one its
    commits are stamped with; compacted segments keep their oldest stamp, so they do not count as new)."""
    with Session(engine) as s:
        total = s.execute(
            select(func.coalesce(func.sum(LogSegment.last_seq - LogSegment.first_seq + 1), 0)).where(
                LogSegment.data_source_id == source_id,
                LogSegment.committed_at > func.clock_timestamp() - dt.timedelta(seconds=seconds),
            )
        ).scalar_one()
        return int(total)


def head_of(engine: Engine, source_id: int, index_id: int | None = None) -> tuple[int, dt.datetime | None]:
    """The data source's head seq and when it last moved; NotFoundError if the source is gone, or (`index_id`
    given) if that index or the source is gone or in the trash: a searcher's strong read learns of a drop (or a
    move to the trash) of the index it serves in the same query (the source outlives an index dropped, or
    dropped and made again under its name)."""
    query = select(DataSource.head_seq, DataSource.head_committed_at).where(DataSource.id == source_id)
    if index_id is not None:
        # A search's read: an index, or its source, in the trash is gone for it as one dropped is.
        query = query.add_columns(exists().where(Index.id == index_id, Index.deleted_at.is_(None))).where(
            DataSource.deleted_at.is_(None))
    with Session(engine) as s:
        row = s.execute(query).one_or_none()
        if row is None:
            raise NotFoundError(f"data source {source_id} not found")
        if index_id is not None and not row[2]:
            raise NotFoundError(f"index {index_id} not found")
        return int(row[0]), row[1]
