"""The log's commit protocol: file first, then one catalog transaction that allocates seqs and publishes.

Under the data source's row lock the writer learns the head, writes the immutable, uniquely named segment
for the seqs after it, inserts the segment and batch rows and moves the head by compare-and-swap, all in
one transaction. A crash before COMMIT leaves at most an unreferenced file; a COMMIT whose outcome is
unknown is resolved by looking for the segment row before any retry, so nothing lands twice (when even that
look fails, StateUnknownError).

A caller that decided what to write from the log up to some head states it as `expect_head`: under the lock
the head must still be that one, or the commit writes nothing and raises ConflictError carrying the actual
head, and the caller reloads and decides again. A caller may instead bring its decision up to date under the
lock (`rebase`): given the head found, it returns the batches to write in its place, from the few entries
committed since (retention does: under steady ingest the head always moves while it decides).

A batch id answers a repeat of its batch with the first token, writing nothing. A batch slot may carry its
fingerprint (a hash of its content): a batch whose id committed, or is taken by an earlier batch of the same
group, under another fingerprint is refused alone (BatchIdReusedError in its place among the results), and
the rest of the group commits as if it were not there.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, Engine, select, text, update
from sqlalchemy.exc import DBAPIError, OperationalError

from shoal.catalog.locks import lock_source
from shoal.catalog.models import DataSource, LogSegment, ProducerBatch
from shoal.errors import BatchIdReusedError, CommitError, ConfigurationError, ConflictError, StateUnknownError
from shoal.log.segment_file import WrittenSegment

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchSlot:
    """One producer batch waiting in a group commit."""

    size: int
    batch_id: str | None
    # The batch's content hash, or None to take any batch under its id for a repeat (Shoal's own batches).
    fingerprint: str | None = None


@dataclass(frozen=True)
class HeldBatch:
    """A batch id already committed in a data source: its write token and the fingerprint it committed with."""

    token: int
    fingerprint: str | None


def held_batches(conn: Connection, source_id: int, batch_ids: Sequence[str]) -> dict[str, HeldBatch]:
    """The batches committed in the data source under any of these ids (the ids not there are absent): the one
    lookup the commit, repeats of empty uploads, message tokens and the consumer all decide by."""
    if not batch_ids:
        return {}
    rows = conn.execute(
        select(ProducerBatch.batch_id, ProducerBatch.last_seq, ProducerBatch.fingerprint).where(
            ProducerBatch.data_source_id == source_id, ProducerBatch.batch_id.in_(list(batch_ids))
        )
    )
    return {r.batch_id: HeldBatch(int(r.last_seq), r.fingerprint) for r in rows}


# What became of a batch of a group commit: its write token (its last seq), or why it alone was refused.
Outcome = int | BatchIdReusedError


# Called under the lock with the first seq and which batches to write; returns the durable file.
SegmentWriter = Callable[[int, list[int]], WrittenSegment]

# Called under the lock when the head is no longer `expect_head`, with the head found: the batches to commit in
# place of the stale decision's and the writer of their file, or None to decline (ConflictError, as without it).
# It holds the lock while it runs, so every other writer of the source waits: it must stay cheap (bounded).
Rebase = Callable[[int], tuple[Sequence[BatchSlot], SegmentWriter] | None]


def commit_group(
    engine: Engine,
    source_id: int,
    batches: Sequence[BatchSlot],
    write_segment: SegmentWriter,
    discard: Callable[[str], None],
    *,
    retries: int,
    lock_timeout_ms: int,
    expect_head: int | None = None,
    rebase: Rebase | None = None,
    on_commit: Callable[[int], None] | None = None,
) -> list[Outcome]:
    """Commit the batches as one segment; return each batch's last seq (its write token), or the
    BatchIdReusedError that refused it alone.

    `on_commit(head)` runs after the commit landed and before this returns, so before any writer of the
    group is acknowledged (the head announcement: shoal.log.heads); its failure does not fail the commit.

    A batch whose id already committed writes nothing and gets its original token back; one that carries a
    fingerprint other than the one its id committed with (or was taken with earlier in `batches`) is refused
    with BatchIdReusedError in its place, the others committing as usual. With `expect_head`, the rest is
    written only if the head is still `expect_head` under the row lock; otherwise `rebase(head found)`, when
    given, replaces them (the outcomes returned are then those of its batches), and when it is not given or
    declines, nothing is written and ConflictError is raised with `actual` set to the head found. Transient
    failures (and a lost head compare-and-swap) are retried up to `retries` times, then CommitError (its
    message names no object key or host: the log has them); StateUnknownError when the catalog cannot say
    whether the last attempt landed; NotFoundError when the source is gone or in the trash. A ConfigurationError
    (the storage's bucket gone or its credentials refused: shoal.storage.StorageRefusedError) is raised as it is,
    at once: no retry can help.
    """
    last_error: Exception | None = None
    for attempt in range(1, retries + 1):
        made: list[WrittenSegment] = []  # filled as soon as the file exists, so a failure can remove it
        committing = False  # from here on the outcome may be a landed commit, whose files must stay
        try:
            with engine.connect() as conn:
                tokens = _attempt(
                    conn, source_id, batches, write_segment, lock_timeout_ms, expect_head, made, rebase
                )
                committing = True
                try:
                    conn.commit()
                except DBAPIError as exc:
                    landed = _landed(engine, made[0].id) if made else False
                    if landed is None:
                        # The commit may or may not have landed: the file must stay (it may be referenced)
                        # and a blind retry could write the batch twice. Only a batch id makes a retry safe.
                        made.clear()
                        raise StateUnknownError(
                            "commit outcome unknown (catalog unreachable); retry with the same batch id"
                        ) from exc
                    if landed:
                        made.clear()  # the log's files now: nothing below may remove them
                        _committed(on_commit, tokens)
                        return tokens
                    raise
                made.clear()  # the log's files now: nothing below may remove them
                _committed(on_commit, tokens)
                return tokens
        except ConflictError as exc:
            for m in made:
                discard(m.path)
            if expect_head is not None:
                raise  # the caller's decision is stale: only it can make a new one
            last_error = exc  # a lost head CAS: the next attempt reads the head again
            log.warning("commit attempt %d/%d lost a race: %s", attempt, retries, exc)
        except (OperationalError, OSError) as exc:
            # Transient database or storage trouble, and the segment did not land: its file is garbage,
            # so remove it now rather than leave it to GC, then try again.
            for m in made:
                discard(m.path)
            if isinstance(exc, ConfigurationError):  # a missing bucket, refused credentials: no retry can help
                raise
            last_error = exc
            log.warning("commit attempt %d/%d failed: %s", attempt, retries, exc)
        except BaseException:
            # Ctrl-C (KeyboardInterrupt) or a task's time limit, say. Raised while the commit was awaited, the
            # outcome is unknown: the files stay (GC removes one that no row references). A file removed under a
            # landed commit's row left the log unreadable for good.
            if not committing:
                for m in made:
                    discard(m.path)
            raise
    raise CommitError(f"commit failed after {retries} attempts: {_public_reason(last_error)}") from last_error


def _public_reason(exc: Exception | None) -> str:
    """What a CommitError says of the error the commit gave up on. A storage or catalog error's own text names
    object keys, buckets, hosts or paths: it is logged by each attempt, and only its kind is said here."""
    if isinstance(exc, OSError):
        return f"the storage failed ({type(exc).__name__}; the log has the details)"
    if isinstance(exc, DBAPIError):
        return f"the catalog failed ({type(exc).__name__}; the log has the details)"
    return str(exc)


def _committed(on_commit: Callable[[int], None] | None, outcomes: list[Outcome]) -> None:
    tokens = [t for t in outcomes if isinstance(t, int)]
    if on_commit is None or not tokens:
        return
    try:
        on_commit(max(tokens))
    except Exception:  # noqa: BLE001 - the commit is durable; an announcement is best effort (and retried)
        log.exception("after-commit announcement failed")


def _landed(engine: Engine, segment_id: uuid.UUID) -> bool | None:
    """Whether the segment row exists: True, False, or None when the catalog cannot tell us."""
    try:
        with engine.connect() as conn:
            return conn.execute(select(LogSegment.id).where(LogSegment.id == segment_id)).first() is not None
    except DBAPIError:
        return None


@dataclass(frozen=True)
class _Plan:
    """Which batches of a group go into the file (`keep`), each batch's last seq there (None: not written),
    every batch's outcome, and the head after the file."""

    keep: list[int]
    ends: list[int | None]
    tokens: list[Outcome]
    end: int


def _plan(conn: Connection, source_id: int, batches: Sequence[BatchSlot], head: int) -> _Plan:
    """Decide which batches go into the file after `head`: new ones, each batch id once (the first occurrence
    wins); a repeat gets the first one's token, another batch under its id (both fingerprinted, and different)
    is refused."""
    ids = [b.batch_id for b in batches if b.batch_id is not None]
    # batch id -> (token, fingerprint) of the batches under it: committed before, or earlier in this group.
    known = {k: (h.token, h.fingerprint) for k, h in held_batches(conn, source_id, ids).items()}
    keep: list[int] = []
    end = head
    ends: list[int | None] = []
    tokens: list[Outcome] = []
    for i, b in enumerate(batches):
        if b.batch_id is not None and b.batch_id in known:
            token, fingerprint = known[b.batch_id]
            reused = b.fingerprint is not None and fingerprint is not None and b.fingerprint != fingerprint
            ends.append(None)
            tokens.append(BatchIdReusedError(b.batch_id, token) if reused else token)
            continue
        keep.append(i)
        end += b.size
        ends.append(end)
        tokens.append(end)
        if b.batch_id is not None:
            known[b.batch_id] = (end, b.fingerprint)
    return _Plan(keep, ends, tokens, end)


def _attempt(
    conn: Connection,
    source_id: int,
    batches: Sequence[BatchSlot],
    write_segment: SegmentWriter,
    lock_timeout_ms: int,
    expect_head: int | None,
    made: list[WrittenSegment],
    rebase: Rebase | None = None,
) -> list[Outcome]:
    # `live`: no batch lands in a source in the trash (a soft delete takes the same lock).
    head = lock_source(
        conn, source_id, lock_timeout_ms=lock_timeout_ms, live=True, during="while the batch was in flight"
    ).head_seq

    plan = _plan(conn, source_id, batches, head)
    if not plan.keep:
        return plan.tokens
    # Checked after the batch ids: a decision that already landed is answered with its tokens, as any replay.
    if expect_head is not None and head != expect_head:
        rebased = rebase(head) if rebase is not None else None
        if rebased is None:
            raise ConflictError(
                f"data source {source_id}: head is {head}, not {expect_head} as expected; nothing written",
                expected=expect_head,
                actual=head,
            )
        batches, write_segment = rebased
        plan = _plan(conn, source_id, batches, head)
        if not plan.keep:
            return plan.tokens
    keep, ends, tokens, end = plan.keep, plan.ends, plan.tokens, plan.end
    first_seq = head + 1

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
            "fingerprint": batches[i].fingerprint,
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
        raise ConflictError(f"data source {source_id}: head moved under the row lock", expected=head)
    return tokens
