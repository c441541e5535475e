"""Materialize and merge index shards: new immutable artifacts, then a compare-and-swap of the active pointer.

Both run under the shard's lease, read the active version, write only new uniquely named files, and publish
a new version whose parent is the one they read. A crash anywhere before the publish leaves the active
version untouched and at most unreferenced files; losing the compare-and-swap discards the attempt. Both
lost races (the lease held by another worker, the active pointer moved) raise LeaseBusyError, a
ConflictError: try again later, from the then active version. A shard that is gone (its index dropped) raises
NotFoundError: there is nothing to build.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from sqlalchemy import Engine

from shoal.catalog.indexes import IndexRecord, ShardCatalog, ShardRecord, VersionRecord
from shoal.catalog.repo import SourceRecord, head_of, seqs_committed_within
from shoal.errors import LeaseBusyError  # defined with the other errors; still importable from here
from shoal.index.generations import is_hidden
from shoal.index.lease import LeaseHeartbeat, default_owner, owner_is_dead
from shoal.index.manifest import Manifest, SegmentEntry
from shoal.index.merge_policy import MergePolicy, pick
from shoal.index.segment import (
    build_segment,
    extend_segment,
    load_rows,
    manifest_files,
    read_deletions,
    write_deletions,
)
from shoal.index.segment_cache import KeyCache
from shoal.index.sharding import shard_numbers
from shoal.log.reader import fold, read_log
from shoal.log.records import GENERATION_MARK
from shoal.log.validation import KEY
from shoal.storage import Storage, layout
from shoal.upkeep.gc import publishable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildResult:
    """What a materialize or merge run did."""

    shard_id: int
    version_id: int | None  # the new active version, None when nothing changed
    watermark: int
    changed: bool
    segments: int


LEASE_POLL_S = 0.2  # how often a merge waiting to publish asks for the lease again


def shard_dir(index: IndexRecord, shard: ShardRecord, generation: int) -> str:
    """Layout-relative folder of a shard's segments (DESIGN.md's storage layout): under the index's own version
    for every generation, `{version}/gen-{generation}/`, also while a generation is built aside under a hidden
    version (`{version}~g{n}`, shoal.index.generations). (Generations built before this rule keep their files
    in `{version}~g{n}/gen-{n}/`: their paths are in the catalog, and GC takes either folder for the index's.)"""
    version = index.spec.version.partition(GENERATION_MARK)[0]
    return layout.shard_dir(index.tenant, index.spec.name, version, generation, shard.shard_no)


class ShardBuilder:
    """Materializes and merges index shards. One per worker process; caches segment keys across runs."""

    def __init__(
        self,
        engine: Engine,
        storage: Storage,
        *,
        owner: str | None = None,
        lease_seconds: float = 600.0,
        heartbeat_s: float | None = None,
        policy: MergePolicy | None = None,
        on_publish: Callable[[int, int], None] | None = None,
        quick_backlog_seqs: int = 0,
        quick_ef_construction: int = 40,
        quick_window_s: float = 0.0,
    ) -> None:
        """`lease_seconds`: how long a build's lease lasts unrenewed. `heartbeat_s`: renew it that often while
        a build runs (workers do, with a short lease, so a dead worker's lease ends soon); None: never, the
        lease just lasts `lease_seconds` (builds run in-process, as tests and benches do).
        `quick_backlog_seqs`: a materialization with at least this many log entries to build makes a quick HNSW
        segment (ef_construction `quick_ef_construction`), and so does every build of a shard with quick
        segments while its data source took at least that many entries in the last `quick_window_s` seconds;
        merges rebuild quick segments at the index's own parameters after that (0: never build quickly). Hidden
        generations (a reindex's) are never built quickly."""
        self.engine = engine
        self.storage = storage
        self.shards = ShardCatalog(engine)
        self.owner = owner or default_owner()
        self.lease_seconds = lease_seconds
        self.heartbeat_s = heartbeat_s
        # The heartbeat of each build running now, by shard (a worker's threads pool shares one builder).
        self._heartbeats: dict[int, LeaseHeartbeat] = {}
        self.policy = policy or MergePolicy()
        self.on_publish = on_publish  # called with (shard id, version id) after a publish committed
        self.keys = KeyCache()  # keys of the shards' segments: a later build marks rows by them
        self.quick_backlog_seqs = quick_backlog_seqs
        self.quick_ef_construction = quick_ef_construction
        self.quick_window_s = quick_window_s
        self.publish_wait_s = 120.0  # how long a merge waits for the lease to publish what it built

    # -- shared steps ---------------------------------------------------------------------------------

    def _leased(self, shard_id: int, run: Callable[[], BuildResult], wait_s: float = 0.0) -> BuildResult:
        # The catalog reports a lease held elsewhere as False; here it becomes the conflict it is (after
        # waiting up to `wait_s` for it). A lease whose owner is a dead process of this machine is taken over at
        # once instead. A shard that is gone (its index dropped) raises NotFoundError from the catalog: nothing
        # to build, so no retry (a LeaseBusyError here made the task retry for minutes).
        deadline = time.monotonic() + wait_s
        while not self.shards.acquire_lease(shard_id, self.owner, self.lease_seconds, owner_is_dead=owner_is_dead):
            if time.monotonic() >= deadline:
                _, left = self.shards.lease_holder(shard_id)
                raise LeaseBusyError(f"index shard {shard_id} is being built by another worker", retry_in=left)
            time.sleep(LEASE_POLL_S)
        heartbeat = None
        if self.heartbeat_s is not None:
            heartbeat = LeaseHeartbeat(self.shards, shard_id, self.owner, self.lease_seconds, self.heartbeat_s)
            self._heartbeats[shard_id] = heartbeat.start()
        try:
            return run()
        finally:
            if heartbeat is not None:
                heartbeat.stop()
                self._heartbeats.pop(shard_id, None)
            self.shards.release_lease(shard_id, self.owner)

    def _publish(
        self,
        shard: ShardRecord,
        active: VersionRecord | None,
        generation: int,
        watermark: int,
        segments: Sequence[SegmentEntry],
    ) -> BuildResult:
        manifest = Manifest(generation, watermark, tuple(segments))
        expected = active.id if active else None
        heartbeat = self._heartbeats.get(shard.id)
        if heartbeat is not None and heartbeat.lost.is_set():
            # Another worker took the lease over (ours lapsed): it builds the shard; ours is garbage for GC.
            raise LeaseBusyError(f"index shard {shard.id}: the build lease was taken over; retry", expected=expected)
        files = manifest_files([manifest])
        new_files = sorted(files - (manifest_files([active.manifest]) if active else set()))
        version_id = self.shards.publish_version(
            shard.id, expected, generation, watermark, manifest.to_json(), files=files,
            # Under the publish's transaction: none of the files this build wrote was collected meanwhile.
            precondition=lambda conn: publishable(conn, new_files),
            lease_owner=self.owner,  # and the lease is still ours: nobody took it over after it lapsed
        )
        if version_id is None:
            # Someone published in between or holds the lease now (only possible after ours lapsed): our files
            # are unreferenced garbage for GC; the next run starts from the new active version.
            raise LeaseBusyError(f"index shard {shard.id} moved on while this build ran; retry", expected=expected)
        if self.on_publish is not None:
            self.on_publish(shard.id, version_id)
        return BuildResult(shard.id, version_id, watermark, True, len(segments))

    def _new_segment(
        self, index: IndexRecord, shard: ShardRecord, source: SourceRecord, generation: int, rows: pa.Table,
        quick: bool = False,
    ) -> SegmentEntry:
        folder = shard_dir(index, shard, generation)
        spec = source.spec
        index_spec = index.spec
        quick = quick and self._can_build_quickly(index)
        if quick:
            params = {**index_spec.params, "ef_construction": self.quick_ef_construction}
            index_spec = replace(index_spec, params=params)
        entry = build_segment(self.storage, folder, index_spec, spec.vectors_are_sparse, spec.vector_dimension, rows)
        return replace(entry, quick=True) if quick else entry

    def _can_build_quickly(self, index: IndexRecord) -> bool:
        """True when a quick build of this index is cheaper than its own (HNSW above the quick ef_construction)
        and the index serves. A hidden generation (a reindex's, built aside, or one kept for rollback) is always
        built at its own parameters: its first build has the whole log as backlog, and a reindex checks recall
        on what was built and swaps that in, so a quick graph there would be judged and served in place of
        the parameters the reindex asked for."""
        if self.quick_backlog_seqs <= 0 or index.spec.algorithm != "hnsw" or is_hidden(index.spec.version):
            return False
        return int(index.spec.params.get("ef_construction", 200)) > self.quick_ef_construction

    def _busy(self, index: IndexRecord, source_id: int, segments: Sequence[SegmentEntry], watermark: int,
              head: int) -> bool:
        """True when the shard has a backlog a quick build is for (ingest outruns the builds), or has quick
        segments while its data source still takes at least `quick_backlog_seqs` entries per `quick_window_s`.
        Under sustained ingest the backlog comes and goes with every build; a merge that caught the shard
        between two of them would rebuild its quick segments at full cost while ingest goes on. Both signals
        live in the catalog (manifests, commit times), so every worker process judges a shard alike."""
        if not self._can_build_quickly(index):
            return False
        if head - watermark >= self.quick_backlog_seqs:
            return True
        if self.quick_window_s <= 0 or not any(s.quick for s in segments):
            return False
        return seqs_committed_within(self.engine, source_id, self.quick_window_s) >= self.quick_backlog_seqs

    # -- materialize --------------------------------------------------------------------------------

    def materialize(self, shard_id: int) -> BuildResult:
        """Bring the shard from its active version's watermark to the data source's head."""
        return self._leased(shard_id, lambda: self._materialize(shard_id))

    def _materialize(self, shard_id: int) -> BuildResult:
        shard, index, source = self.shards.shard_context(shard_id)
        active = self.shards.active_version(shard_id)
        watermark = active.watermark if active else 0
        segments = list(Manifest.of(active.manifest).segments) if active else []
        head, _ = head_of(self.engine, source.id)
        if head <= watermark:
            return BuildResult(shard_id, active.id if active else None, watermark, False, len(segments))

        entries = self._shard_entries(index, shard, source, watermark, head)
        generation = active.generation if active else index.generation
        quick = self._busy(index, source.id, segments, watermark, head)
        if entries.num_rows:
            touched = pc.unique(entries[KEY])
            segments = [self._delete_keys(entry, touched) for entry in segments]
            upserts = fold(entries.to_batches())
            if upserts.num_rows:
                segments.append(self._new_segment(index, shard, source, generation, upserts, quick))
        # A range with nothing for this shard still moves the watermark: the version is exact at `head`.
        return self._publish(shard, active, generation, head, segments)

    def _shard_entries(
        self, index: IndexRecord, shard: ShardRecord, source: SourceRecord, after: int, head: int
    ) -> pa.Table:
        batches = list(read_log(self.engine, self.storage, source.id, after, head))
        if not batches:
            return pa.table({KEY: pa.array([], pa.string())})
        table = pa.Table.from_batches(batches)
        spec = index.spec
        if spec.shard_count > 1:
            mine = shard_numbers(table, spec.shard_attributes, spec.shard_count) == shard.shard_no
            table = table.filter(pa.array(mine))
        return table

    def _delete_keys(self, entry: SegmentEntry, touched: pa.Array) -> SegmentEntry:
        keys = self.keys.get(self.storage, entry)
        hit = np.flatnonzero(pc.is_in(keys, value_set=touched).to_numpy(zero_copy_only=False))
        if not len(hit):
            return entry
        old = read_deletions(self.storage, entry)
        merged = np.union1d(old, hit)
        if len(merged) == len(old):
            return entry
        return write_deletions(self.storage, entry, merged)

    # -- merge ----------------------------------------------------------------------------------------

    def merge(self, shard_id: int, *, force: bool = False) -> BuildResult:
        """Rewrite the shard's segments the policy picks (all of them with `force`) into one, dropping dead
        rows; the watermark stays. Returns changed=False when the policy picks nothing.

        The new segment is built without the shard's lease, so materializations of new data go on meanwhile;
        the lease is taken only to publish, and what they published in between (new segments, rows of the
        merged segments deleted since) is carried over into the merged version."""
        shard, index, source = self.shards.shard_context(shard_id)
        active = self.shards.active_version(shard_id)
        if active is None:
            return BuildResult(shard_id, None, 0, False, 0)
        segments = list(Manifest.of(active.manifest).segments)
        head, _ = head_of(self.engine, source.id)
        busy = self._busy(index, source.id, segments, active.watermark, head)
        chosen = self.pick_for_merge(segments, force, busy=busy)
        if not chosen:
            return BuildResult(shard_id, active.id, active.watermark, False, len(segments))
        picked = [segments[i] for i in chosen]
        t0 = time.monotonic()
        merged = None if force else self._extended(index, shard, source, active.generation, picked, busy)
        how = "extended"
        if merged is None:
            how = "rebuilt"
            rows = pa.concat_tables([self._live_rows(entry) for entry in picked])
            # Quick while the shard is busy (the merge only bounds the segment count then), else at full quality.
            if rows.num_rows:
                merged = self._new_segment(index, shard, source, active.generation, rows, quick=busy)
        log.info("merge of shard %s: %d of %d segments (rows %s%s) %s into %s rows%s in %.2fs", shard_id,
                 len(picked), len(segments), [e.rows for e in picked], ", busy" if busy else "", how,
                 merged.rows if merged else 0, " (quick)" if merged and merged.quick else "", time.monotonic() - t0)
        result = self._leased(shard_id, lambda: self._publish_merge(shard, index, active, picked, merged),
                              wait_s=self.publish_wait_s)
        self.keys.discard(p.id for p in picked)  # replaced: no later build of the shard reads their keys
        return result

    def _live_rows(self, entry: SegmentEntry) -> pa.Table:
        rows = load_rows(self.storage, entry)
        keep = np.ones(rows.num_rows, dtype=bool)
        keep[read_deletions(self.storage, entry)] = False
        return rows.filter(pa.array(keep))

    def _extended(
        self, index: IndexRecord, shard: ShardRecord, source: SourceRecord, generation: int,
        picked: list[SegmentEntry], busy: bool,
    ) -> SegmentEntry | None:
        """The merge of `picked` made by adding the others' live rows to the largest one's engine (which keeps
        its rows, dead ones with their deletions), or None where a build over all the live rows is due. Merging
        small segments into a larger one then costs the small ones' rows only, where a rebuild pays for every
        row again (bench/freshness.py).

        The base is never a segment with too many dead rows. While the shard is busy it is a quick one: rows
        added to a graph are inserted at that graph's own ef_construction, and under a backlog only the quick
        one is cheap enough. At rest it is a full-quality one (quick graphs are due for the index's own
        parameters) without dead rows: a merge at rest leaves clean segments, which a search of a one-segment
        shard answers without masks."""
        candidates = [
            e for e in picked
            if e.rows and e.deleted_count <= self.policy.max_deleted_ratio * e.rows
            and (e.quick if busy else not (e.quick or e.deleted_count))
        ]
        if len(picked) < 2 or not candidates:
            return None
        base = max(candidates, key=lambda e: e.rows)
        rest = [self._live_rows(e) for e in picked if e.id != base.id]
        rows = pa.concat_tables(rest)
        if not rows.num_rows:
            return None
        spec = source.spec
        entry = extend_segment(self.storage, shard_dir(index, shard, generation), index.spec,
                               spec.vectors_are_sparse, spec.vector_dimension, base, load_rows(self.storage, base),
                               rows)
        if entry is None:
            return None
        entry = write_deletions(self.storage, entry, read_deletions(self.storage, base))
        return replace(entry, quick=base.quick)

    def _publish_merge(
        self, shard: ShardRecord, index: IndexRecord, read: VersionRecord, picked: list[SegmentEntry],
        merged: SegmentEntry | None,
    ) -> BuildResult:
        """Publish a merge over the version active now: `read`'s merge as it is if nothing was published since,
        else rebased on what was (LeaseBusyError when a merged segment is gone: another merge won)."""
        active = self.shards.active_version(shard.id)
        if active is None:
            raise LeaseBusyError(f"index shard {shard.id} has no active version any more; retry")
        current = {s.id: s for s in Manifest.of(active.manifest).segments}
        if active.id != read.id:
            if any(p.id not in current for p in picked):
                raise LeaseBusyError(f"index shard {shard.id}: its segments were merged meanwhile; retry")
            if merged is not None:
                merged = self._carry_deletions(picked, [current[p.id] for p in picked], merged)
        ids = {p.id for p in picked}
        rest = [s for s in Manifest.of(active.manifest).segments if s.id not in ids]
        if merged is not None:
            rest.append(merged)
        return self._publish(shard, active, active.generation, active.watermark, rest)

    def _carry_deletions(
        self, before: list[SegmentEntry], after: list[SegmentEntry], merged: SegmentEntry
    ) -> SegmentEntry:
        """`merged` with the rows deleted, since the merge read them, from the segments it was made of (a
        materialization updated or deleted their keys meanwhile)."""
        gone: list[str] = []
        for old, new in zip(before, after, strict=True):
            if new.deleted == old.deleted:
                continue
            fresh = np.setdiff1d(read_deletions(self.storage, new), read_deletions(self.storage, old))
            if len(fresh):
                gone.extend(self.keys.get(self.storage, new).take(pa.array(fresh, pa.int64())).to_pylist())
        if not gone:
            return merged
        return self._delete_keys(merged, pa.array(gone, pa.string()))

    def pick_for_merge(
        self, segments: Sequence[SegmentEntry], force: bool = False, *, busy: bool = False
    ) -> list[int]:
        """Positions of the segments to merge under this builder's policy (`merge_policy.pick`)."""
        return pick(self.policy, segments, force, busy=busy)

    def owes_rebuild(self, shard_id: int) -> bool:
        """True when the shard's active version holds quick segments: a merge rebuilds them at the index's own
        parameters once the shard is no longer busy (a worker looks again `quick_window_s` later)."""
        active = self.shards.active_version(shard_id)
        return bool(active) and any(s.quick for s in Manifest.of(active.manifest).segments)

    def needs_merge(self, shard_id: int) -> bool:
        """True when the merge policy would pick segments in the shard's active version."""
        active = self.shards.active_version(shard_id)
        if not active:
            return False
        segments = Manifest.of(active.manifest).segments
        busy = False
        if any(s.quick for s in segments):
            _, index, source = self.shards.shard_context(shard_id)
            busy = self._busy(index, source.id, segments, active.watermark, head_of(self.engine, source.id)[0])
        return bool(self.pick_for_merge(segments, busy=busy))
