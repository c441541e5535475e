"""The trash: soft delete, restore and purge of data sources (with their indexes).

A soft-deleted data source keeps its rows and its files where they are; the catalog marks it: the data
source's `deleted_at` and `purge_after`, and `deleted_at` on each of its indexes. Every tenant-scoped lookup
(`Catalog`, `IndexCatalog`, aliases, the dataset catalog) ignores marked rows, so a source in the trash is
not found exactly like a missing one, builds stop (`ShardCatalog.shard_context`), and its names are free
for reuse (the unique indexes cover live rows only). Restoring clears the marks unless a live data source or
index took one of the names meanwhile (AlreadyExistsError), or the retention ended.

The purge (beat's `purge_trash`, `shoal trash purge`) is rows first, then files, through a logged list:

1. one transaction locks the source row (a commit in flight finishes first, a later one finds no row),
   records every file its rows reference in `trash_files` (log segments; index segment folders, one
   uuid-named folder per index segment; the source's trash folder) and deletes the rows (the cascade takes
   segments, batches, indexes, shards, versions and aliases);
2. the files on that list are deleted, each deletion logged, then the list's rows.

A crash before step 1's COMMIT changes nothing; after it no row references any of the files, and the next
run deletes what is left on the list first. Deleting an already deleted file is not an error, so two purges
at once, or one run twice, are harmless.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs
from sqlalchemy import Engine, delete, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from shoal.catalog.models import DataSource, Index, IndexShard, IndexVersion, LogSegment, Tenant, TrashFile
from shoal.catalog.repo import _spec
from shoal.errors import AlreadyExistsError, NotFoundError
from shoal.log.records import DataSourceSpec
from shoal.storage import Storage

log = logging.getLogger(__name__)


def trash_dir(tenant: str, source_id: int) -> str:
    """Layout-relative folder of what a soft-deleted data source keeps in the trash (DESIGN.md's
    `tenants/{tenant}/trash/...`): keyed by the source's id, since its name may be reused meanwhile."""
    return f"tenants/{tenant}/trash/{source_id}"


@dataclass(frozen=True)
class TrashedSource:
    """A data source in the trash."""

    id: int
    tenant: str
    spec: DataSourceSpec
    head_seq: int
    created_at: dt.datetime
    deleted_at: dt.datetime
    purge_after: dt.datetime
    indexes: tuple[tuple[str, str], ...]  # (name, version) of the indexes that went to the trash with it


@dataclass
class PurgeResult:
    """What one purge run deleted."""

    sources: list[tuple[str, str, str, int]]  # (tenant, name, version, id) of each purged data source
    files: int = 0  # files and index segment folders deleted (already missing ones not counted)
    pending: int = 0  # entries of the logged list finished from an earlier, interrupted run

    def to_json(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "purged": [{"tenant": t, "name": n, "version": v, "id": i} for t, n, v, i in self.sources],
            "files_deleted": self.files,
            "pending_finished": self.pending,
        }


def _trashed(s: Session, row: DataSource, tenant: str) -> TrashedSource:
    indexes = s.execute(
        select(Index.name, Index.version).where(Index.data_source_id == row.id).order_by(Index.name, Index.version)
    ).all()
    assert row.deleted_at is not None and row.purge_after is not None
    return TrashedSource(
        row.id, tenant, _spec(row), row.head_seq, row.created_at, row.deleted_at, row.purge_after,
        tuple((n, v) for n, v in indexes),
    )


class Trash:
    """The trash of one tenant."""

    def __init__(self, engine: Engine, tenant_id: int, tenant: str) -> None:
        self.engine = engine
        self.tenant_id = tenant_id
        self.tenant = tenant

    def _trashed_row(self, s: Session, source_id: int, *, lock: bool = False) -> DataSource:
        q = select(DataSource).where(
            DataSource.id == source_id, DataSource.tenant_id == self.tenant_id, DataSource.deleted_at.is_not(None)
        )
        row = s.scalars(q.with_for_update() if lock else q).one_or_none()
        if row is None:
            raise NotFoundError(f"data source #{source_id} is not in the trash of tenant {self.tenant!r}")
        return row

    def soft_delete(self, name: str, version: str, retention: dt.timedelta) -> TrashedSource:
        """Move the live data source `name`/`version` and its indexes to the trash until `retention` from now;
        NotFoundError if there is no such live source."""
        with Session(self.engine) as s, s.begin():
            # The row lock waits for a commit in flight on the source, so none lands half way through.
            row = s.scalars(
                select(DataSource)
                .where(
                    DataSource.tenant_id == self.tenant_id,
                    DataSource.name == name,
                    DataSource.version == version,
                    DataSource.deleted_at.is_(None),
                )
                .with_for_update()
            ).one_or_none()
            if row is None:
                raise NotFoundError(f"data source {name!r} version {version!r} not found in tenant {self.tenant!r}")
            now = s.scalar(select(func.now()))
            assert now is not None
            row.deleted_at = now
            row.purge_after = now + retention
            s.execute(
                update(Index)
                .where(Index.data_source_id == row.id, Index.deleted_at.is_(None))
                .values(deleted_at=now)
            )
            s.flush()
            trashed = _trashed(s, row, self.tenant)
        log.info(
            "trash: data source %s/%s (#%d) of tenant %s moved to the trash with indexes %s; purge after %s",
            name, version, trashed.id, self.tenant, [f"{n}/{v}" for n, v in trashed.indexes] or "none",
            trashed.purge_after.isoformat(),
        )
        return trashed

    def list(self, name: str | None = None) -> list[TrashedSource]:
        """The tenant's data sources in the trash (of one name when given), most recently deleted first."""
        with Session(self.engine) as s:
            q = select(DataSource).where(DataSource.tenant_id == self.tenant_id, DataSource.deleted_at.is_not(None))
            if name is not None:
                q = q.where(DataSource.name == name)
            rows = s.scalars(q.order_by(DataSource.deleted_at.desc(), DataSource.id.desc())).all()
            return [_trashed(s, r, self.tenant) for r in rows]

    def get(self, source_id: int) -> TrashedSource:
        """One data source in the trash, by id; NotFoundError if it is not there."""
        with Session(self.engine) as s:
            return _trashed(s, self._trashed_row(s, source_id), self.tenant)

    def restore(self, source_id: int) -> TrashedSource:
        """Take the data source and its indexes out of the trash, as they were.

        NotFoundError if it is not in the trash or its retention ended (the purge owns it then);
        AlreadyExistsError, changing nothing, if a live data source or index took one of its names meanwhile.
        """
        with Session(self.engine) as s, s.begin():
            row = self._trashed_row(s, source_id, lock=True)
            now = s.scalar(select(func.now()))
            assert row.purge_after is not None and now is not None
            if row.purge_after <= now:
                raise NotFoundError(
                    f"data source {row.name!r} version {row.version!r} (#{row.id}) cannot be restored: its retention "
                    f"ended at {row.purge_after.isoformat()} and it is being purged"
                )
            trashed = _trashed(s, row, self.tenant)
            taken = s.scalar(
                select(DataSource.id).where(
                    DataSource.tenant_id == self.tenant_id, DataSource.name == row.name,
                    DataSource.version == row.version, DataSource.deleted_at.is_(None),
                )
            )
            if taken is not None:
                raise AlreadyExistsError(
                    f"cannot restore data source {row.name!r} version {row.version!r}: a live data source took "
                    "that name while it was in the trash"
                )
            for index_name, index_version in trashed.indexes:
                if s.scalar(
                    select(Index.id).where(
                        Index.tenant_id == self.tenant_id, Index.name == index_name, Index.version == index_version,
                        Index.deleted_at.is_(None),
                    )
                ) is not None:
                    raise AlreadyExistsError(
                        f"cannot restore data source {row.name!r} version {row.version!r}: a live index took the "
                        f"name {index_name!r} version {index_version!r} of its index while it was in the trash"
                    )
            row.deleted_at = None
            row.purge_after = None
            s.execute(update(Index).where(Index.data_source_id == row.id).values(deleted_at=None))
            try:
                s.flush()
            except IntegrityError:  # a create raced the checks above: the unique indexes decide
                raise AlreadyExistsError(
                    f"cannot restore data source {row.name!r} version {row.version!r}: its name, or an index's, "
                    "was taken while it was in the trash"
                ) from None
        log.info("trash: data source %s/%s (#%d) of tenant %s restored from the trash",
                 trashed.spec.name, trashed.spec.version, trashed.id, self.tenant)
        return trashed

    def expire(self, source_ids: Sequence[int] | None = None) -> list[int]:
        """End the retention now of the given sources in the trash (all of the tenant's when None), so the
        next purge deletes them; the ids of those in the trash."""
        with Session(self.engine) as s, s.begin():
            scope = [DataSource.tenant_id == self.tenant_id, DataSource.deleted_at.is_not(None)]
            if source_ids is not None:
                scope.append(DataSource.id.in_(list(source_ids)))
            expired = list(s.scalars(
                update(DataSource)
                .where(*scope, DataSource.purge_after > func.now())
                .values(purge_after=func.now())
                .returning(DataSource.id)
            ))
            ids = sorted(s.scalars(select(DataSource.id).where(*scope)))
        if expired:
            log.info("trash: retention of data sources %s of tenant %s ended now (purge asked for)",
                     sorted(expired), self.tenant)
        return ids

    def purge(self, storage: Storage, source_ids: Sequence[int] | None = None) -> PurgeResult:
        """Purge now the given sources in the trash (all of the tenant's when None), retention or not."""
        ids = self.expire(source_ids)
        return purge_due(self.engine, storage, source_ids=ids)


# -- the purge ----------------------------------------------------------------------------------------------


def due_sources(engine: Engine, source_ids: Sequence[int] | None = None) -> list[int]:
    """Ids of the data sources in the trash whose retention has ended (of `source_ids` when given)."""
    with Session(engine) as s:
        q = select(DataSource.id).where(DataSource.deleted_at.is_not(None), DataSource.purge_after <= func.now())
        if source_ids is not None:
            q = q.where(DataSource.id.in_(list(source_ids)))
        return list(s.scalars(q.order_by(DataSource.purge_after, DataSource.id)))


def purge_due(engine: Engine, storage: Storage, *, source_ids: Sequence[int] | None = None) -> PurgeResult:
    """Finish any interrupted purge, then purge every data source whose retention ended (of `source_ids` when
    given): rows, then files. Idempotent; safe to run concurrently and to kill at any point."""
    result = PurgeResult([])
    if source_ids is None:  # a global run first finishes what an interrupted one left on the list
        result.pending = _drain(engine, storage, None, result)
    else:
        for source_id in source_ids:
            result.pending += _drain(engine, storage, source_id, result)
    for source_id in due_sources(engine, source_ids):
        purged = _queue(engine, source_id)
        if purged is not None:
            result.sources.append(purged)
        _drain(engine, storage, source_id, result)
    return result


def _queue(engine: Engine, source_id: int) -> tuple[str, str, str, int] | None:
    """Step 1: in one transaction, list the source's files in `trash_files` and delete its rows. None when
    the source is no longer due (restored, or purged by someone else meanwhile)."""
    with Session(engine) as s, s.begin():
        row = s.scalars(
            select(DataSource)
            .where(DataSource.id == source_id, DataSource.deleted_at.is_not(None),
                   DataSource.purge_after <= func.now())
            .with_for_update(skip_locked=True)
        ).one_or_none()
        if row is None:
            return None
        tenant = s.scalars(select(Tenant.name).where(Tenant.id == row.tenant_id)).one()
        index_ids = list(s.scalars(select(Index.id).where(Index.data_source_id == row.id)))
        # Lock the shards: a version being published now either commits before (and is listed) or fails after.
        shard_ids = list(
            s.scalars(select(IndexShard.id).where(IndexShard.index_id.in_(index_ids)).with_for_update())
        ) if index_ids else []
        manifests = list(
            s.scalars(select(IndexVersion.manifest).where(IndexVersion.shard_id.in_(shard_ids)))
        ) if shard_ids else []
        files = list(s.scalars(select(LogSegment.path).where(LogSegment.data_source_id == row.id)))
        dirs: set[str] = {trash_dir(tenant, row.id)}
        for manifest in manifests:
            for entry in manifest.get("segments", ()):
                folder = entry["dir"]
                dirs.add(folder)
                deleted = (entry.get("deleted") or {}).get("path")
                if deleted and not deleted.startswith(folder + "/"):
                    files.append(deleted)
        entries = [{"path": p, "is_dir": False} for p in sorted(set(files))]
        entries += [{"path": d, "is_dir": True} for d in sorted(dirs)]
        s.execute(
            insert(TrashFile),
            [{"tenant": tenant, "data_source_id": row.id, **e} for e in entries],
        )
        s.execute(delete(DataSource).where(DataSource.id == row.id))  # cascades to every row below it
        log.info(
            "purge: deleted the catalog rows of data source %s/%s (#%d) of tenant %s (in the trash since %s): "
            "%d log segments, %d indexes, %d index versions; %d files and folders to delete",
            row.name, row.version, row.id, tenant, row.deleted_at.isoformat() if row.deleted_at else "?",
            len(set(files)), len(index_ids), len(manifests), len(entries),
        )
        return tenant, row.name, row.version, row.id


def _drain(engine: Engine, storage: Storage, source_id: int | None, result: PurgeResult) -> int:
    """Step 2: delete the listed files (of one source, or every one left over), then their list entries.
    Returns how many entries were finished."""
    with Session(engine) as s:
        q = select(TrashFile.id, TrashFile.tenant, TrashFile.data_source_id, TrashFile.path, TrashFile.is_dir)
        if source_id is not None:
            q = q.where(TrashFile.data_source_id == source_id)
        entries = s.execute(q.order_by(TrashFile.id)).all()
    if not entries:
        return 0
    done: list[int] = []
    try:
        for entry_id, tenant, owner, path, is_dir in entries:
            if _delete(storage, path, is_dir):
                result.files += 1
                log.info("purge: deleted %s %s (data source #%d of tenant %s)",
                         "folder" if is_dir else "file", path, owner, tenant)
            done.append(entry_id)
    finally:
        if done:
            with Session(engine) as s, s.begin():
                s.execute(delete(TrashFile).where(TrashFile.id.in_(done)))
    return len(done)


def _delete(storage: Storage, path: str, is_dir: bool) -> bool:
    """Delete a file, or a folder and everything in it; False when it was already gone. Other errors
    (storage unreachable) propagate: the entry stays on the list for the next run."""
    full = storage.path(path)
    try:
        if is_dir:
            if storage.fs.get_file_info(full).type == pafs.FileType.NotFound:
                return False
            storage.fs.delete_dir(full)
        else:
            storage.fs.delete_file(full)
    except FileNotFoundError:
        return False
    return True


def pending_files(engine: Engine) -> int:
    """How many entries of the purge's logged list are still to delete (0 once every purge finished)."""
    with Session(engine) as s:
        return int(s.scalar(select(func.count()).select_from(TrashFile)) or 0)

