"""The young tier: the log entries an index's served versions do not reflect yet, decoded once and searched
exactly beside the built segments.

A searcher keeps one `TailCache` per index: the entries (start, end] of the data source's log, where start
is the lowest watermark the shards served when it was read. Log segments are immutable, so a newer tail
extends an older one by reading only what was committed since, and its shards' tails are extended with the new
entries alone (shoal.searcher.tails: the engines over older upserts are kept); a newly served version (a
higher watermark) only filters the entries it already holds, and derives its tails from them once. Strong and
at_least searches extend it to the seq they need; for eventual searches the searcher extends it in the
background as commits announce new heads, up to SHOAL_YOUNG_TIER_MAX_SEQS entries past the served watermark.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import pyarrow as pa
import pyarrow.compute as pc

from shoal.log.validation import SEQ
from shoal.searcher.tails import Tail, build_tails, extend_tails, per_shard
from shoal.searcher.views import IndexView

# Reads the log entries (after, up_to] of the view's data source; None when there are none.
LogRead = Callable[[int, int], pa.Table | None]


@dataclass(frozen=True)
class TailCache:
    """The young tier of one index as read for one set of served versions. Immutable: replaced whole."""

    versions: tuple[int | None, ...]  # the served version of each shard the tails were derived for
    start: int  # the entries are those above this seq ...
    end: int  # ... up to and including this one
    entries: pa.Table | None
    tails: dict[int, Tail]  # shard number -> what that shard's served version does not reflect
    stamps: tuple[tuple[int, float], ...]  # (last seq of a read, when it was read), oldest first
    # The served view the tails were derived for: with them, a consistent answer even after a newer version
    # was swapped in and before its own tails are derived.
    view: IndexView = field(compare=False, repr=False)

    @cached_property
    def nbytes(self) -> int:
        """Estimated bytes this young tier holds in memory: the entries read and the shards' tails (their
        upserts, exact engines and masks). Taken once, when first asked: `extend` derives what the tails need
        before it makes the cache, and the cache is replaced whole, never grown."""
        stored = len(self.view.index.spec.stored_attributes())
        # The buffers held, each counted once: what memory holds (a slice keeps its whole buffer), and a sum of
        # sizes, where Table.nbytes walks every chunk's values (ms with 50 chunks, after every extension).
        entries = self.entries.get_total_buffer_size() if self.entries is not None else 0
        return entries + sum(t.nbytes(stored) for t in self.tails.values())

    def size(self, shard_no: int) -> int:
        """Keys the shard's young tier touches (upserts and deletions not yet built)."""
        tail = self.tails.get(shard_no)
        return len(tail.touched) if tail is not None else 0

    def age(self, watermark: int, now: float) -> float:
        """Seconds since this searcher read the oldest entry above `watermark` (0 when it holds none)."""
        for last_seq, read_at in self.stamps:
            if last_seq > watermark:
                return max(0.0, now - read_at)
        return 0.0


def extend(cache: TailCache | None, view: IndexView, required: int, read: LogRead | None, now: float) -> TailCache:
    """The young tier of `view` up to at least `required` (as far as `cache` already reaches, if further),
    reusing what `cache` holds: its entries, and the tails of shards whose served version did not change (they
    are extended by the new entries alone; a shard with a new version derives its tail from the entries held)."""
    versions = view.versions
    start = view.min_watermark
    entries: pa.Table | None = None
    end = start
    stamps: tuple[tuple[int, float], ...] = ()
    kept: dict[int, Tail] = {}  # tails of the shards whose served version is the one they were derived for
    unchanged: set[int] = set()
    if cache is not None and cache.start <= start <= cache.end:
        end, stamps = cache.end, tuple(s for s in cache.stamps if s[0] > start)
        entries = cache.entries
        if entries is not None and cache.start < start:
            entries = entries.filter(pc.greater(entries[SEQ], start))  # what the new versions built is dropped
        if len(cache.versions) == len(versions):
            unchanged = {s.shard_no for s, old in zip(view.shards, cache.versions, strict=True) if old == s.version_id}
            kept = {n: t for n, t in cache.tails.items() if n in unchanged}
    held = entries  # what the cache held that the new versions still need
    new = None
    if required > end and read is not None:
        new = read(end, required)
        if new is not None and new.num_rows:
            entries = new if entries is None or not entries.num_rows else pa.concat_tables([entries, new])
        stamps = (*stamps, (required, now))
        end = required
    changed = {s.shard_no for s in view.shards} - unchanged
    tails = dict(kept)
    cut = _cut(cache, view, changed, held) if cache is not None and cache.start <= start <= cache.end else {}
    tails.update({n: t for n, t in cut.items() if t is not None})
    rebuild = changed - cut.keys()
    if rebuild and entries is not None and entries.num_rows:
        tails.update(build_tails(view, entries, rebuild))
    grow = unchanged | cut.keys()
    if grow and new is not None and new.num_rows:
        tails = extend_tails(view, tails, new, grow)
    warm(view, tails)
    return TailCache(versions, start, end, entries, tails, stamps, view)


def warm(view: IndexView, tails: dict[int, Tail]) -> None:
    """Derive, now, what queries over these tails need (the rows each hides, exact engines over its upserts),
    so the first query after a tail changes does not pay for it."""
    spec, source = view.index.spec, view.source.spec
    for shard in view.shards:
        tail = tails.get(shard.shard_no)
        if tail is None:
            continue
        for seg_view in shard.segments:
            tail.hidden_rows(seg_view.segment)
        tail.groups(spec, source)


def _cut(cache: TailCache, view: IndexView, changed: set[int], held: pa.Table | None) -> dict[int, Tail | None]:
    """The tails of the `changed` shards whose new version moved their watermark up, cut from the cache's
    (`Tail.cut`; None: no entry above the new watermark). A shard whose watermark went down (a version built
    anew) is left out: its tail is derived from the entries again."""
    before = {s.shard_no: s.watermark for s in cache.view.shards}
    up = {s.shard_no for s in view.shards if s.shard_no in changed and before.get(s.shard_no, s.watermark + 1)
          <= s.watermark}
    out: dict[int, Tail | None] = dict.fromkeys(up)
    if up and held is not None and held.num_rows:
        marks = {s.shard_no: s.watermark for s in view.shards}
        for n, mine in per_shard(view, held, up):
            old = cache.tails.get(n)
            if old is None:
                del out[n]  # entries its old tail should have held: derive it anew rather than trust it
            else:
                out[n] = old.cut(marks[n], mine)
    return out
