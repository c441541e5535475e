"""The catalog's tables as SQLAlchemy 2 typed models. The schema itself is made only by Alembic."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy import Index as SqlIndex
from sqlalchemy.dialects.postgresql import JSON, JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


def _now() -> Any:
    return func.now()


class Tenant(Base):
    """An isolated owner of data sources; its name prefixes every storage path it owns."""

    __tablename__ = "tenants"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=_now())


class DataSource(Base):
    """A data source's definition and its log head (the pointer row that commits move by compare-and-swap)."""

    __tablename__ = "data_sources"
    __table_args__ = (
        # Names are unique among live rows only: a soft-deleted source's name is free for reuse (migration 0004).
        SqlIndex(
            "uq_data_sources_tenant_name_version", "tenant_id", "name", "version",
            unique=True, postgresql_where=text("deleted_at IS NULL"),
        ),
        SqlIndex("ix_data_sources_purge_after", "purge_after", postgresql_where=text("deleted_at IS NOT NULL")),
        CheckConstraint("vector_dimension BETWEEN 1 AND 10000", name="dimension_range"),
        CheckConstraint("head_seq >= 0", name="head_non_negative"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(100))
    version: Mapped[str] = mapped_column(String(100))
    vector_dimension: Mapped[int] = mapped_column(Integer)
    vectors_are_sparse: Mapped[bool] = mapped_column(Boolean)
    # JSON, not JSONB: JSONB re-sorts object keys, and the attribute order is the schema's column order.
    attribute_types: Mapped[dict[str, str]] = mapped_column(JSON)
    permanent_attributes: Mapped[list[str]] = mapped_column(JSONB)
    description: Mapped[str] = mapped_column(Text, server_default="")
    custom_metadata: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default="{}")
    head_seq: Mapped[int] = mapped_column(BigInteger, server_default="0")
    head_committed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    # In the trash since (None: live), and when the purge may delete it for good.
    deleted_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    purge_after: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))


class LogSegment(Base):
    """One immutable Parquet file of the log and the seq range it holds."""

    __tablename__ = "log_segments"
    __table_args__ = (
        UniqueConstraint("data_source_id", "first_seq", name="uq_log_segments_source_first_seq"),
        CheckConstraint("last_seq >= first_seq", name="seq_range"),
        # At most one entry per seq: a commit writes every seq of its range, a compaction keeps a subset (0005).
        CheckConstraint("upsert_count + tombstone_count <= last_seq - first_seq + 1", name="entry_count"),
    )

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    data_source_id: Mapped[int] = mapped_column(ForeignKey("data_sources.id", ondelete="CASCADE"))
    first_seq: Mapped[int] = mapped_column(BigInteger)
    last_seq: Mapped[int] = mapped_column(BigInteger)
    upsert_count: Mapped[int] = mapped_column(BigInteger)
    tombstone_count: Mapped[int] = mapped_column(BigInteger)
    bytes: Mapped[int] = mapped_column(BigInteger)
    checksum: Mapped[str] = mapped_column(String(80))
    path: Mapped[str] = mapped_column(Text, unique=True)
    committed_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=_now())


class ProducerBatch(Base):
    """A producer's batch id that committed, and its token: a repeat returns the token and writes nothing."""

    __tablename__ = "producer_batches"

    data_source_id: Mapped[int] = mapped_column(
        ForeignKey("data_sources.id", ondelete="CASCADE"), primary_key=True
    )
    batch_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    first_seq: Mapped[int] = mapped_column(BigInteger)
    last_seq: Mapped[int] = mapped_column(BigInteger)
    segment_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("log_segments.id", ondelete="CASCADE"), index=True
    )
    committed_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    # The batch's content hash (shoal.log.writer.batch_fingerprint): a repeat must match it, another batch under
    # the id is refused. NULL for batches committed before it was recorded (any repeat is taken) and for
    # Shoal's own retention batches.
    fingerprint: Mapped[str | None] = mapped_column(String(80), nullable=True)


class LogCompaction(Base):
    """A data source's last log compaction: how far it reached and what it did (what the sweep decides by)."""

    __tablename__ = "log_compactions"

    data_source_id: Mapped[int] = mapped_column(
        ForeignKey("data_sources.id", ondelete="CASCADE"), primary_key=True
    )
    compacted_through: Mapped[int] = mapped_column(BigInteger)  # the highest seq a run could touch (never lowered)
    # The highest bound of a run that dropped entries: time travel below it may need what was dropped.
    dropped_through: Mapped[int] = mapped_column(BigInteger, server_default="0")
    compacted_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    runs: Mapped[int] = mapped_column(BigInteger, server_default="0")
    segments_before: Mapped[int] = mapped_column(BigInteger, server_default="0")
    segments_after: Mapped[int] = mapped_column(BigInteger, server_default="0")
    entries_dropped: Mapped[int] = mapped_column(BigInteger, server_default="0")


class GarbageFile(Base):
    """A storage file no catalog row references: queued for deletion after its grace period, and the log of
    that deletion (`deleted_at` is set when it went). Paths are layout-relative, so they carry the tenant."""

    __tablename__ = "garbage_files"
    __table_args__ = (
        # The queue and the deletion log share the table, and the log is most of it (a row per deleted file for
        # 30 days): GC's reads of each go through an index of its own rows, not a scan of both.
        SqlIndex("ix_garbage_files_queued", "delete_after", "id", postgresql_where=text("deleted_at IS NULL")),
        SqlIndex("ix_garbage_files_deleted_at", "deleted_at", postgresql_where=text("deleted_at IS NOT NULL")),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    path: Mapped[str] = mapped_column(Text, unique=True)
    reason: Mapped[str] = mapped_column(String(40))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    delete_after: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    deleted_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))


class Index(Base):
    """An index definition: a queryable materialization of one data source, split into shards."""

    __tablename__ = "indexes"
    __table_args__ = (
        SqlIndex(
            "uq_indexes_tenant_name_version", "tenant_id", "name", "version",
            unique=True, postgresql_where=text("deleted_at IS NULL"),
        ),
        CheckConstraint("shard_count BETWEEN 1 AND 1024", name="shard_count_range"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    data_source_id: Mapped[int] = mapped_column(ForeignKey("data_sources.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(100))
    version: Mapped[str] = mapped_column(String(100))
    algorithm: Mapped[str] = mapped_column(String(40))
    metric: Mapped[str] = mapped_column(String(40))
    params: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default="{}")
    # JSON (ordered lists); the order of id and split attributes is part of the definition.
    id_attributes: Mapped[list[str]] = mapped_column(JSON)
    split_attributes: Mapped[list[str]] = mapped_column(JSON)
    shard_attributes: Mapped[list[str]] = mapped_column(JSON)
    payload_attributes: Mapped[list[str]] = mapped_column(JSON)
    shard_count: Mapped[int] = mapped_column(Integer)
    generation: Mapped[int] = mapped_column(Integer, server_default="1")
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    deleted_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))  # in the trash with its source


class IndexShard(Base):
    """One shard of an index: its active pointer (moved only by compare-and-swap), freshness and lease."""

    __tablename__ = "index_shards"
    __table_args__ = (UniqueConstraint("index_id", "shard_no", name="uq_index_shards_index_shard_no"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    index_id: Mapped[int] = mapped_column(ForeignKey("indexes.id", ondelete="CASCADE"))
    shard_no: Mapped[int] = mapped_column(Integer)
    # No foreign key: versions reference their shard, and a cycle would complicate dropping an index.
    active_version_id: Mapped[int | None] = mapped_column(BigInteger)
    built_watermark: Mapped[int] = mapped_column(BigInteger, server_default="0")
    served_watermark: Mapped[int] = mapped_column(BigInteger, server_default="0")
    served_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    lease_owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))


class IndexVersion(Base):
    """An immutable manifest of one shard: its segments, their deletions, and the watermark it reflects."""

    __tablename__ = "index_versions"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    shard_id: Mapped[int] = mapped_column(ForeignKey("index_shards.id", ondelete="CASCADE"), index=True)
    parent_id: Mapped[int | None] = mapped_column(BigInteger)
    generation: Mapped[int] = mapped_column(Integer)
    watermark: Mapped[int] = mapped_column(BigInteger)
    manifest: Mapped[dict[str, Any]] = mapped_column(JSONB)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=_now())


class IndexFile(Base):
    """A file an index version references (its segments' rows and engine files, its deletion files), written in
    the transaction that publishes the version and deleted with it (cascade): GC's reference check for index
    files is a lookup here, not a scan of manifests."""

    __tablename__ = "index_files"

    version_id: Mapped[int] = mapped_column(ForeignKey("index_versions.id", ondelete="CASCADE"), primary_key=True)
    path: Mapped[str] = mapped_column(Text, primary_key=True, index=True)


class ApiKey(Base):
    """An API key of a tenant: its public key id, a salted hash of its secret (never the secret), its role."""

    __tablename__ = "api_keys"
    __table_args__ = (CheckConstraint("role IN ('read', 'write', 'admin')", name="role"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    # The public part of the key, shown in listings and logs; looked up on every cache miss.
    key_id: Mapped[str] = mapped_column(String(32), unique=True)
    # Self-describing ("scrypt$n$r$p$salt$hash") so the KDF's cost can change without a migration.
    secret_hash: Mapped[str] = mapped_column(String(255))
    role: Mapped[str] = mapped_column(String(10))
    name: Mapped[str] = mapped_column(String(200), server_default="")
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    last_used_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))


class IndexAlias(Base):
    """A tenant's name for one index: searches may name it; moving it is one atomic UPDATE of `index_id`."""

    __tablename__ = "index_aliases"

    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    # Dropping the index drops the aliases naming it (a search by such an alias then says it is not found).
    index_id: Mapped[int] = mapped_column(ForeignKey("indexes.id", ondelete="CASCADE"), index=True)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=_now())


class ReindexJob(Base):
    """A reindex: a new generation of an index built aside, checked and swapped in (or failed, cancelled,
    rolled back). The index rows themselves are generations (shoal.index.generations)."""

    __tablename__ = "reindex_jobs"
    __table_args__ = (
        CheckConstraint(
            "state IN ('building', 'swapped', 'failed', 'cancelled', 'rolled_back')", name="reindex_state"
        ),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    tenant_id: Mapped[int] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    index_name: Mapped[str] = mapped_column(String(100))
    index_version: Mapped[str] = mapped_column(String(100))
    # The generation serving when the job started, and the one it builds (rows may go later: SET NULL).
    from_index_id: Mapped[int | None] = mapped_column(ForeignKey("indexes.id", ondelete="SET NULL"), index=True)
    to_index_id: Mapped[int | None] = mapped_column(ForeignKey("indexes.id", ondelete="SET NULL"), index=True)
    state: Mapped[str] = mapped_column(String(12))
    progress: Mapped[float] = mapped_column(Float, server_default="0")
    eta_s: Mapped[float | None] = mapped_column(Float)
    recall: Mapped[float | None] = mapped_column(Float)
    gate: Mapped[float] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)
    definition: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default="{}")
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))


class IndexTag(Base):
    """A named moment of an index: the version each shard served when it was tagged. Tagged versions are kept
    (version pruning skips them) and a search may name the tag to query exactly those versions."""

    __tablename__ = "index_tags"

    index_id: Mapped[int] = mapped_column(ForeignKey("indexes.id", ondelete="CASCADE"), primary_key=True)
    tag: Mapped[str] = mapped_column(String(100), primary_key=True)
    versions: Mapped[dict[str, Any]] = mapped_column(JSONB)  # shard id (text) -> version id, or null when empty
    # The seq the tag stands for: the highest watermark among its versions (a search answers the log state there,
    # the shards built less far reading the log up to it). None: taken before it was recorded (migration 0012).
    seq: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=_now())


class CatalogIdentity(Base):
    """The catalog's identity: one row (`one` is always true) with a random id made by migration 0013. The
    storage's marker names it (shoal.storage.identity): a storage belongs to exactly one catalog."""

    __tablename__ = "catalog_identity"
    __table_args__ = (CheckConstraint("one", name="one_row"),)

    one: Mapped[bool] = mapped_column(Boolean, primary_key=True, server_default=text("true"))
    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), server_default=_now())
