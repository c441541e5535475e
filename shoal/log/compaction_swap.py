"""Catalog side of log compaction: how far a compaction may reach, and the one transaction that swaps segments.

Compaction never touches a seq above the lowest watermark of the indexes over the data source: every
shard's built watermark and, once a searcher served the shard, its served watermark (a searcher scans the
log tail above what it serves). Below that watermark every reader of the log either reads from seq 0 (a new
index, a fold) or not at all, so replacing segments there changes nothing a reader can observe.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy import BigInteger, Connection, Engine, case, cast, delete, func, select, true
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from shoal.catalog.locks import lock_source
from shoal.catalog.models import (
    DataSource,
    GarbageFile,
    Index,
    IndexShard,
    IndexTag,
    IndexVersion,
    LogCompaction,
    LogSegment,
    ProducerBatch,
    Tenant,
)
from shoal.catalog.repo import SourceRecord, _record
from shoal.errors import ConflictError, NotFoundError
from shoal.upkeep.gc_queue import deleted_among

# Garbage reasons: why a file was queued for deletion (the deletion log shows them).
COMPACTED = "compacted"


@dataclass(frozen=True)
class NewSegment:
    """A compacted segment file, durable in storage, and the seq range it covers."""

    id: uuid.UUID
    path: str
    first_seq: int
    last_seq: int
    upserts: int
    tombstones: int
    bytes: int
    checksum: str
    committed_at: dt.datetime


@dataclass(frozen=True)
class Replacement:
    """Old segments (adjacent, together covering new.first_seq..new.last_seq) and the segment replacing them."""

    old_ids: tuple[uuid.UUID, ...]
    old_paths: tuple[str, ...]
    new: NewSegment


@dataclass(frozen=True)
class CompactionState:
    """What the sweep knows of a data source: its head, how far compaction may reach, how far it last did."""

    source_id: int
    head: int
    limit: int  # the lowest watermark (the head when no index reads the source)
    compacted_through: int
    compacted_at: dt.datetime | None
    segments_above: int  # segments committed past compacted_through, up to the limit
    tombstones_below: int  # tombstones left in segments up to compacted_through
    # When the oldest segment past compacted_through (up to the limit) holding tombstones was committed (None:
    # none holds any): retention's deletions among them, on a source too quiet to reach the size triggers.
    tombstones_above_since: dt.datetime | None = None


def load_source(engine: Engine, source_id: int) -> SourceRecord:
    """The data source by id, with its tenant's name; NotFoundError when it is gone."""
    with Session(engine) as s:
        row = s.get(DataSource, source_id)
        if row is None:
            raise NotFoundError(f"data source {source_id} not found")
        tenant = s.scalars(select(Tenant.name).where(Tenant.id == row.tenant_id)).one()
        return _record(row, tenant)


def sources_with_metadata(engine: Engine, key: str, dataset_marker: str) -> list[SourceRecord]:
    """Every live data source (of every tenant) whose custom metadata has `key`, at the top or in its dataset's
    metadata (`custom_metadata[dataset_marker]["metadata"]`). One in the trash is left out: nothing changes it
    there (a sweep would only read its log and fail on it, every run)."""
    meta = DataSource.custom_metadata
    with Session(engine) as s:
        rows = s.execute(
            select(DataSource, Tenant.name)
            .join(Tenant, Tenant.id == DataSource.tenant_id)
            .where(meta.has_key(key) | meta[dataset_marker]["metadata"].has_key(key), DataSource.deleted_at.is_(None))
            .order_by(DataSource.id)
        ).all()
        return [_record(row, tenant) for row, tenant in rows]


def _lowest_watermark_expr(source_id_column: object) -> object:
    # A shard nobody has served yet (served_at NULL) is bounded by its built watermark only: no searcher
    # scans a tail for it. A served shard by the lower of the two.
    served = case((IndexShard.served_at.is_(None), IndexShard.built_watermark), else_=IndexShard.served_watermark)
    shards = (
        select(func.min(func.least(IndexShard.built_watermark, served)))
        .join(Index, Index.id == IndexShard.index_id)
        .where(Index.data_source_id == source_id_column)
        .scalar_subquery()
    )
    # A tag stands for one seq (index_tags.seq); a shard it pinned below that seq is answered with the log from
    # the pinned version's watermark up to it, so that stretch of the log is kept as long as the tag is (a shard
    # pinned with no version at all reads it from the start).
    pinned = func.jsonb_each_text(IndexTag.versions).table_valued("key", "value").alias("pinned")
    watermark = func.coalesce(IndexVersion.watermark, 0)
    tags = (
        select(func.min(watermark))
        .select_from(IndexTag)
        .join(Index, Index.id == IndexTag.index_id)
        .join(pinned, true())
        .outerjoin(IndexVersion, IndexVersion.id == cast(pinned.c.value, BigInteger))
        .where(Index.data_source_id == source_id_column, IndexTag.seq.is_not(None), watermark < IndexTag.seq)
        .scalar_subquery()
    )
    return func.least(shards, tags)  # Postgres' LEAST skips NULLs: no tag holding back, the shards' bound


def lowest_watermark(engine: Engine, source_id: int) -> int | None:
    """The lowest watermark any index over the source still needs the log above, None when no index reads it.

    Every index shard counts (of every index and generation over the source, live or in the trash), with
    the lower of its built and (once served) served watermarks, and so does every tag's lowest pinned watermark
    below the seq it stands for. This is the one place that decides how far
    compaction may reach: anything that will read the log from an older seq must be counted here.
    """
    with Session(engine) as s:
        value = s.execute(select(_lowest_watermark_expr(source_id))).scalar_one_or_none()  # type: ignore[arg-type]
        return None if value is None else int(value)


def dropped_through(engine: Engine, source_id: int) -> int:
    """The highest bound of a compaction of the source that dropped entries (0: none did). A log read from below
    it up to a seq below it misses entries that were superseded later: the state it shows never existed."""
    with engine.connect() as conn:
        found = conn.execute(
            select(LogCompaction.dropped_through).where(LogCompaction.data_source_id == source_id)
        ).scalar_one_or_none()
    return int(found or 0)


def compaction_states(engine: Engine, source_ids: Sequence[int] | None = None) -> list[CompactionState]:
    """The compaction state of every live data source (of `source_ids` when given), for the sweep. A source in
    the trash is left out: nothing changes it there, and a purge or a restore decides what becomes of it."""
    low = _lowest_watermark_expr(DataSource.id)
    with Session(engine) as s:
        q = select(
            DataSource.id, DataSource.head_seq, low, LogCompaction.compacted_through, LogCompaction.compacted_at
        ).outerjoin(LogCompaction, LogCompaction.data_source_id == DataSource.id).where(DataSource.deleted_at.is_(None))
        if source_ids is not None:
            q = q.where(DataSource.id.in_(list(source_ids)))
        rows = s.execute(q.order_by(DataSource.id)).all()
        out = []
        for source_id, head, lowest, through, at in rows:
            limit = int(head) if lowest is None else min(int(lowest), int(head))
            through = int(through or 0)
            new = (LogSegment.first_seq > through) & (LogSegment.last_seq <= limit)
            above, tombs, since = s.execute(
                select(
                    func.count().filter(new),
                    func.coalesce(func.sum(LogSegment.tombstone_count).filter(LogSegment.last_seq <= through), 0),
                    func.min(LogSegment.committed_at).filter(new & (LogSegment.tombstone_count > 0)),
                ).where(LogSegment.data_source_id == source_id)
            ).one()
            out.append(CompactionState(int(source_id), int(head), limit, through, at, int(above), int(tombs), since))
        return out


def _record_run(
    conn: Connection, source_id: int, through: int, segments_before: int, segments_after: int, dropped: int
) -> None:
    values = {
        "compacted_at": func.now(),
        "segments_before": segments_before,
        "segments_after": segments_after,
        "entries_dropped": dropped,
    }
    dropped_through = through if dropped else 0
    # Neither bound ever goes back: a later run may reach less far (an index built from scratch holds the
    # lowest watermark at 0) while what earlier runs dropped stays dropped.
    conn.execute(
        insert(LogCompaction)
        .values(data_source_id=source_id, runs=1, compacted_through=through, dropped_through=dropped_through,
                **values)
        .on_conflict_do_update(
            index_elements=[LogCompaction.data_source_id],
            set_={
                **values,
                "compacted_through": func.greatest(LogCompaction.compacted_through, through),
                "dropped_through": func.greatest(LogCompaction.dropped_through, dropped_through),
                "runs": LogCompaction.runs + 1,
            },
        )
    )


def record_noop(engine: Engine, source_id: int, through: int, segments: int) -> None:
    """Remember that a compaction up to `through` found nothing to rewrite (so the sweep waits for more)."""
    with engine.begin() as conn:
        if conn.execute(select(DataSource.id).where(DataSource.id == source_id)).first() is None:
            return  # dropped meanwhile
        _record_run(conn, source_id, through, segments, segments, 0)


def replace_segments(
    engine: Engine,
    source_id: int,
    replacements: Sequence[Replacement],
    *,
    through: int,
    segments_before: int,
    dropped: int,
    delete_after: dt.datetime,
    lock_timeout_ms: int,
    files_exist: Callable[[list[str]], bool],
) -> None:
    """Swap the old segments for the new ones in one transaction. ConflictError, nothing changed, when
    another compaction replaced any of the old segments first or a new file is missing or being deleted by GC
    (the caller discards its files); NotFoundError when the data source was dropped.

    Under the data source's row lock, as commits take it: the producer batches move to the new segments,
    the old rows go, the new rows come, the old files are queued as garbage (deleted after
    `delete_after`, once no row references them) and the run is recorded. A crash before COMMIT changes
    nothing; the new files are then unreferenced garbage for GC.
    """
    old_ids = [i for r in replacements for i in r.old_ids]
    with engine.begin() as conn:
        lock_source(conn, source_id, lock_timeout_ms=lock_timeout_ms, during="while its log was compacted")
        present = conn.execute(
            select(func.count()).select_from(LogSegment).where(LogSegment.id.in_(old_ids))
        ).scalar_one()
        if present != len(old_ids):
            raise ConflictError(
                f"data source {source_id}: another compaction replaced some of these segments first",
                expected=len(old_ids), actual=present,
            )
        # GC records the deletion of a log file under this same lock and deletes the file after its COMMIT
        # (shoal.upkeep.gc): a new file with no record now keeps none until we commit, and from then on our row
        # references it; one with a record is going, even if it is still there.
        new_paths = [r.new.path for r in replacements]
        if deleted_among(conn, new_paths) or not files_exist(new_paths):
            raise ConflictError(f"data source {source_id}: a compacted file vanished before the swap (collected "
                                "as garbage: the compaction ran past the GC grace period)")
        # The producer batches (batch id -> token, for deduplication) move to the segment now holding their
        # seqs. Deleting the old rows cascades to them, and the new row cannot come first (it takes the old
        # first row's first_seq), so they are read, dropped with the old rows and inserted again.
        moved_to = {old: r.new.id for r in replacements for old in r.old_ids}
        batches = [
            dict(row._mapping)
            for row in conn.execute(select(ProducerBatch.__table__).where(ProducerBatch.segment_id.in_(old_ids)))
        ]
        conn.execute(delete(LogSegment).where(LogSegment.id.in_(old_ids)))
        conn.execute(
            LogSegment.__table__.insert(),
            [
                {
                    "id": r.new.id,
                    "data_source_id": source_id,
                    "first_seq": r.new.first_seq,
                    "last_seq": r.new.last_seq,
                    "upsert_count": r.new.upserts,
                    "tombstone_count": r.new.tombstones,
                    "bytes": r.new.bytes,
                    "checksum": r.new.checksum,
                    "path": r.new.path,
                    "committed_at": r.new.committed_at,
                }
                for r in replacements
            ],
        )
        if batches:
            conn.execute(
                ProducerBatch.__table__.insert(), [{**b, "segment_id": moved_to[b["segment_id"]]} for b in batches]
            )
        conn.execute(
            insert(GarbageFile)
            .values([{"path": p, "reason": COMPACTED, "delete_after": delete_after}
                     for r in replacements for p in r.old_paths])
            .on_conflict_do_nothing(index_elements=[GarbageFile.path])
        )
        after = segments_before - len(old_ids) + len(replacements)
        _record_run(conn, source_id, through, segments_before, after, dropped)
