"""Retention: a data source's `retention_days` expires its data points by appending tombstones to the log.

The limit lives in the data source's custom metadata, DeepLake style: `{"retention_days": 30}` on the data
source, or in a dataset's metadata (`custom_metadata["shoal.dataset"]["metadata"]["retention_days"]`). A
point expires when its latest upsert was ingested before now minus that many days. Expiry is an ordinary
commit (one segment of tombstones under the batch id `shoal-retention:{head}:{n}`, so the log and the
producer batches record every expiry), and the indexes apply it like any delete; compaction later removes
the expired entries from the log itself.

A point updated after the decision is never deleted by it: the commit is checked under the data source's lock
against the head the expiry was computed at (the commit's `expect_head`). Under steady ingest that head has
always moved by then (deciding reads the whole log; an upload commits in milliseconds), so insisting on it
never let retention finish. Instead, still under the lock, the few entries committed since are read and every
key they touch (upserted or deleted again) leaves the expiry, and the rest commits at once, its batch ids
named after the head it was brought up to (`commit.Rebase`). Only when too much landed meanwhile to read
under the lock (REBASE_SEQS, REBASE_SEGMENTS) does the commit refuse (ConflictError, carrying the actual
head); then the entries since are folded in and the decision is made again.

A batch id of the expiry may be taken by a batch it did not write: a client's, from before such ids were
refused (`shoal.intake.producer.RESERVED_PREFIXES`), which the commit answers as a repeat with that batch's
token (at or below the head the decision was made at), or another run's decision at the same head with another
cutoff (refused: another fingerprint). Those points are not counted as expired, and the decision is made again
on the log as it now is, under ids no batch holds (`shoal-retention:{head}:{n}:{salt}`).
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from sqlalchemy import Engine

from shoal.catalog.repo import SourceRecord, head_of, list_segments
from shoal.errors import CommitError, ConflictError
from shoal.log.commit import BatchSlot, Outcome, SegmentWriter, commit_group
from shoal.log.compaction_swap import sources_with_metadata
from shoal.log.reader import fold, read_log
from shoal.log.records import DATASET_KEY, DataSourceSpec
from shoal.log.segment_file import WrittenSegment, build_segment_table, store_segment
from shoal.log.validation import INGESTED_AT, KEY, OP, columns_to_table
from shoal.log.writer import batch_fingerprint
from shoal.storage import Storage

log = logging.getLogger(__name__)

METADATA_KEY = "retention_days"
DATASET_MARKER = DATASET_KEY  # where the dataset API keeps a dataset's definition (shoal.datasets.catalog)
BATCH_PREFIX = "shoal-retention:"
ATTEMPTS = 8  # head moved under us this often in a row: give up for this run (the next one retries)
# How far the head may have moved since the decision for it to be brought up to date under the source's lock.
# Reading those entries holds the lock, so every upload to the source waits meanwhile: a few thousand entries
# in a few files take milliseconds; past that the decision is made again without the lock (the old retry).
REBASE_SEQS = 4096
REBASE_SEGMENTS = 16


@dataclass(frozen=True)
class RetentionResult:
    """What one retention run did for a data source."""

    source_id: int
    retention_days: float | None  # None: the source has no retention
    cutoff: dt.datetime | None  # points whose latest upsert was ingested before this expired
    expired: int  # tombstones appended
    token: int | None  # the seq of the last tombstone, when any

    def to_json(self) -> dict[str, Any]:
        """The result as a JSON-ready dict."""
        out = asdict(self)
        out["cutoff"] = self.cutoff.isoformat() if self.cutoff else None
        return out


def retention_days(spec: DataSourceSpec) -> float | None:
    """The data source's retention in days, None when it has none (absent, not a positive number)."""
    meta: Mapping[str, Any] = spec.custom_metadata
    value = meta.get(METADATA_KEY)
    dataset = meta.get(DATASET_MARKER)
    if value is None and isinstance(dataset, Mapping) and isinstance(dataset.get("metadata"), Mapping):
        value = dataset["metadata"].get(METADATA_KEY)
    if value is None or isinstance(value, bool):
        return None
    try:
        days = float(value)
    except OverflowError:
        # An integer past the float range (the dataset API takes any non-negative integer, e.g. 10**400): a
        # positive one is a retention longer than the calendar, kept as the largest float, which expires
        # nothing (as 1e300 does); a negative one is no retention, as any other negative value.
        return sys.float_info.max if isinstance(value, int) and value > 0 else None
    except (TypeError, ValueError):
        log.warning("data source %s/%s: ignoring %s=%r (not a number)", spec.name, spec.version, METADATA_KEY, value)
        return None
    return days if math.isfinite(days) and days > 0 else None


def sources_with_retention(engine: Engine) -> list[SourceRecord]:
    """Every data source (of every tenant) with a retention. A source whose value cannot be read is logged and
    left out: it never keeps the sweep from the others."""
    out = []
    for record in sources_with_metadata(engine, METADATA_KEY, DATASET_MARKER):
        try:
            days = retention_days(record.spec)
        except Exception:  # noqa: BLE001 - one source's odd metadata must not stop retention in every tenant
            log.exception("retention of data source %s (tenant %s): its %s cannot be read; skipped",
                          record.id, record.tenant, METADATA_KEY)
            continue
        if days:
            out.append(record)
    return out


def apply_retention(
    engine: Engine,
    storage: Storage,
    source: SourceRecord,
    *,
    now: dt.datetime | None = None,
    max_batch_points: int = 100_000,
    lock_timeout_ms: int = 30_000,
    commit_retries: int = 3,
    announce_head: Callable[[int, int], None] | None = None,
) -> RetentionResult:
    """Append a tombstone for every live point of the source whose latest upsert is older than its
    retention; return what was done. Idempotent: a second run at once finds nothing left to expire.
    `announce_head(source id, head)` runs after each commit, before this returns (shoal.log.heads).

    Raises CommitError when commits kept landing between the decision and the lock ATTEMPTS times in a row.
    """
    days = retention_days(source.spec)
    if days is None:
        return RetentionResult(source.id, None, None, 0, None)
    now = now or dt.datetime.now(dt.UTC)
    try:
        cutoff = now - dt.timedelta(days=days)
    except OverflowError:  # a retention reaching before year 1 (retention_days 1e30 is allowed): nothing is older
        return RetentionResult(source.id, days, None, 0, None)
    spec = source.spec
    columns = [KEY, OP, INGESTED_AT, *spec.permanent_attributes]
    head = head_of(engine, source.id)[0]
    state = fold(read_log(engine, storage, source.id, 0, head, columns=columns))
    done, last = 0, None  # tombstones appended by earlier attempts of this run, and the last one's seq
    salt = ""  # set once an id of the expiry turned out taken by a batch it did not write
    for _ in range(ATTEMPTS):
        expired = _older_than(state, cutoff)
        if not expired.num_rows:
            return RetentionResult(source.id, days, cutoff, done, last)
        tables = [
            columns_to_table(
                spec, None, {a: expired[a].slice(i, max_batch_points) for a in spec.permanent_attributes},
                max_batch_points, delete=True,
            )
            for i in range(0, expired.num_rows, max_batch_points)
        ]
        try:
            landed = _commit(
                engine, storage, source, head, tables, lock_timeout_ms, commit_retries, announce_head, salt,
                rebase=True,
            )
        except ConflictError as moved:
            # The head the commit found under the lock (reloaded if the conflict did not say).
            new_head = moved.actual if isinstance(moved.actual, int) else head_of(engine, source.id)[0]
            newer = list(read_log(engine, storage, source.id, head, new_head, columns=columns))
            state = fold([*state.to_batches(), *newer])
            head = new_head
            continue
        # This decision's tombstones land after the head it was made (or brought up) to; a token at or below it
        # answered one of its batch ids with a batch committed before the decision, which the expiry did not write.
        tokens = landed.outcomes
        wrote = [t for t, seq in zip(landed.tables, tokens, strict=True) if isinstance(seq, int) and seq > landed.head]
        appended = sum(t.num_rows for t in wrote)
        if appended:
            done, last = done + appended, max(seq for seq in tokens if isinstance(seq, int))
            log.info(
                "retention: appended %d tombstones to data source %s (tenant %s, %s/%s) for points ingested "
                "before %s (retention %s days), up to seq %d",
                appended, source.id, source.tenant, spec.name, spec.version, cutoff.isoformat(), days, last,
            )
        if len(wrote) == len(landed.tables):
            return RetentionResult(source.id, days, cutoff, done, last)
        log.warning(
            "retention of data source %s: a batch id of its expiry at head %d was taken by a batch it did not "
            "write; deciding again under other ids", source.id, landed.head,
        )
        salt = uuid.uuid4().hex[:12]
        new_head = head_of(engine, source.id)[0]
        newer = list(read_log(engine, storage, source.id, head, new_head, columns=columns))
        state = fold([*state.to_batches(), *newer])
        head = new_head
    raise CommitError(f"retention of data source {source.id}: the log kept moving; try again later")


def _older_than(state: pa.Table, cutoff: dt.datetime) -> pa.Table:
    if not state.num_rows:
        return state
    return state.filter(pc.less(state[INGESTED_AT], pa.scalar(cutoff, pa.timestamp("us", tz="UTC"))))


@dataclass
class _Landed:
    """What a commit of an expiry wrote: the head its decision was made (or brought up) to, its tombstone
    batches then, and each one's outcome."""

    head: int
    tables: list[pa.Table]
    outcomes: list[Outcome] = field(default_factory=list)


def _commit(
    engine: Engine,
    storage: Storage,
    source: SourceRecord,
    head: int,
    tables: list[pa.Table],
    lock_timeout_ms: int,
    retries: int,
    announce_head: Callable[[int, int], None] | None = None,
    salt: str = "",
    *,
    rebase: bool = False,
) -> _Landed:
    """Commit the tombstones decided at `head`. Without `rebase`, ConflictError (nothing written) once a commit
    landed since; with it, such commits are read under the lock and their keys spared (`_rebased`)."""
    spec = source.spec
    # Fingerprinted: another run that decided at the same head (with another `now`) may have expired other
    # points under these ids; its batches are not this decision's.
    suffix = f":{salt}" if salt else ""

    def slots(at: int, batches: list[pa.Table]) -> list[BatchSlot]:
        return [
            BatchSlot(t.num_rows, f"{BATCH_PREFIX}{at}:{i}{suffix}", batch_fingerprint(t))
            for i, t in enumerate(batches)
        ]

    def writer(batches: list[pa.Table]) -> SegmentWriter:
        def write(first_seq: int, keep: list[int]) -> WrittenSegment:
            table = build_segment_table([batches[i] for i in keep])
            return store_segment(storage, source.tenant, spec.name, spec.version, first_seq, table)

        return write

    # Replaced by each rebase: the outcomes commit_group returns are those of the last attempt, which rebased
    # whenever an earlier one did (the head never comes back to `head`).
    landed = _Landed(head, tables)

    def bring_up_to(actual: int) -> tuple[list[BatchSlot], SegmentWriter] | None:
        kept = _rebased(engine, storage, source.id, head, actual, tables)
        if kept is None:
            return None
        landed.head, landed.tables = actual, kept
        return slots(actual, kept), writer(kept)

    # `expect_head`: a commit that landed since the decision makes it stale; `rebase` brings it up to date.
    landed.outcomes = commit_group(
        engine, source.id, slots(head, tables), writer(tables), storage.delete_quietly, retries=retries,
        lock_timeout_ms=lock_timeout_ms, expect_head=head, rebase=bring_up_to if rebase else None,
        on_commit=(lambda new_head: announce_head(source.id, new_head)) if announce_head is not None else None,
    )
    return landed


def _rebased(
    engine: Engine, storage: Storage, source_id: int, head: int, actual: int, tables: list[pa.Table]
) -> list[pa.Table] | None:
    """The tombstone batches decided at `head` without every key an entry in (head, actual] touches: such a key
    was upserted (or deleted) after the decision, which therefore no longer stands for it. None when more
    landed than may be read under the lock (REBASE_SEQS, REBASE_SEGMENTS): the decision is made again."""
    if not 0 < actual - head <= REBASE_SEQS:
        return None
    if len(list_segments(engine, source_id, head, actual)) > REBASE_SEGMENTS:
        return None
    try:
        since = [b.column(KEY) for b in read_log(engine, storage, source_id, head, actual, columns=[KEY])
                 if b.num_rows]
    except OSError as exc:  # the storage away (StorageUnavailableError is one): no retry of this under the lock
        log.info("retention of data source %s: the entries since seq %d could not be read under the lock (%s); "
                 "deciding again", source_id, head, exc)
        return None
    if not since:
        return tables
    touched = pa.chunked_array(since).unique()
    kept = [t.filter(pc.invert(pc.is_in(t[KEY], value_set=touched))) for t in tables]
    return [t for t in kept if t.num_rows]
