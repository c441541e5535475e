"""Generations of an index and the reindex jobs that make and swap them.

A generation is an ordinary index row (with its shards and versions), so workers build and merge it like any
other; only its version says what it is. The generation serving searches holds the index's own version
(`1.0`); one being built aside, or kept for rollback, holds a hidden version `1.0~g2` that no user name can
take (`~` is not allowed in names) and that lists leave out. A swap renames the two rows in one transaction,
guarded like a compare-and-swap: it happens only if the serving row is still the one the job started from.
Aliases naming the index move with it in the same transaction.

A job belongs to the index whose generations it links (`from_index_id`, `to_index_id`), not to its name: a
name is free for a new index once the old one is dropped or in the trash, and the old one's jobs are not the
new one's. Once an index is dropped for good, its job rows stay (a job is still read by its id) but are marked
as a dropped index's (`forget_jobs`): with their generations gone they link nothing, and no index of the name
(one restored from the trash, older than they are) may take them for its own. A week after the drop (and after
they ended) the trash purge deletes them (`shoal.upkeep.leftovers.sweep_jobs`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, Text, and_, cast, func, literal, or_, select, update
from sqlalchemy.orm import Session

from shoal.catalog.locks import lock_source
from shoal.catalog.models import DataSource, Index, IndexAlias, IndexShard, IndexTag, ReindexJob, Tenant
from shoal.errors import ConflictError, NotFoundError, ReindexConflictError
from shoal.log.records import GENERATION_MARK

HIDDEN = GENERATION_MARK  # version suffix of generations that do not serve: `{version}~g{generation}`
# Key set in a job's `definition` once its index was dropped for good (`forget_jobs`), to the time of the drop
# (marks of before hold `true`); never shown in a JobRecord.
DROPPED = "_index_dropped"


def hidden_version(version: str, generation: int) -> str:
    """The version a non-serving generation is stored under."""
    return f"{version}{HIDDEN}{generation}"


def is_hidden(version: str) -> bool:
    """Whether an index version names a generation that does not serve (built aside or kept for rollback)."""
    return HIDDEN in version


def generation_ids(conn: Connection | Session, index_id: int) -> list[int]:
    """The index rows of every generation of the index `index_id` belongs to: the serving one and those built
    aside or kept for rollback (`{version}~g{n}`), `index_id` among them; empty when it is gone. Generations
    share their data source: an index of the same name over another one (a trashed source's, while a new
    source took its names) is not one of them."""
    row = conn.execute(
        select(Index.tenant_id, Index.name, Index.version, Index.data_source_id).where(Index.id == index_id)
    ).one_or_none()
    if row is None:
        return []
    base = row.version.partition(HIDDEN)[0]
    return list(conn.execute(select(Index.id).where(
        Index.tenant_id == row.tenant_id, Index.name == row.name, Index.data_source_id == row.data_source_id,
        or_(Index.version == base, Index.version.startswith(base + HIDDEN, autoescape=True)),
    ).order_by(Index.id)).scalars())


@dataclass(frozen=True)
class JobRecord:
    """A reindex job: what it builds, how far it got, and how it ended."""

    id: int
    tenant_id: int
    index_name: str
    index_version: str
    from_index_id: int | None
    to_index_id: int | None
    state: str  # building | swapped | failed | cancelled | rolled_back
    progress: float  # 0..1: built watermark / head of the new generation
    eta_s: float | None
    recall: float | None
    gate: float
    error: str | None
    definition: dict[str, Any]
    created_at: dt.datetime
    updated_at: dt.datetime
    finished_at: dt.datetime | None


@dataclass(frozen=True)
class _Lineage:
    """The live index (name, version): the ids of all its generations, and when the index was made."""

    ids: frozenset[int]
    since: dt.datetime | None


def _lineage(s: Session, tenant_id: int, name: str, version: str) -> _Lineage:
    """The live index (name, version)'s generations; none when there is no such live index."""
    serving = s.execute(
        select(Index.id, DataSource.created_at)
        .join(DataSource, DataSource.id == Index.data_source_id)
        .where(Index.tenant_id == tenant_id, Index.name == name, Index.version == version, Index.deleted_at.is_(None))
    ).one_or_none()
    if serving is None:
        return _Lineage(frozenset(), None)
    ids = generation_ids(s, serving.id)
    # When the index was made: a reindex's generation keeps that time (shoal.index.reindex), so the oldest row
    # left carries it however many generations were swept since (a generation made before that rule carries
    # its own, later, time). Never before its data source was made.
    made = s.scalar(select(func.min(Index.created_at)).where(Index.id.in_(ids)))
    return _Lineage(frozenset(ids), max(serving.created_at, made) if made is not None else serving.created_at)


def _of_lineage(row: ReindexJob, lineage: _Lineage) -> bool:
    """Whether the job is one of the index's: not a dropped index's (`forget_jobs`), and it links one of its
    generations, or none any more (both rows went, as a replaced generation's do once their keep time ended)
    and it started once the index was made (a job of an index of the same name dropped before the marking
    existed started before, unless the live index was restored from the trash)."""
    if (row.definition or {}).get(DROPPED):
        return False
    linked = [i for i in (row.from_index_id, row.to_index_id) if i is not None]
    if linked:
        return any(i in lineage.ids for i in linked)
    return lineage.since is not None and row.created_at >= lineage.since


def _job(row: ReindexJob) -> JobRecord:
    return JobRecord(
        row.id, row.tenant_id, row.index_name, row.index_version, row.from_index_id, row.to_index_id, row.state,
        row.progress, row.eta_s, row.recall, row.gate, row.error,
        {k: v for k, v in (row.definition or {}).items() if k != DROPPED}, row.created_at, row.updated_at,
        row.finished_at,
    )


def forget_jobs(conn: Connection, index_ids: Sequence[int]) -> int:
    """Inside the caller's transaction, before it deletes the index rows `index_ids` for good (an owner's drop of
    an index with its generations or of a data source, a trash purge): mark the jobs of those indexes as a
    dropped index's, so that `jobs` of no index of the same name takes them for its own once
    their generation rows are gone (an index restored from the trash is older than they are, so their start
    time does not tell them apart). Marked: the jobs linking one of the rows and, of a live index, those its
    `jobs` lists that link none any more; the mark holds the time of the drop. The rows stay, so a job is still
    read by its id, until `shoal.upkeep.leftovers.sweep_jobs` deletes them a retention later. How many."""
    if not index_ids:
        return 0
    ids = list(index_ids)
    rows = conn.execute(
        select(Index.tenant_id, Index.name, Index.version, Index.created_at, Index.deleted_at,
               DataSource.created_at.label("source_made"))
        .join(DataSource, DataSource.id == Index.data_source_id)
        .where(Index.id.in_(ids))
    ).all()
    since: dict[tuple[int, str, str], dt.datetime] = {}
    for row in rows:
        if row.deleted_at is not None:
            # In the trash: a job that links none of its rows any more cannot be told from one of an index made
            # under the name meanwhile (which may be live): only the linked ones are marked.
            continue
        # When the index was made, as _lineage has it (its generations share one data source).
        made = max(row.created_at, row.source_made)
        key = (row.tenant_id, row.name, row.version.partition(HIDDEN)[0])
        since[key] = min(since.get(key, made), made)
    unlinked = [
        and_(ReindexJob.tenant_id == tenant, ReindexJob.index_name == name, ReindexJob.index_version == version,
             ReindexJob.from_index_id.is_(None), ReindexJob.to_index_id.is_(None), ReindexJob.created_at >= start)
        for (tenant, name, version), start in since.items()
    ]
    return int(conn.execute(
        update(ReindexJob)
        .where(or_(ReindexJob.from_index_id.in_(ids), ReindexJob.to_index_id.in_(ids), *unlinked))
        # The mark holds the time of the drop: the jobs stay readable by id for a retention counted from it
        # (shoal.upkeep.leftovers).
        .values(definition=ReindexJob.definition.op("||")(func.jsonb_build_object(cast(literal(DROPPED), Text),
                                                                                 func.now())))
    ).rowcount or 0)


class Generations:
    """Reindex jobs and generation swaps (catalog side)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def job(self, job_id: int) -> JobRecord:
        """A job by id; NotFoundError if absent."""
        with Session(self.engine) as s:
            row = s.get(ReindexJob, job_id)
            if row is None:
                raise NotFoundError(f"reindex job {job_id} not found")
            return _job(row)

    def jobs(self, tenant_id: int, name: str, version: str) -> list[JobRecord]:
        """The live index's reindex jobs, newest first; not those of an index of the same name that was dropped
        or is in the trash (see the module doc)."""
        with Session(self.engine) as s:
            lineage = _lineage(s, tenant_id, name, version)
            rows = s.scalars(
                select(ReindexJob)
                .where(ReindexJob.tenant_id == tenant_id, ReindexJob.index_name == name,
                       ReindexJob.index_version == version)
                .order_by(ReindexJob.id.desc())
            )
            return [_job(r) for r in rows if _of_lineage(r, lineage)]

    def stalled(self, idle_s: float) -> list[int]:
        """Ids of building jobs that recorded no progress for `idle_s` seconds (their task may be lost)."""
        cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=idle_s)
        with Session(self.engine) as s:
            return list(s.scalars(
                select(ReindexJob.id).where(ReindexJob.state == "building", ReindexJob.updated_at < cutoff)
            ))

    def running(self, tenant_id: int, name: str, version: str) -> JobRecord | None:
        """The live index's job still building (one building a generation of it), if any."""
        with Session(self.engine) as s:
            ids = list(_lineage(s, tenant_id, name, version).ids)
            if not ids:
                return None
            row = s.scalars(
                select(ReindexJob)
                .where(ReindexJob.tenant_id == tenant_id, ReindexJob.state == "building",
                       ReindexJob.from_index_id.in_(ids) | ReindexJob.to_index_id.in_(ids))
                .order_by(ReindexJob.id.desc())
                .limit(1)
            ).one_or_none()
            return _job(row) if row is not None else None

    def set_progress(self, job_id: int, progress: float, eta_s: float | None) -> None:
        """Record how far the new generation got (a job that ended is left alone)."""
        with Session(self.engine) as s, s.begin():
            s.execute(
                update(ReindexJob)
                .where(ReindexJob.id == job_id, ReindexJob.state == "building")
                .values(progress=progress, eta_s=eta_s, updated_at=func.now())
            )

    def finish(self, job_id: int, state: str, *, recall: float | None = None, error: str | None = None) -> bool:
        """End a building job as `state`; False if it had ended already (e.g. cancelled meanwhile). Not a
        conflict: ending a job that ended is a no-op, so the first end wins and the caller moves on."""
        with Session(self.engine) as s, s.begin():
            done = s.execute(
                update(ReindexJob)
                .where(ReindexJob.id == job_id, ReindexJob.state == "building")
                .values(state=state, recall=recall, error=error, progress=1.0 if state == "swapped" else
                        ReindexJob.progress, updated_at=func.now(), finished_at=func.now())
            ).rowcount
        return bool(done)

    def swap(self, job_id: int, recall: float) -> None:
        """Make the job's generation serve, in one transaction: the serving row is renamed to its hidden
        version (kept for rollback), the new one takes the index's version, aliases follow, the job is marked
        swapped and the data source's `last_reindex_at` is set. ConflictError, changing nothing, if the
        serving row is no longer the one the job started from or the job ended meanwhile (reload the job to
        see which)."""
        with Session(self.engine) as s, s.begin():
            # The source row first, then the job and the index rows: the order a soft delete and the drops of a
            # data source take them in (they end its building jobs), so a swap racing one of them waits instead
            # of deadlocking. The job is read unlocked first only to learn its data source.
            to_index = s.scalar(select(ReindexJob.to_index_id).where(ReindexJob.id == job_id))
            source_id = s.scalar(select(Index.data_source_id).where(Index.id == to_index)) if to_index else None
            locked = lock_source(s, source_id, missing_ok=True) if source_id is not None else None
            job = s.get(ReindexJob, job_id, with_for_update=True, populate_existing=True)
            if job is None or job.state != "building" or job.from_index_id is None or job.to_index_id is None:
                raise ConflictError(f"reindex job {job_id} is no longer building", expected="building",
                                    actual=job.state if job is not None else None)
            old = s.get(Index, job.from_index_id, with_for_update=True)
            new = s.get(Index, job.to_index_id, with_for_update=True)
            if old is None or new is None or old.version != job.index_version:
                raise ConflictError(f"reindex job {job_id}: the index changed while its generation was built",
                                    expected=job.from_index_id)
            _swap_rows(s, old, new)
            job.state, job.recall, job.progress = "swapped", recall, 1.0
            job.updated_at = job.finished_at = dt.datetime.now(dt.UTC)
            if locked is not None:
                source = s.get(DataSource, locked.id, populate_existing=True)
                assert source is not None  # locked above
                meta = dict(source.custom_metadata or {})
                meta["last_reindex_at"] = dt.datetime.now(dt.UTC).isoformat()
                source.custom_metadata = meta

    def rollback(self, tenant_id: int, name: str, version: str) -> tuple[int, int]:
        """Serve the generation the last swap replaced again (if still kept); returns (from id, to id)."""
        with Session(self.engine) as s, s.begin():
            # Of this index: a swapped job of a dropped or trashed index of the same name is not its to undo.
            lineage = list(_lineage(s, tenant_id, name, version).ids)
            if not lineage:
                raise NotFoundError(f"index {name!r} version {version!r} not found")
            # The data source's row first, as every writer of these rows takes it (drops, swap): a drop of the
            # index or its source racing this one waits for it, or commits first; never a deadlock.
            source_id = s.scalar(select(Index.data_source_id).where(Index.id == lineage[0]))
            if source_id is None or lock_source(s, source_id, missing_ok=True) is None:
                raise NotFoundError(f"index {name!r} version {version!r} not found")
            lineage = list(_lineage(s, tenant_id, name, version).ids)  # again: a drop may have committed meanwhile
            if not lineage:
                raise NotFoundError(f"index {name!r} version {version!r} not found")
            job = s.scalars(
                select(ReindexJob)
                .where(ReindexJob.tenant_id == tenant_id, ReindexJob.index_name == name,
                       ReindexJob.index_version == version, ReindexJob.state == "swapped",
                       ReindexJob.to_index_id.in_(lineage))
                .order_by(ReindexJob.id.desc())
                .limit(1)
                .with_for_update()
            ).one_or_none()
            if job is None or job.to_index_id is None:
                raise ReindexConflictError(f"index {name!r} version {version!r} has no reindex to roll back")
            serving = s.get(Index, job.to_index_id, with_for_update=True)
            # Swept (the job's link to it is set NULL with its row) or dropped since: the reindex is there, and
            # still listed as swapped, but what it replaced is gone.
            kept = None if job.from_index_id is None else s.get(Index, job.from_index_id, with_for_update=True)
            if kept is None:
                raise ReindexConflictError(
                    f"the generation before the last reindex of {name!r} {version!r} is no longer kept: "
                    "beat's sweep_generations drops it SHOAL_REINDEX_KEEP_S after the swap"
                )
            if serving is None or serving.version != version:
                raise ReindexConflictError(f"index {name!r} version {version!r} changed since its last reindex")
            _swap_rows(s, serving, kept)
            job.state = "rolled_back"
            job.updated_at = dt.datetime.now(dt.UTC)
            return serving.id, kept.id

    def expired_generations(self, keep_s: float, tenant_id: int | None = None) -> list[tuple[int, str, str, str]]:
        """(index id, tenant, name, hidden version) of generations no longer needed: kept for rollback longer
        than `keep_s`, or built by a job that failed or was cancelled, and named by no tag. Not those of an
        index in the trash: they stay with it (a restore brings them back, a purge deletes them)."""
        cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=keep_s)
        with Session(self.engine) as s:
            hidden = s.execute(
                select(Index.id, Tenant.name, Index.name, Index.version)
                .join(Tenant, Tenant.id == Index.tenant_id)
                .where(Index.version.like(f"%{HIDDEN}%"), Index.deleted_at.is_(None),
                       *([Index.tenant_id == tenant_id] if tenant_id else []))
            ).all()
            jobs = s.execute(
                select(ReindexJob.from_index_id, ReindexJob.to_index_id, ReindexJob.state, ReindexJob.updated_at)
            ).all()
            # A tag taken on a generation still answers from it (shoal.index.history): kept until untagged.
            needed: set[int] = set(s.scalars(select(IndexTag.index_id).distinct()))
        for from_id, to_id, state, updated in jobs:
            if state == "building" and to_id is not None:
                needed.add(to_id)  # being built (the job's own failure path removes it)
            elif state == "swapped" and from_id is not None and updated >= cutoff:
                needed.add(from_id)  # rollback target
            elif state == "rolled_back" and to_id is not None and updated >= cutoff:
                needed.add(to_id)
        return sorted((i, t, n, v) for i, t, n, v in hidden if i not in needed)

    def shard_progress(self, index_id: int) -> tuple[int, int]:
        """(lowest built watermark over the index's shards, its data source's head)."""
        with Session(self.engine) as s:
            built = s.scalar(select(func.min(IndexShard.built_watermark)).where(IndexShard.index_id == index_id))
            head = s.scalar(
                select(DataSource.head_seq).join(Index, Index.data_source_id == DataSource.id).where(
                    Index.id == index_id
                )
            )
            return int(built or 0), int(head or 0)


def _swap_rows(s: Session, serving: Index, replacement: Index) -> None:
    version = serving.version
    # Renamed in this order so the (tenant, name, version) uniqueness holds after each statement.
    serving.version = hidden_version(version, serving.generation)
    s.flush()
    replacement.version = version
    s.flush()
    s.execute(update(IndexAlias).where(IndexAlias.index_id == serving.id).values(index_id=replacement.id))
