"""What a searcher holds in memory: per index, per shard, the loaded segments of one active version."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from shoal.catalog.indexes import IndexRecord, VersionRecord
from shoal.catalog.repo import SourceRecord
from shoal.engines.base import Engine, get_engine
from shoal.engines.metrics import higher_is_nearer as _higher_is_nearer
from shoal.index.manifest import Manifest
from shoal.index.segment import LoadedSegment, read_deletions
from shoal.index.segment_cache import SegmentCache
from shoal.searcher.hits import RowSource
from shoal.storage import Storage


@dataclass(frozen=True)
class SegmentView:
    """A loaded segment plus the deletions one version records for it."""

    segment: LoadedSegment
    deleted: np.ndarray  # bool per row
    deleted_count: int
    source: RowSource  # what hits of this segment read their attributes and vectors from


@dataclass(frozen=True)
class ShardView:
    """One shard as served: the version's id and watermark, and its segments."""

    shard_id: int
    shard_no: int
    version_id: int | None
    watermark: int
    segments: tuple[SegmentView, ...]


@dataclass(frozen=True)
class IndexView:
    """An index as served: definition, data source and one view per shard. Immutable: swapped whole."""

    index: IndexRecord
    source: SourceRecord
    shards: tuple[ShardView, ...]

    # Derived once per view (cached_property writes the instance dict directly, so it suits a frozen
    # dataclass): every search reads them.
    @cached_property
    def min_watermark(self) -> int:
        """The lowest served watermark over the shards."""
        return min((s.watermark for s in self.shards), default=0)

    @cached_property
    def versions(self) -> tuple[int | None, ...]:
        """The served version id of each shard (None: nothing built yet), in shard order."""
        return tuple(s.version_id for s in self.shards)

    @cached_property
    def engine_class(self) -> type[Engine]:
        """The engine class of the index's algorithm (it checks per-search parameters)."""
        return get_engine(self.index.spec.algorithm)

    @cached_property
    def one_block(self) -> tuple[Engine, tuple[RowSource]] | None:
        """The engine and rows of an index served by a single engine over all its rows (one shard, one
        segment, one split, nothing deleted, some rows), the common case of a small or freshly merged index;
        else None."""
        if len(self.shards) != 1 or len(self.shards[0].segments) != 1:
            return None
        seg = self.shards[0].segments[0]
        if seg.deleted_count or len(seg.segment.splits) != 1 or not len(seg.segment.splits[0].engine):
            return None
        return seg.segment.splits[0].engine, (seg.source,)

    @cached_property
    def shard_numbers(self) -> frozenset[int]:
        """The numbers of the shards this view holds."""
        return frozenset(s.shard_no for s in self.shards)

    @cached_property
    def partial(self) -> bool:
        """True when the view holds only some of the index's shards (placement: the others are other nodes')."""
        return len(self.shards) < len(self.index.shards)

    @cached_property
    def parts(self) -> dict[frozenset[int], IndexView]:
        """Views of some of this view's shards, by their numbers, made for searches restricted to them."""
        return {}

    @cached_property
    def filter_cache(self) -> dict[str, Any]:
        """Filters parsed and checked for this view, by a digest of their JSON text (shoal.searcher.searcher);
        dropped with the view."""
        return {}

    @cached_property
    def higher_is_nearer(self) -> bool:
        """True when a larger distance is nearer (dot product)."""
        return _higher_is_nearer(self.index.spec.metric)


def load_shard(
    storage: Storage,
    cache: SegmentCache,
    index: IndexRecord,
    shard_id: int,
    shard_no: int,
    version: VersionRecord | None,
) -> ShardView:
    """Load a shard at `version` (None: empty, watermark 0); checksums of every file are verified."""
    if version is None:
        return ShardView(shard_id, shard_no, None, 0, ())
    views = []
    stored = index.spec.stored_attributes()
    for entry in Manifest.of(version.manifest).segments:
        segment = cache.load(storage, entry, index.spec)
        deleted = np.zeros(segment.rows.num_rows, dtype=bool)
        gone = read_deletions(storage, entry)
        deleted[gone] = True
        views.append(SegmentView(segment, deleted, int(len(gone)), RowSource(segment.rows, stored, segment.py_columns)))
    return ShardView(shard_id, shard_no, version.id, version.watermark, tuple(views))
