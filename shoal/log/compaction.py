"""Log compaction: rewrite old segments keeping the latest entry per key, with their seqs; merge small ones.

Only segments wholly at or below the lowest watermark (`shoal.log.compaction_swap.lowest_watermark`) are
considered, always the whole prefix of the log up to there, so "latest" is judged against every older entry
of a key. In that prefix an entry is dead when

- a later entry of its key exists in the prefix (an older upsert or tombstone, superseded), or
- it is a tombstone, the latest entry of its key, older than the tombstone retention: every index is past
  it (it is below the lowest watermark) and nothing older of its key survives the same rewrite, so a reader
  starting from seq 0 never sees the key either way.

Every segment holding a dead entry is rewritten; runs of adjacent rewritten or small segments are merged
toward the target size. A rewritten segment keeps the seq range of the segments it replaces (segments still
tile 1..head), its entries keep their seqs and ingestion times, so folding the log gives the same state and
an index built from seq 0 answers the same. New files are written first, then one catalog transaction swaps
the rows (`replace_segments`); the old files go to the GC queue.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from sqlalchemy import Engine

from shoal.catalog.repo import SegmentRecord, SourceRecord, list_segments
from shoal.config.settings import Settings
from shoal.errors import ConflictError
from shoal.log.compaction_swap import (
    NewSegment,
    Replacement,
    compaction_states,
    load_source,
    lowest_watermark,
    record_noop,
    replace_segments,
)
from shoal.log.segment_file import read_segment, store_segment
from shoal.log.validation import DELETE, INGESTED_AT, KEY, OP, SEQ, SEQ_OFFSET
from shoal.storage import Storage

log = logging.getLogger(__name__)

# The sweep also compacts a log with this many new segments below the lowest watermark, however few seqs
# they hold: many small commits make many small files, which is what merging is for.
MIN_NEW_SEGMENTS = 32


@dataclass(frozen=True)
class CompactionPolicy:
    """How compaction rewrites: the segment size it merges toward, how long tombstones stay, how long
    replaced files stay for readers that listed them, and how long to wait for the data source's lock."""

    target_bytes: int = 64 << 20
    tombstone_retention_s: float = 86_400.0
    grace_s: float = 3_600.0
    lock_timeout_ms: int = 30_000

    @classmethod
    def from_settings(cls, settings: Settings) -> CompactionPolicy:
        """The policy the settings describe."""
        return cls(
            settings.compaction_target_bytes,
            settings.tombstone_retention_s,
            settings.gc_grace_s,
            settings.lock_timeout_ms,
        )


@dataclass(frozen=True)
class CompactionResult:
    """What one compaction run did. `changed` is False when it found nothing worth rewriting, or when
    `raced` (another compaction replaced the same segments first; this run then discarded its files)."""

    source_id: int
    bound: int  # the highest seq this run could touch (segment-aligned, at most the lowest watermark)
    segments_before: int
    segments_after: int
    segments_rewritten: int
    segments_written: int
    entries_before: int  # entries in the rewritten segments
    entries_dropped: int
    tombstones_dropped: int
    bytes_before: int  # bytes of the rewritten segments
    bytes_after: int  # bytes of the segments written
    changed: bool
    raced: bool = False

    def to_json(self) -> dict[str, Any]:
        """The result as a JSON-ready dict."""
        return asdict(self)


def compact_log(
    engine: Engine,
    storage: Storage,
    source_id: int,
    policy: CompactionPolicy | None = None,
    *,
    now: dt.datetime | None = None,
) -> CompactionResult:
    """Compact the data source's log below its lowest watermark; return what was done.

    Promises: the folded state at any seq at or above the bound is unchanged, as is every entry above the
    bound; segments keep tiling 1..head; a crash at any point leaves the log as before or as after, plus at
    most unreferenced files. Safe to run concurrently with commits, index builds, searches and itself.
    """
    policy = policy or CompactionPolicy()
    now = now or dt.datetime.now(dt.UTC)
    source = load_source(engine, source_id)
    low = lowest_watermark(engine, source_id)
    limit = source.head_seq if low is None else min(low, source.head_seq)
    segments = list_segments(engine, source_id, 0, source.head_seq)
    prefix = [s for s in segments if s.last_seq <= limit]
    bound = prefix[-1].last_seq if prefix else 0

    entries = _entry_map(storage, prefix)
    superseded, expired = _dead_candidates(entries, now - dt.timedelta(seconds=policy.tombstone_retention_s))
    seg_of = entries["seg"].to_numpy()
    dead = superseded | expired
    dirty = np.bincount(seg_of[dead], minlength=len(prefix)) > 0
    live_share = np.bincount(seg_of[~dead], minlength=len(prefix)) / np.maximum(
        np.bincount(seg_of, minlength=len(prefix)), 1
    )
    groups = _plan(prefix, live_share, dirty, policy.target_bytes)
    if not groups:
        record_noop(engine, source_id, bound, len(segments))
        return CompactionResult(source_id, bound, len(segments), len(segments), 0, 0, 0, 0, 0, 0, 0, False)

    rewritten = np.zeros(len(prefix), dtype=bool)
    rewritten[[i for g in groups for i in g]] = True
    # Belt and braces: a tombstone goes only if no other entry of its key stays in a segment kept as is
    # (by construction there is none: such an entry would be superseded, so its segment dirty, so rewritten).
    kept_keys = pc.filter(entries[KEY], pa.array(~rewritten[seg_of]))
    lone = ~pc.is_in(entries[KEY], value_set=kept_keys).to_numpy(zero_copy_only=False)
    drop = superseded | (expired & lone)
    keep = ~drop
    starts = np.searchsorted(seg_of, np.arange(len(prefix) + 1))

    made = [
        _rewrite(storage, source, [prefix[i] for i in g], [keep[starts[i] : starts[i + 1]] for i in g]) for g in groups
    ]
    dropped = int(drop.sum())
    # On an exception from here on our files may or may not be referenced (a COMMIT whose outcome is
    # unknown): they stay for GC, which deletes a log file only after checking under the data source's lock
    # that no row references it.
    try:
        replace_segments(
            engine,
            source_id,
            made,
            through=bound,
            segments_before=len(segments),
            dropped=dropped,
            delete_after=now + dt.timedelta(seconds=policy.grace_s),
            lock_timeout_ms=policy.lock_timeout_ms,
            files_exist=lambda paths: all(storage.exists(p) for p in paths),
        )
    except ConflictError as exc:
        # Nothing was published, so our files are referenced by no row: remove them now rather than via GC.
        for r in made:
            storage.delete_quietly(r.new.path)
        log.info("compaction of data source %s lost a race (%s); discarded its files", source_id, exc)
        return CompactionResult(source_id, bound, len(segments), len(segments), 0, 0, 0, 0, 0, 0, 0, False, True)
    result = CompactionResult(
        source_id=source_id,
        bound=bound,
        segments_before=len(segments),
        segments_after=len(segments) - int(rewritten.sum()) + len(made),
        segments_rewritten=int(rewritten.sum()),
        segments_written=len(made),
        entries_before=int(rewritten[seg_of].sum()),
        entries_dropped=dropped,
        tombstones_dropped=int((drop & pc.equal(entries[OP], DELETE).to_numpy(zero_copy_only=False)).sum()),
        bytes_before=sum(prefix[i].bytes for g in groups for i in g),
        bytes_after=sum(r.new.bytes for r in made),
        changed=True,
    )
    log.info(
        "compacted the log of data source %s (tenant %s, %s/%s) up to seq %d: %d segments -> %d, %d entries "
        "dropped (%d tombstones), %d -> %d bytes; replaced files queued for GC",
        source_id, source.tenant, source.spec.name, source.spec.version, bound, result.segments_before,
        result.segments_after, result.entries_dropped, result.tombstones_dropped, result.bytes_before,
        result.bytes_after,
    )
    return result


def due_for_compaction(
    engine: Engine,
    *,
    min_seqs: int,
    tombstone_retention_s: float,
    now: dt.datetime | None = None,
    source_ids: list[int] | None = None,
) -> list[int]:
    """Ids of the data sources worth compacting now: at least `min_seqs` seqs or MIN_NEW_SEGMENTS segments
    below the lowest watermark since the last compaction, or tombstones that have expired since: ones the last
    run kept, or ones committed after it (retention's deletions on a quiet source, which never reaches the size
    triggers: the expired points stayed in the log files for good). At most one run per tombstone retention for
    expired tombstones."""
    now = now or dt.datetime.now(dt.UTC)
    cutoff = now - dt.timedelta(seconds=tombstone_retention_s)
    due = []
    for st in compaction_states(engine, source_ids):
        grown = st.limit - st.compacted_through
        rested = st.compacted_at is None or st.compacted_at <= cutoff
        expired = rested and (
            (st.tombstones_below > 0 and st.compacted_at is not None)
            or (st.tombstones_above_since is not None and st.tombstones_above_since <= cutoff)
        )
        if grown >= min_seqs or (grown > 0 and st.segments_above >= MIN_NEW_SEGMENTS) or expired:
            due.append(st.source_id)
    return due


def _entry_map(storage: Storage, prefix: list[SegmentRecord]) -> pa.Table:
    """Seq, key, op and ingestion time of every entry in the prefix, in seq order, with its segment's position."""
    parts = []
    for i, seg in enumerate(prefix):
        t = read_segment(storage, seg.path, seg.checksum, [SEQ_OFFSET, OP, KEY, INGESTED_AT])
        parts.append(
            pa.table({
                SEQ: pc.add(t[SEQ_OFFSET], pa.scalar(seg.first_seq, pa.int64())),
                KEY: t[KEY],
                OP: t[OP],
                INGESTED_AT: t[INGESTED_AT],
                "seg": pa.array(np.full(t.num_rows, i, dtype=np.int64)),
            })
        )
    if not parts:
        return pa.table({
            SEQ: pa.array([], pa.int64()), KEY: pa.array([], pa.string()), OP: pa.array([], pa.string()),
            INGESTED_AT: pa.array([], pa.timestamp("us", tz="UTC")), "seg": pa.array([], pa.int64()),
        })
    return pa.concat_tables(parts).combine_chunks()


def _dead_candidates(entries: pa.Table, cutoff: dt.datetime) -> tuple[np.ndarray, np.ndarray]:
    """(superseded, expired tombstones) as boolean masks over the entries."""
    n = entries.num_rows
    if n == 0:
        return np.zeros(0, dtype=bool), np.zeros(0, dtype=bool)
    latest = entries.group_by(KEY, use_threads=False).aggregate([(SEQ, "max")])
    # Seqs are unique, so an entry is its key's latest exactly when its seq is one of the maxima.
    is_latest = pc.is_in(entries[SEQ], value_set=latest[f"{SEQ}_max"]).to_numpy(zero_copy_only=False)
    tomb = pc.equal(entries[OP], DELETE).to_numpy(zero_copy_only=False)
    old = pc.less(entries[INGESTED_AT], pa.scalar(cutoff, pa.timestamp("us", tz="UTC")))
    expired = is_latest & tomb & old.to_numpy(zero_copy_only=False)
    return ~is_latest, expired


def _plan(segments: list[SegmentRecord], live_share: np.ndarray, dirty: np.ndarray, target: int) -> list[list[int]]:
    """Groups of adjacent segment positions to rewrite, each into one segment of about `target` bytes or less:
    every dirty segment, merged with dirty or small neighbours; a lone clean segment stays as it is."""
    groups: list[list[int]] = []
    run: list[int] = []
    run_bytes = 0.0

    def close() -> None:
        nonlocal run, run_bytes
        if len(run) > 1 or (run and dirty[run[0]]):
            groups.append(run)
        run, run_bytes = [], 0.0

    for i, seg in enumerate(segments):
        small = seg.bytes < target // 2
        if not (dirty[i] or small):
            close()
            continue
        # The vectors dominate a segment's bytes, so its size after the rewrite is about its live share.
        estimate = seg.bytes * float(live_share[i])
        if run and run_bytes + estimate > target:
            close()
        run.append(i)
        run_bytes += estimate
    close()
    return groups


def _rewrite(
    storage: Storage, source: SourceRecord, group: list[SegmentRecord], keeps: list[np.ndarray]
) -> Replacement:
    """Write one segment holding the kept entries of `group` (adjacent segments) at their seqs."""
    first = group[0].first_seq
    parts = []
    for seg, keep in zip(group, keeps, strict=True):
        table = read_segment(storage, seg.path, seg.checksum)
        if len(keep) != table.num_rows:  # the file changed under its checksum: impossible, refuse loudly
            raise RuntimeError(f"segment {seg.path} holds {table.num_rows} entries, its key map {len(keep)}")
        table = table.filter(pa.array(keep))
        offsets = pc.add(table[SEQ_OFFSET], pa.scalar(seg.first_seq - first, pa.int64()))
        parts.append(table.set_column(table.schema.get_field_index(SEQ_OFFSET), SEQ_OFFSET, offsets))
    table = pa.concat_tables(parts, promote_options="default").combine_chunks()
    written = store_segment(storage, source.tenant, source.spec.name, source.spec.version, first, table)
    new = NewSegment(
        id=written.id,
        path=written.path,
        first_seq=first,
        last_seq=group[-1].last_seq,
        upserts=written.upserts,
        tombstones=written.tombstones,
        bytes=written.bytes,
        checksum=written.checksum,
        # The oldest commit time of what it replaces: freshness lag never looks better than it was.
        committed_at=min(s.committed_at for s in group),
    )
    return Replacement(tuple(s.id for s in group), tuple(s.path for s in group), new)
