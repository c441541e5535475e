"""The GC queue and deletion log (`garbage_files`): files no catalog row references, deleted after a grace period.

A row is queued with the time after which its file may go; once GC deleted the file the row stays, with
`deleted_at` set, as the record of that deletion (pruned after DELETION_LOG_DAYS). For a file GC's scan found
(one a build or compaction in flight may still publish) the record is committed before the file leaves
storage (`shoal.upkeep.gc`). A record is final: no version or segment may be published naming a file with one
(`deleted_among`), and queueing the path again never reopens it, except for the few files with fixed names (a
dataset's metadata mirror), which may well be written again. Paths are layout-relative (`tenants/{tenant}/...`),
so every query here can be scoped to one tenant by prefix.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, and_, delete, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from shoal.catalog.locks import in_tenant, lock_sources
from shoal.catalog.models import (
    DataSource,
    GarbageFile,
    Index,
    IndexFile,
    IndexShard,
    IndexVersion,
    LogSegment,
    Tenant,
)
from shoal.log.records import GENERATION_MARK
from shoal.storage import layout

# How long the deletion log keeps the record of a deleted file.
DELETION_LOG_DAYS = 30
UNREFERENCED = "unreferenced"  # found by GC's scan of storage: no row references the file
ENQUEUE_CHUNK = 5_000  # rows per INSERT (three parameters each, well under the protocol's 65,535)
# The one file with a fixed name a folder owner keeps (`layout.dataset_metadata_path`, and its copy in a trash
# folder): every other file GC handles carries a uuid in its name and is never written twice.
FIXED_NAME = "dataset_metadata.json"


@dataclass(frozen=True)
class GarbageRow:
    """One queued file."""

    id: int
    path: str
    reason: str
    delete_after: dt.datetime


def tenant_prefix(tenant: str) -> str:
    """The storage prefix (and garbage path prefix) of one tenant."""
    return layout.tenant_prefix(tenant)


def _escape_like(value: str) -> str:
    return value.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def fixed_name(path: str) -> bool:
    """Whether `path` is a file with a fixed name, which may be written again after GC deleted it: a dataset's
    metadata mirror (`datasets/{name}/dataset_metadata.json`) or its copy in the trash (`trash/{id}/...`)."""
    owner = layout.parse_owner_path(path)
    return owner is not None and path == f"{layout.ROOT}/{owner.tenant}/{owner.kind}/{owner.owner}/{FIXED_NAME}"


def enqueue(
    engine_or_conn: Engine | Connection, paths: Iterable[str], reason: str, delete_after: dt.datetime
) -> int:
    """Queue files for deletion after `delete_after`; a path already queued keeps its row, due at the later of
    the two times (with that time's reason). How many new.

    A path whose row records an earlier deletion keeps that record (nothing is queued): its file was deleted,
    or is being deleted right now, and a build that wrote it must find the record when it publishes. A GC scan
    working from an older listing queues such paths. Only a file with a fixed name (`fixed_name`: a dataset's
    metadata mirror, which may well have been written again since) is queued again. A pending row is never
    brought forward: a drop's grace period (searchers may still reload the file) holds even for a file that
    version pruning queued earlier, due already, and GC has not looked at since."""
    rows = [{"path": p, "reason": reason, "delete_after": delete_after} for p in sorted(set(paths))]
    if not rows:
        return 0
    if not isinstance(engine_or_conn, Connection):
        with engine_or_conn.begin() as conn:
            return enqueue(conn, [r["path"] for r in rows], reason, delete_after)
    queued = 0
    for start in range(0, len(rows), ENQUEUE_CHUNK):  # bounded statements: a drop may queue many files
        chunk_rows = rows[start : start + ENQUEUE_CHUNK]
        reopen = [r for r in chunk_rows if fixed_name(r["path"])]
        final = [r for r in chunk_rows if not fixed_name(r["path"])]
        if final:
            stmt = insert(GarbageFile).values(final).on_conflict_do_nothing(index_elements=[GarbageFile.path])
            queued += len(engine_or_conn.execute(stmt.returning(GarbageFile.id)).all())
        if reopen:
            stmt = insert(GarbageFile).values(reopen)
            stmt = stmt.on_conflict_do_update(
                index_elements=[GarbageFile.path],
                set_={"reason": stmt.excluded.reason, "delete_after": stmt.excluded.delete_after, "deleted_at": None,
                      "created_at": func.now()},
                where=GarbageFile.deleted_at.is_not(None),
            ).returning(GarbageFile.id)
            queued += len(engine_or_conn.execute(stmt).all())
        chunk = [r["path"] for r in chunk_rows]
        engine_or_conn.execute(
            update(GarbageFile)
            .where(GarbageFile.path.in_(chunk), GarbageFile.deleted_at.is_(None),
                   GarbageFile.delete_after < delete_after)
            .values(delete_after=delete_after, reason=reason)
        )
    return queued


def due(
    engine: Engine, now: dt.datetime, *, tenant: str | None = None, reason: str | None = None, limit: int = 10_000
) -> list[GarbageRow]:
    """Queued files whose grace period ended by `now` (of one tenant, of one reason when given), oldest first."""
    with Session(engine) as s:
        q = select(GarbageFile).where(GarbageFile.deleted_at.is_(None), GarbageFile.delete_after <= now)
        if reason is not None:
            q = q.where(GarbageFile.reason == reason)
        if tenant is not None:
            q = q.where(GarbageFile.path.like(_escape_like(tenant_prefix(tenant)) + "%"))
        rows = s.scalars(q.order_by(GarbageFile.delete_after, GarbageFile.id).limit(limit))
        return [GarbageRow(r.id, r.path, r.reason, r.delete_after) for r in rows]


def due_among(
    engine: Engine, paths: Sequence[str], now: dt.datetime, *, reason: str | None = None
) -> list[GarbageRow]:
    """The queued files among `paths` whose grace period ended by `now` (of one reason when given)."""
    found: list[GarbageRow] = []
    paths = sorted(set(paths))
    with Session(engine) as s:
        for start in range(0, len(paths), ENQUEUE_CHUNK):
            q = select(GarbageFile).where(
                GarbageFile.path.in_(paths[start : start + ENQUEUE_CHUNK]),
                GarbageFile.deleted_at.is_(None),
                GarbageFile.delete_after <= now,
            )
            if reason is not None:
                q = q.where(GarbageFile.reason == reason)
            found += [GarbageRow(r.id, r.path, r.reason, r.delete_after) for r in s.scalars(q)]
    return found


def pending(engine: Engine, *, tenant: str | None = None, reason: str | None = None) -> int:
    """How many queued files are not deleted yet (due or not; of one tenant, of one reason when given)."""
    with Session(engine) as s:
        q = select(func.count()).select_from(GarbageFile).where(GarbageFile.deleted_at.is_(None))
        if reason is not None:
            q = q.where(GarbageFile.reason == reason)
        if tenant is not None:
            q = q.where(GarbageFile.path.like(_escape_like(tenant_prefix(tenant)) + "%"))
        return int(s.execute(q).scalar_one())


def lock_log_owner(conn: Connection, tenant: str, source: str, version: str, lock_timeout_ms: int) -> None:
    """Take the row lock of every data source (live or in the trash) whose log folder this is, as commits
    and compactions take it: a commit writing a file there finishes (and publishes its row) first."""
    lock_sources(conn, in_tenant(tenant), DataSource.name == source, DataSource.version == version,
                 lock_timeout_ms=lock_timeout_ms)


def lock_index_owner(conn: Connection, tenant: str, index: str, version: str, shard_no: int) -> None:
    """Share-lock the shard rows (shard `shard_no` of every generation of the index, live or in the trash) whose
    folder a path `tenants/{tenant}/indexes/{index}/{version}/gen-G/shard-{shard_no}/...` is in. A publish
    takes its shard row's lock before it checks its files (`deleted_among`) and holds it until COMMIT, so a
    publish in flight commits first and the reference check that follows sees its files."""
    base = version.partition(GENERATION_MARK)[0]  # a generation's folder keeps the version it was built under
    conn.execute(
        select(IndexShard.id)
        .join(Index, Index.id == IndexShard.index_id)
        .join(Tenant, Tenant.id == Index.tenant_id)
        .where(Tenant.name == tenant, Index.name == index, IndexShard.shard_no == shard_no,
               (Index.version == base) | Index.version.startswith(base + GENERATION_MARK, autoescape=True))
        .order_by(IndexShard.id)
        .with_for_update(read=True)
    ).all()


def log_paths_among(conn: Connection, paths: Sequence[str]) -> set[str]:
    """The paths among `paths` that a log segment row references."""
    if not paths:
        return set()
    return set(conn.scalars(select(LogSegment.path).where(LogSegment.path.in_(list(paths)))))


def index_paths_among(conn: Connection, paths: Sequence[str]) -> set[str]:
    """The paths among `paths` that a kept index version references (`index_files`)."""
    if not paths:
        return set()
    return set(conn.scalars(select(IndexFile.path).where(IndexFile.path.in_(list(paths))).distinct()))


def index_files_of(conn: Connection, index_ids: Sequence[int]) -> set[str]:
    """Every path the versions of these indexes reference. Call it after locking their shards (`lock_shards`):
    a version published meanwhile has then either committed (and is listed) or will fail."""
    if not index_ids:
        return set()
    return set(
        conn.scalars(
            select(IndexFile.path)
            .join(IndexVersion, IndexVersion.id == IndexFile.version_id)
            .join(IndexShard, IndexShard.id == IndexVersion.shard_id)
            .where(IndexShard.index_id.in_(list(index_ids)))
            .distinct()
        )
    )


def lock_shards(conn: Connection, index_ids: Sequence[int]) -> None:
    """Lock the shard rows of these indexes, as a publish takes them (its version insert checks the foreign key,
    its pointer update writes the row): a publish in flight commits first, a later one finds no shard."""
    if index_ids:
        conn.execute(
            select(IndexShard.id).where(IndexShard.index_id.in_(list(index_ids))).with_for_update()
        ).all()


def lock_queued(conn: Connection, ids: Sequence[int]) -> set[int]:
    """Lock these queue rows for a deletion and return the ids still queued (another GC run may have done
    them). A publish naming one of their paths checks them under a share lock (`deleted_among`), so it either
    commits first, and the deletion sees its reference, or sees the file deleted and gives up."""
    if not ids:
        return set()
    return set(
        conn.scalars(
            select(GarbageFile.id)
            .where(GarbageFile.id.in_(list(ids)), GarbageFile.deleted_at.is_(None))
            .with_for_update()
        )
    )


def deleted_among(conn: Connection, paths: Sequence[str]) -> set[str]:
    """The paths among `paths` whose deletion GC recorded (or is recording now: this waits for it to commit);
    the file may still be there for a moment, but it is going. A version or a log segment must not be
    published naming one of them."""
    if not paths:
        return set()
    rows = conn.execute(
        select(GarbageFile.path, GarbageFile.deleted_at).where(GarbageFile.path.in_(list(paths))).with_for_update(
            read=True
        )
    ).all()
    return {path for path, deleted_at in rows if deleted_at is not None}


def recorded_deleted(conn: Connection, paths: Sequence[str]) -> list[GarbageRow]:
    """The rows among `paths` that record a deletion (without waiting for one in flight): for GC's scan, which
    finds a file still there whose deletion was recorded (a run killed between the two steps)."""
    found: list[GarbageRow] = []
    paths = sorted(set(paths))
    for start in range(0, len(paths), ENQUEUE_CHUNK):
        rows = conn.execute(
            select(GarbageFile.id, GarbageFile.path, GarbageFile.reason, GarbageFile.delete_after).where(
                GarbageFile.path.in_(paths[start : start + ENQUEUE_CHUNK]), GarbageFile.deleted_at.is_not(None)
            )
        ).all()
        found += [GarbageRow(*r) for r in rows]
    return found


def mark_deleted(conn: Connection, ids: Sequence[int], now: dt.datetime) -> None:
    """Record the deletion of the files of these rows (a row recorded already keeps its time). For a file a
    publish may still name (one GC's scan found), call it under the row locks (`lock_queued`) and commit before
    deleting the file, so a publish naming it either committed first or finds the record."""
    if ids:
        conn.execute(update(GarbageFile).where(GarbageFile.id.in_(list(ids)), GarbageFile.deleted_at.is_(None))
                     .values(deleted_at=now))


def forget(conn: Connection, ids: Sequence[int]) -> None:
    """Take rows off the queue whose files turned out to be referenced (a commit published them after all)."""
    if ids:
        conn.execute(delete(GarbageFile).where(GarbageFile.id.in_(list(ids))))


def prune_log(engine: Engine, now: dt.datetime) -> int:
    """Drop deletion records older than DELETION_LOG_DAYS; how many."""
    before = now - dt.timedelta(days=DELETION_LOG_DAYS)
    with engine.begin() as conn:
        return int(
            conn.execute(
                delete(GarbageFile).where(and_(GarbageFile.deleted_at.is_not(None), GarbageFile.deleted_at < before))
            ).rowcount
            or 0
        )


def deletion_log(engine: Engine, *, tenant: str | None = None, limit: int = 100) -> list[tuple[str, str, dt.datetime]]:
    """(path, reason, deleted at) of the most recent deletions (of one tenant when given)."""
    with Session(engine) as s:
        q = select(GarbageFile.path, GarbageFile.reason, GarbageFile.deleted_at).where(
            GarbageFile.deleted_at.is_not(None)
        )
        if tenant is not None:
            q = q.where(GarbageFile.path.like(_escape_like(tenant_prefix(tenant)) + "%"))
        rows = s.execute(q.order_by(GarbageFile.deleted_at.desc(), GarbageFile.id.desc()).limit(limit))
        return [(r[0], r[1], r[2]) for r in rows]


def tenants(engine: Engine) -> list[str]:
    """Every tenant's name."""
    with Session(engine) as s:
        return list(s.scalars(select(Tenant.name).order_by(Tenant.name)))



def live_source_names(conn: Connection, tenant: str, names: Sequence[str]) -> set[str]:
    """The names among `names` of the tenant's live data sources (any version)."""
    return _sources_among(conn, tenant, DataSource.name, names, trashed=False)


def trashed_source_ids(conn: Connection, tenant: str, ids: Sequence[int]) -> set[int]:
    """The ids among `ids` of the tenant's data sources in the trash."""
    return _sources_among(conn, tenant, DataSource.id, ids, trashed=True)


def _sources_among(conn: Connection, tenant: str, column: Any, values: Sequence[Any], *, trashed: bool) -> set[Any]:
    if not values:
        return set()
    in_trash = DataSource.deleted_at.is_not(None) if trashed else DataSource.deleted_at.is_(None)
    return set(
        conn.scalars(
            select(column)
            .join(Tenant, Tenant.id == DataSource.tenant_id)
            .where(Tenant.name == tenant, column.in_(list(values)), in_trash)
        )
    )
