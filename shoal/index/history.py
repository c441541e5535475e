"""Time travel over index versions: tags that pin versions, the versions that answered as of a seq, and the
pruning of versions nothing may use any more.

Versions are immutable and each names its files, so an old version stays searchable while its row is kept.
Kept are: every shard's active version, every tagged version, every version made within the keep window, and
for each shard the newest version made before that window (so every seq since the window began has a version
at or below it). The rest are deleted, their files queued for the garbage collector, which deletes a file only
when no remaining version or log segment names it.

A tag stands for one seq, the highest watermark among the versions it pinned: shards built to different seqs
answer the log state there, the ones built less far from their pinned version plus the log up to that seq (as an
as_of search does), never half of a batch. Tags taken before the seq was recorded (migration 0012) answer each
shard at its pinned version's watermark.

A tag belongs to the generation it was taken on (shoal.index.generations): after a reindex it still names that
generation's versions, which answer as they were, and the generation is kept while a tag names it. Tag names
are one namespace across an index's generations.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection
from dataclasses import dataclass

from sqlalchemy import Engine, delete, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from shoal.catalog.indexes import VersionRecord, _version
from shoal.catalog.models import Index, IndexShard, IndexTag, IndexVersion, LogCompaction
from shoal.errors import NotFoundError
from shoal.index.generations import generation_ids
from shoal.index.segment import manifest_files
from shoal.log.records import check_name
from shoal.upkeep import gc_queue as garbage

PRUNED = "index-version-pruned"  # garbage reason of files whose versions were pruned


@dataclass(frozen=True)
class Tagged:
    """What a tag pinned: the generation (index row) it was taken on, shard id -> version (None: empty), and the
    seq it stands for (None: a tag taken before seqs were recorded, answered at each version's watermark)."""

    index_id: int
    versions: dict[int, VersionRecord | None]
    seq: int | None = None


def tag(engine: Engine, index_id: int, name: str) -> dict[int, int | None]:
    """Pin the version every shard of the index serves now under `name` (replacing a tag of that name, on this
    generation or an older one), standing for the highest of their watermarks; returns shard id -> version id
    (None for a shard with nothing built yet). NotFoundError when the index is dropped or moved to the trash
    before the tag is written."""
    check_name("tag", name)
    with Session(engine) as s, s.begin():
        # The index row's key share lock until COMMIT (what the tag row's foreign key takes anyway, but taken
        # first and checked): a drop committed since the caller looked the index up is seen here, and one starting
        # now waits for the tag (then deletes it with the index), instead of a foreign key violation.
        live = s.scalar(select(Index.id).where(Index.id == index_id, Index.deleted_at.is_(None))
                        .with_for_update(read=True, key_share=True))
        if live is None:
            raise NotFoundError(f"index {index_id} was dropped or moved to the trash while tag {name!r} was taken")
        shards = s.execute(
            select(IndexShard.id, IndexShard.active_version_id, IndexVersion.watermark)
            .outerjoin(IndexVersion, IndexVersion.id == IndexShard.active_version_id)
            .where(IndexShard.index_id == index_id)
        ).all()
        versions = {int(sid): (int(v) if v is not None else None) for sid, v, _ in shards}
        # One statement: the versions and their watermarks are of one moment. The shards built less far answer
        # at this seq through the log (a search naming the tag reads it), so none shows half of a batch.
        seq = max((int(w) for _, _, w in shards if w is not None), default=0)
        others = [g for g in generation_ids(s, index_id) if g != index_id]
        if others:
            s.execute(delete(IndexTag).where(IndexTag.index_id.in_(others), IndexTag.tag == name))
        s.execute(
            insert(IndexTag)
            .values(index_id=index_id, tag=name, versions={str(k): v for k, v in versions.items()}, seq=seq)
            .on_conflict_do_update(index_elements=[IndexTag.index_id, IndexTag.tag],
                                   set_={"versions": {str(k): v for k, v in versions.items()}, "seq": seq})
        )
    return versions


def tags(engine: Engine, index_id: int) -> dict[str, dict[int, int | None]]:
    """The index's tags, on every generation: name -> shard id -> version id."""
    with Session(engine) as s:
        rows = s.execute(select(IndexTag.tag, IndexTag.versions).where(
            IndexTag.index_id.in_(generation_ids(s, index_id))))
        return {t: {int(k): v for k, v in vs.items()} for t, vs in rows}


def untag(engine: Engine, index_id: int, name: str) -> None:
    """Remove a tag, on whichever generation holds it (its versions become prunable like any other, and a
    generation no tag names any more is dropped once its keep time is over); NotFoundError if there is none."""
    with Session(engine) as s, s.begin():
        gone = s.execute(delete(IndexTag).where(IndexTag.index_id.in_(generation_ids(s, index_id)),
                                                IndexTag.tag == name)).rowcount
    if not gone:
        raise NotFoundError(f"tag {name!r} not found")


def tagged_versions(engine: Engine, index_id: int, name: str) -> Tagged:
    """The generation the tag was taken on and the versions it pinned; NotFoundError if there is no such tag."""
    with Session(engine) as s:
        row = s.execute(select(IndexTag.index_id, IndexTag.versions, IndexTag.seq).where(
            IndexTag.index_id.in_(generation_ids(s, index_id)), IndexTag.tag == name)).first()
        if row is None:
            raise NotFoundError(f"tag {name!r} not found")
        pinned = {int(k): v for k, v in row.versions.items()}
        ids = [v for v in pinned.values() if v is not None]
        found = {r.id: _version(r) for r in s.scalars(select(IndexVersion).where(IndexVersion.id.in_(ids)))}
    return Tagged(int(row.index_id), {sid: (found[v] if v is not None else None) for sid, v in pinned.items()},
                  None if row.seq is None else int(row.seq))


def versions_as_of(engine: Engine, index_id: int, seq: int) -> dict[int, VersionRecord | None]:
    """Shard id -> the newest kept version whose watermark is at or below `seq` (None: the shard's history
    starts empty and every version of it came later). The log between each version's watermark and `seq`
    answers the rest exactly, so it must not have been compacted there: NotFoundError otherwise, and when
    the versions that far back were pruned."""
    if seq < 0:
        raise NotFoundError(f"no index version as of seq {seq}")
    with Session(engine) as s:
        shard_ids = list(s.scalars(select(IndexShard.id).where(IndexShard.index_id == index_id)))
        out: dict[int, VersionRecord | None] = {}
        for sid in shard_ids:
            rows = list(s.scalars(
                select(IndexVersion).where(IndexVersion.shard_id == sid).order_by(IndexVersion.watermark.desc(),
                                                                                   IndexVersion.id.desc())
            ))
            at = next((r for r in rows if r.watermark <= seq), None)
            # Seq 0 is the empty log before any write: every shard answers it with no version (none pruned).
            if at is None and seq > 0 and rows and rows[-1].parent_id is not None:
                raise NotFoundError(f"index versions as of seq {seq} were pruned (SHOAL_VERSION_KEEP_S)")
            out[sid] = _version(at) if at is not None else None
        source_id = _source_of(s, index_id)
    starts = [v.watermark if v else 0 for v in out.values()]
    check_log_kept(engine, source_id, min(starts, default=seq), seq, starts=starts)
    return out


def check_log_kept(
    engine: Engine, source_id: int, lowest: int, seq: int, tag: str | None = None, *, starts: Collection[int] = ()
) -> None:
    """Refuse (NotFoundError) a time travel to `seq` from versions whose lowest watermark is `lowest` when a
    compaction dropped entries of the log between them: read from there, the log shows keys missing or old
    values, a state that never existed. As `Shoal.read_log`, a read from seq 0 (a shard pinned with no version)
    up to a seq at or past the compaction's bound is exact and allowed, unless one of `starts` (the watermark
    each shard reads from, when the caller knows them) lies above 0 and below the bound. A search checks again
    after it read the log (compaction may commit between the check and the read; the read sees the log wholly
    before or wholly after it, and how far compactions dropped never goes back), so it answers from a whole log
    or refuses. `tag`: the tag searched."""
    if lowest >= seq:
        return
    # How far compactions dropped entries (not how far they reached: a run that only merged segments leaves
    # every entry, with its seq, in the log).
    with engine.connect() as conn:
        compacted = int(conn.execute(
            select(LogCompaction.dropped_through).where(LogCompaction.data_source_id == source_id)
        ).scalar_one_or_none() or 0)
    if lowest >= compacted:
        return
    # From seq 0 the compacted range holds the latest entry of every key at its seq (superseded ones and
    # expired tombstones of keys no longer there are gone): folded up to the bound or past it, it shows the state
    # there exactly. From a version inside that range the expired tombstones of keys it holds are missing.
    if lowest == 0 and seq >= compacted and all(w == 0 or w >= compacted for w in starts):
        return
    if tag is not None:
        raise NotFoundError(
            f"the log below seq {compacted} was compacted: tag {tag!r} stands for seq {seq}, and a shard it "
            f"pinned was built only to seq {lowest}; take the tag again"
        )
    # (A version above the bound cannot answer a seq below it: time travel starts from versions at or below it.)
    raise NotFoundError(
        f"the log below seq {compacted} was compacted: time travel to seq {seq} would read it from seq {lowest}, "
        f"where the kept versions at or below seq {seq} stop; search seq {compacted} or later, a seq a kept "
        f"version was built to exactly, or a tag"
    )


def _source_of(s: Session, index_id: int) -> int:
    return int(s.scalar(select(Index.data_source_id).where(Index.id == index_id)) or 0)


def prune_versions(
    engine: Engine, keep_s: float, grace_s: float, *, now: dt.datetime | None = None, index_id: int | None = None
) -> int:
    """Delete the versions nothing may use any more (see the module doc; of one index when `index_id` is
    given) and queue their files for the garbage collector; returns how many versions went."""
    now = now or dt.datetime.now(dt.UTC)
    cutoff = now - dt.timedelta(seconds=keep_s)
    with Session(engine) as s, s.begin():
        pinned = {v for vs in s.scalars(select(IndexTag.versions)) for v in vs.values() if v is not None}
        active = {v for v in s.scalars(select(IndexShard.active_version_id)) if v is not None}
        query = select(IndexVersion.id, IndexVersion.shard_id, IndexVersion.created_at, IndexVersion.manifest)
        if index_id is not None:
            query = query.join(IndexShard, IndexShard.id == IndexVersion.shard_id).where(
                IndexShard.index_id == index_id
            )
        rows = s.execute(
            query.order_by(IndexVersion.shard_id, IndexVersion.created_at.desc(), IndexVersion.id.desc())
        ).all()
        doomed: list[int] = []
        files: set[str] = set()
        newest_before: dict[int, int] = {}
        for vid, sid, created, manifest in rows:
            if created >= cutoff or vid in active or vid in pinned:
                continue
            if sid not in newest_before:
                newest_before[sid] = vid  # the version in force when the keep window began
                continue
            doomed.append(vid)
            files.update(manifest_files([manifest]))
        if doomed:
            s.execute(delete(IndexVersion).where(IndexVersion.id.in_(doomed)))
            garbage.enqueue(s.connection(), sorted(files), PRUNED, now + dt.timedelta(seconds=grace_s))
    return len(doomed)
