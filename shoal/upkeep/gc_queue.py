"""The GC queue and deletion log (`garbage_files`): files no catalog row references, deleted after a grace period.

A row is queued with the time after which its file may go; once GC deleted the file the row stays, with
`deleted_at` set, as the record of that deletion (pruned after DELETION_LOG_DAYS). Paths are layout-relative
(`tenants/{tenant}/...`), so every query here can be scoped to one tenant by prefix.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, and_, cast, delete, func, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session
from sqlalchemy.types import Text

from shoal.catalog.models import DataSource, GarbageFile, IndexVersion, LogSegment, Tenant

# How long the deletion log keeps the record of a deleted file.
DELETION_LOG_DAYS = 30
UNREFERENCED = "unreferenced"  # found by GC's scan of storage: no row references the file


@dataclass(frozen=True)
class GarbageRow:
    """One queued file."""

    id: int
    path: str
    reason: str
    delete_after: dt.datetime


def tenant_prefix(tenant: str) -> str:
    """The storage prefix (and garbage path prefix) of one tenant."""
    return f"tenants/{tenant}/"


def _escape_like(value: str) -> str:
    return value.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def enqueue(
    engine_or_conn: Engine | Connection, paths: Iterable[str], reason: str, delete_after: dt.datetime
) -> int:
    """Queue files for deletion after `delete_after`; a path already queued keeps its row. How many new."""
    rows = [{"path": p, "reason": reason, "delete_after": delete_after} for p in paths]
    if not rows:
        return 0
    stmt = (
        insert(GarbageFile)
        .values(rows)
        .on_conflict_do_nothing(index_elements=[GarbageFile.path])
        .returning(GarbageFile.id)
    )
    if isinstance(engine_or_conn, Connection):
        return len(engine_or_conn.execute(stmt).all())
    with engine_or_conn.begin() as conn:
        return len(conn.execute(stmt).all())


def due(engine: Engine, now: dt.datetime, *, tenant: str | None = None, limit: int = 10_000) -> list[GarbageRow]:
    """Queued files whose grace period ended by `now` (of one tenant when given), oldest first."""
    with Session(engine) as s:
        q = select(GarbageFile).where(GarbageFile.deleted_at.is_(None), GarbageFile.delete_after <= now)
        if tenant is not None:
            q = q.where(GarbageFile.path.like(_escape_like(tenant_prefix(tenant)) + "%"))
        rows = s.scalars(q.order_by(GarbageFile.delete_after, GarbageFile.id).limit(limit))
        return [GarbageRow(r.id, r.path, r.reason, r.delete_after) for r in rows]


def pending(engine: Engine, *, tenant: str | None = None) -> int:
    """How many queued files are not deleted yet (due or not)."""
    with Session(engine) as s:
        q = select(func.count()).select_from(GarbageFile).where(GarbageFile.deleted_at.is_(None))
        if tenant is not None:
            q = q.where(GarbageFile.path.like(_escape_like(tenant_prefix(tenant)) + "%"))
        return int(s.execute(q).scalar_one())


def lock_log_owner(conn: Connection, tenant: str, source: str, version: str, lock_timeout_ms: int) -> None:
    """Take the row lock of every data source (live or in the trash) whose log folder this is, as commits
    and compactions take it: a commit writing a file there finishes (and publishes its row) first."""
    conn.execute(text(f"SET LOCAL lock_timeout = '{int(lock_timeout_ms)}ms'"))
    conn.execute(
        select(DataSource.id)
        .join(Tenant, Tenant.id == DataSource.tenant_id)
        .where(Tenant.name == tenant, DataSource.name == source, DataSource.version == version)
        .with_for_update(of=DataSource)
    ).all()


def log_paths_among(conn: Connection, paths: Sequence[str]) -> set[str]:
    """The paths among `paths` that a log segment row references."""
    if not paths:
        return set()
    return set(conn.scalars(select(LogSegment.path).where(LogSegment.path.in_(list(paths)))))


def manifests_mentioning(conn: Connection, fragment: str) -> list[dict[str, Any]]:
    """The manifests of every index version whose JSON text holds `fragment` as a whole string value
    (e.g. a segment's folder): the candidates that may reference a file in it."""
    quoted = '%"' + _escape_like(fragment) + '"%'
    return list(conn.scalars(select(IndexVersion.manifest).where(cast(IndexVersion.manifest, Text).like(quoted))))


def mark_deleted(conn: Connection, ids: Sequence[int], now: dt.datetime) -> None:
    """Record that the files of these rows are gone."""
    if ids:
        conn.execute(update(GarbageFile).where(GarbageFile.id.in_(list(ids))).values(deleted_at=now))


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


def log_paths_of_tenant(engine: Engine, tenant: str) -> set[str]:
    """Every log segment path the catalog holds for the tenant (live sources and those in the trash)."""
    with Session(engine) as s:
        return set(
            s.scalars(
                select(LogSegment.path)
                .join(DataSource, DataSource.id == LogSegment.data_source_id)
                .join(Tenant, Tenant.id == DataSource.tenant_id)
                .where(Tenant.name == tenant)
            )
        )


def tenants(engine: Engine) -> list[str]:
    """Every tenant's name."""
    with Session(engine) as s:
        return list(s.scalars(select(Tenant.name).order_by(Tenant.name)))

