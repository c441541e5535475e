"""Materialize and merge index shards: new immutable artifacts, then a compare-and-swap of the active pointer.

Both run under the shard's lease, read the active version, write only new uniquely named files, and publish
a new version whose parent is the one they read. A crash anywhere before the publish leaves the active
version untouched and at most unreferenced files; losing the compare-and-swap discards the attempt. Both
lost races (the lease held by another worker, the active pointer moved) raise LeaseBusyError, a
ConflictError: try again later, from the then active version.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from sqlalchemy import Engine

from shoal.catalog.indexes import IndexRecord, ShardCatalog, ShardRecord, VersionRecord
from shoal.catalog.repo import SourceRecord, head_of
from shoal.errors import LeaseBusyError  # defined with the other errors; still importable from here
from shoal.index.lease import LeaseHeartbeat, default_owner, owner_is_dead
from shoal.index.manifest import Manifest, SegmentEntry
from shoal.index.segment import build_segment, manifest_files, read_deletions, write_deletions
from shoal.index.segment_cache import SegmentCache
from shoal.index.sharding import shard_numbers
from shoal.log.reader import fold, read_log
from shoal.log.validation import KEY
from shoal.storage import Storage, layout
from shoal.upkeep.gc import publishable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MergePolicy:
    """When segments get merged: too many of them, or one with too many dead rows."""

    max_segments: int = 8
    max_deleted_ratio: float = 0.3


@dataclass(frozen=True)
class BuildResult:
    """What a materialize or merge run did."""

    shard_id: int
    version_id: int | None  # the new active version, None when nothing changed
    watermark: int
    changed: bool
    segments: int


def shard_dir(index: IndexRecord, shard: ShardRecord, generation: int) -> str:
    """Layout-relative folder of a shard's segments (DESIGN.md's storage layout)."""
    return layout.shard_dir(index.tenant, index.spec.name, index.spec.version, generation, shard.shard_no)


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
    ) -> None:
        """`lease_seconds`: how long a build's lease lasts unrenewed. `heartbeat_s`: renew it that often while
        a build runs (workers do, with a short lease, so a dead worker's lease ends soon); None: never, the
        lease just lasts `lease_seconds` (builds run in-process, as tests and benches do)."""
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
        self.cache = SegmentCache(keep_unheld=True)  # segments a later build or merge reads again

    # -- shared steps ---------------------------------------------------------------------------------

    def _leased(self, shard_id: int, run: Callable[[], BuildResult]) -> BuildResult:
        # The catalog reports a lease held elsewhere as False; here it becomes the conflict it is. A lease
        # whose owner is a dead process of this machine is taken over at once instead.
        if not self.shards.acquire_lease(shard_id, self.owner, self.lease_seconds, owner_is_dead=owner_is_dead):
            _, left = self.shards.lease_holder(shard_id)
            raise LeaseBusyError(f"index shard {shard_id} is being built by another worker", retry_in=left)
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
        self, index: IndexRecord, shard: ShardRecord, source: SourceRecord, generation: int, rows: pa.Table
    ) -> SegmentEntry:
        folder = shard_dir(index, shard, generation)
        spec = source.spec
        return build_segment(self.storage, folder, index.spec, spec.vectors_are_sparse, spec.vector_dimension, rows)

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
        if entries.num_rows:
            touched = pc.unique(entries[KEY])
            segments = [self._delete_keys(index, entry, touched) for entry in segments]
            upserts = fold(entries.to_batches())
            if upserts.num_rows:
                segments.append(self._new_segment(index, shard, source, generation, upserts))
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

    def _delete_keys(self, index: IndexRecord, entry: SegmentEntry, touched: pa.Array) -> SegmentEntry:
        seg = self.cache.load(self.storage, entry, index.spec)
        hit = np.flatnonzero(pc.is_in(pa.array(seg.keys, pa.string()), value_set=touched).to_numpy(False))
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
        rows; the watermark stays. Returns changed=False when the policy picks nothing."""
        return self._leased(shard_id, lambda: self._merge(shard_id, force))

    def pick_for_merge(self, segments: Sequence[SegmentEntry], force: bool = False) -> list[int]:
        """Positions of the segments to merge: every segment with too many dead rows, plus the smallest
        ones while there are too many segments (tiered: small segments merge first)."""
        if force:
            return list(range(len(segments))) if segments else []
        dead = {
            i
            for i, s in enumerate(segments)
            if s.rows and s.deleted_count / s.rows > self.policy.max_deleted_ratio
        }
        by_size = sorted(range(len(segments)), key=lambda i: segments[i].rows)
        chosen = set(dead)
        # Merging k segments into one removes k-1; take the smallest until the count is back in bounds.
        while len(segments) - len(chosen) + (1 if chosen else 0) > self.policy.max_segments:
            nxt = next(i for i in by_size if i not in chosen)
            chosen.add(nxt)
        if len(chosen) == 1 and not dead:
            return []
        return sorted(chosen)

    def _merge(self, shard_id: int, force: bool) -> BuildResult:
        shard, index, source = self.shards.shard_context(shard_id)
        active = self.shards.active_version(shard_id)
        if active is None:
            return BuildResult(shard_id, None, 0, False, 0)
        segments = list(Manifest.of(active.manifest).segments)
        chosen = self.pick_for_merge(segments, force)
        if not chosen:
            return BuildResult(shard_id, active.id, active.watermark, False, len(segments))
        live: list[pa.Table] = []
        for i in chosen:
            seg = self.cache.load(self.storage, segments[i], index.spec)
            keep = np.ones(seg.rows.num_rows, dtype=bool)
            keep[read_deletions(self.storage, segments[i])] = False
            live.append(seg.rows.filter(pa.array(keep)))
        rows = pa.concat_tables(live)
        rest = [s for i, s in enumerate(segments) if i not in set(chosen)]
        if rows.num_rows:
            rest.append(self._new_segment(index, shard, source, active.generation, rows))
        return self._publish(shard, active, active.generation, active.watermark, rest)

    def needs_merge(self, shard_id: int) -> bool:
        """True when the merge policy would pick segments in the shard's active version."""
        active = self.shards.active_version(shard_id)
        return bool(active and self.pick_for_merge(Manifest.of(active.manifest).segments))
