"""The log's commit protocol: file first, then one catalog transaction that allocates seqs and publishes.

Under the data source's row lock the writer learns the head, writes the immutable, uniquely named segment
for the seqs after it, inserts the segment and batch rows and moves the head by compare-and-swap, all in
one transaction. A crash before COMMIT leaves at most an unreferenced file; a COMMIT whose outcome is
unknown is resolved by looking for the segment row before any retry, so nothing lands twice.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, select, text, update
from sqlalchemy.exc import DBAPIError, OperationalError

from shoal.catalog.models import DataSource, LogSegment, ProducerBatch
from shoal.errors import CommitError, NotFoundError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WrittenSegment:
    """What a segment writer reports back about the file it made durable."""

    id: uuid.UUID
    path: str
    bytes: int
    checksum: str
    upserts: int
    tombstones: int


@dataclass(frozen=True)
class BatchSlot:
    """One producer batch waiting in a group commit."""

    size: int
    batch_id: str | None


# Called under the lock with the first seq and which batches to write; returns the durable file.
SegmentWriter = Callable[[int, list[int]], WrittenSegment]


def commit_group(
    engine: Engine,
    source_id: int,
    batches: Sequence[BatchSlot],
    write_segment: SegmentWriter,
    discard: Callable[[str], None],
    *,
    retries: int,
    lock_timeout_ms: int,
) -> list[int]:
    """Commit the batches as one segment; return each batch's last seq (its write token).

    A batch whose id already committed writes nothing and gets its original token back.
    """
    last_error: Exception | None = None
    for attempt in range(1, retries + 1):
        made: list[WrittenSegment] = []  # filled as soon as the file exists, so a failure can remove it
        try:
            with engine.connect() as conn:
                tokens = _attempt(conn, source_id, batches, write_segment, lock_timeout_ms, made)
                try:
                    conn.commit()
                except DBAPIError as exc:
                    landed = _landed(engine, made[0].id) if made else False
                    if landed is None:
                        # The commit may or may not have landed: the file must stay (it may be referenced)
                        # and a blind retry could write the batch twice. Only a batch id makes a retry safe.
                        made.clear()
                        raise CommitError(
                            "commit outcome unknown (catalog unreachable); retry with the same batch id"
                        ) from exc
                    if landed:
                        return tokens
                    raise
                return tokens
        except (OperationalError, OSError) as exc:
            # Transient database or storage trouble, and the segment did not land: its file is garbage,
            # so remove it now rather than leave it to GC, then try again.
            last_error = exc
            log.warning("commit attempt %d/%d failed: %s", attempt, retries, exc)
            for m in made:
                discard(m.path)
        except BaseException:
            for m in made:
                discard(m.path)
            raise
    raise CommitError(f"commit failed after {retries} attempts: {last_error}") from last_error


def _landed(engine: Engine, segment_id: uuid.UUID) -> bool | None:
    """Whether the segment row exists: True, False, or None when the catalog cannot tell us."""
    try:
        with engine.connect() as conn:
            return conn.execute(select(LogSegment.id).where(LogSegment.id == segment_id)).first() is not None
    except DBAPIError:
        return None


def _attempt(
    conn: Connection,
    source_id: int,
    batches: Sequence[BatchSlot],
    write_segment: SegmentWriter,
    lock_timeout_ms: int,
    made: list[WrittenSegment],
) -> list[int]:
    conn.execute(text(f"SET LOCAL lock_timeout = '{int(lock_timeout_ms)}ms'"))
    row = conn.execute(
        select(DataSource.head_seq, DataSource.deleted_at).where(DataSource.id == source_id).with_for_update()
    ).one_or_none()
    if row is None:
        raise NotFoundError(f"data source {source_id} was dropped while the batch was in flight")
    if row.deleted_at is not None:
        # Checked under the row lock a soft delete also takes: no batch lands in a source in the trash.
        raise NotFoundError(f"data source {source_id} is in the trash")
    head = row.head_seq

    ids = [b.batch_id for b in batches if b.batch_id is not None]
    known: dict[str, int] = {}
    if ids:
        rows = conn.execute(
            select(ProducerBatch.batch_id, ProducerBatch.last_seq).where(
                ProducerBatch.data_source_id == source_id, ProducerBatch.batch_id.in_(ids)
            )
        )
        known = {r.batch_id: r.last_seq for r in rows}

    # Decide which batches go into the file: new ones, each batch id once (the first occurrence wins).
    keep: list[int] = []
    pending: dict[str, int] = {}
    first_seq = head + 1
    end = head
    ends: list[int | None] = []
    for i, b in enumerate(batches):
        if b.batch_id is not None and (b.batch_id in known or b.batch_id in pending):
            ends.append(None)
            continue
        keep.append(i)
        end += b.size
        ends.append(end)
        if b.batch_id is not None:
            pending[b.batch_id] = end
    tokens = [
        e if e is not None else known.get(b.batch_id or "", pending.get(b.batch_id or "", 0))
        for b, e in zip(batches, ends, strict=True)
    ]
    if not keep:
        return tokens

    written = write_segment(first_seq, keep)
    made.append(written)
    now = text("clock_timestamp()")
    conn.execute(
        LogSegment.__table__.insert().values(
            id=written.id,
            data_source_id=source_id,
            first_seq=first_seq,
            last_seq=end,
            upsert_count=written.upserts,
            tombstone_count=written.tombstones,
            bytes=written.bytes,
            checksum=written.checksum,
            path=written.path,
            committed_at=now,
        )
    )
    batch_rows = [
        {
            "data_source_id": source_id,
            "batch_id": batches[i].batch_id,
            "first_seq": ends[i] - batches[i].size + 1,  # type: ignore[operator]
            "last_seq": ends[i],
            "segment_id": written.id,
        }
        for i in keep
        if batches[i].batch_id is not None
    ]
    if batch_rows:
        conn.execute(ProducerBatch.__table__.insert(), batch_rows)
    moved = conn.execute(
        update(DataSource)
        .where(DataSource.id == source_id, DataSource.head_seq == head)
        .values(head_seq=end, head_committed_at=now)
    ).rowcount
    if moved != 1:  # cannot happen under the row lock; refuse rather than publish out of order
        raise OperationalError("head moved under the row lock", None, Exception("head CAS lost"))
    return tokens
