"""The data source's row lock: the one mutex of a data source's log and definition.

Commits, log compactions, GC deletions of log files, drops, soft deletes and generation swaps all take the
same lock, a `SELECT ... FOR UPDATE` on the `data_sources` row, inside the transaction that makes their
change. Whoever holds it sees the head no commit can move and the log files no GC can delete until COMMIT.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Literal, overload

from psycopg.errors import LockNotAvailable
from sqlalchemy import Connection, select, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session
from sqlalchemy.sql import ColumnElement

from shoal.catalog.models import DataSource, Tenant
from shoal.errors import NotFoundError


@dataclass(frozen=True)
class LockedSource:
    """What a transaction holding a data source's row lock knows of it (stable until it ends)."""

    id: int
    tenant_id: int
    name: str
    version: str
    head_seq: int
    deleted_at: dt.datetime | None  # set while the source is in the trash


_COLUMNS = (
    DataSource.id,
    DataSource.tenant_id,
    DataSource.name,
    DataSource.version,
    DataSource.head_seq,
    DataSource.deleted_at,
)


def lock_timed_out(exc: BaseException) -> bool:
    """Whether `exc` is a lock wait that ran past the transaction's lock timeout (`set_lock_timeout`): the
    driver's OperationalError for lock_not_available, nothing written by the statement."""
    return isinstance(exc, OperationalError) and isinstance(exc.orig, LockNotAvailable)


def set_lock_timeout(db: Connection | Session, lock_timeout_ms: int | None) -> None:
    """Bound every lock wait of the current transaction to `lock_timeout_ms` (None: the session's default).

    A wait past it fails the statement with the driver's OperationalError (lock_not_available), a transient
    condition callers retry like a dropped connection.
    """
    if lock_timeout_ms is not None:
        # SET cannot take bind parameters; the int() keeps the text safe.
        db.execute(text(f"SET LOCAL lock_timeout = '{int(lock_timeout_ms)}ms'"))


@overload
def lock_source(
    db: Connection | Session,
    source_id: int,
    *,
    lock_timeout_ms: int | None = ...,
    live: bool = ...,
    missing_ok: Literal[False] = ...,
    during: str = ...,
) -> LockedSource: ...


@overload
def lock_source(
    db: Connection | Session,
    source_id: int,
    *,
    lock_timeout_ms: int | None = ...,
    live: bool = ...,
    missing_ok: Literal[True],
    during: str = ...,
) -> LockedSource | None: ...


def lock_source(
    db: Connection | Session,
    source_id: int,
    *,
    lock_timeout_ms: int | None = None,
    live: bool = False,
    missing_ok: bool = False,
    during: str = "",
) -> LockedSource | None:
    """Take the row lock of data source `source_id` for the rest of the caller's transaction and return the
    locked row.

    NotFoundError when the source does not exist (None instead with `missing_ok`), and with `live` also
    when it is in the trash. `during` completes the error message ("while the batch was in flight").
    Lock waits are bounded by `lock_timeout_ms` (see `set_lock_timeout`).
    """
    set_lock_timeout(db, lock_timeout_ms)
    row = db.execute(select(*_COLUMNS).where(DataSource.id == source_id).with_for_update()).one_or_none()
    suffix = f" {during}" if during else ""
    if row is None:
        if missing_ok:
            return None
        raise NotFoundError(f"data source {source_id} was dropped{suffix}" if during else
                            f"data source {source_id} not found")
    if live and row.deleted_at is not None:
        # Checked under the lock a soft delete also takes: nothing changes a source in the trash.
        raise NotFoundError(f"data source {source_id} is in the trash")
    return LockedSource(*row)


def lock_sources(
    db: Connection | Session,
    *where: ColumnElement[bool],
    lock_timeout_ms: int | None = None,
    skip_locked: bool = False,
) -> list[LockedSource]:
    """Take the row lock of every data source matching `where` (columns of DataSource), in id order so two
    transactions locking overlapping sets cannot deadlock; return the locked rows (possibly none). With
    `skip_locked`, rows another transaction holds are left out instead of waited for (a sweep's choice)."""
    set_lock_timeout(db, lock_timeout_ms)
    query = select(*_COLUMNS).where(*where).order_by(DataSource.id).with_for_update(skip_locked=skip_locked)
    rows = db.execute(query).all()
    return [LockedSource(*r) for r in rows]


def in_tenant(tenant: str) -> ColumnElement[bool]:
    """A `lock_sources` criterion: the data source belongs to the tenant named `tenant`."""
    owner: Any = select(Tenant.id).where(Tenant.name == tenant).scalar_subquery()
    return DataSource.tenant_id == owner
