"""The trash: soft delete, restore and purge of data sources (with their indexes).

A soft-deleted data source keeps its rows and its files where they are; the catalog marks it: the data
source's `deleted_at` and `purge_after`, and `deleted_at` on each of its indexes. Every tenant-scoped lookup
(`Catalog`, `IndexCatalog`, aliases, the dataset catalog) ignores marked rows, so a source in the trash is
not found exactly like a missing one, builds stop (`ShardCatalog.shard_context`; a reindex still building
ends as cancelled), and its names are free for reuse (the unique indexes cover live rows only). Restoring
clears the marks unless a live data source or index took one of the names meanwhile (AlreadyExistsError), or
the retention ended.

The purge (beat's `purge_trash`, `shoal trash purge`) is "delete rows, queue files", then deletes what it
queued at once:

1. one transaction locks the source row (a commit in flight finishes first, a later one finds no row) and
   its indexes' shards (a publish in flight commits first, a later one fails), queues into GC's queue
   (`garbage_files`, reason `trash-purged`, due at once) every file its rows reference (log segments, the
   files of every index version) and the files of its trash folder, and deletes the rows (the cascade takes
   segments, batches, indexes, shards, versions and aliases);
2. given a Redis client, the source's Redis keys (announced head, index token) are deleted, best effort
   (`shoal.upkeep.leftovers`): the soft delete announced the drop already, and no restore can need them now;
3. the queued files are deleted through GC's checked deletion, each deletion logged.

A full run (every due source, as beat's runs) also runs the backstop `leftovers.sweep`: the Redis keys of data
sources no row has (with a client) and the reindex jobs of dropped indexes past their retention (7 days).

Grace 0 is safe here: the source and its indexes have been hidden from every lookup since the soft delete,
for the whole retention, so no searcher still reads their files. A crash before step 1's COMMIT changes
nothing; after it, no row references any of the files and they wait in the queue, where the next purge (or
GC run) deletes them. Deleting an already deleted file is not an error, so two purges at once, or one run
twice, are harmless.

A purge asked for now (`Trash.purge`: `DELETE /api/v1/trash/{id}`, `shoal trash purge --now`) ends the
retention first, in a commit of its own, so that from then on no restore can race it. Its step 1 then waits for
the source's row lock (bounded by the lock timeout) where beat's sweep skips a locked row: a restore holding it
finds the retention ended and refuses, so the purge that waited deletes (or the restore had committed first,
and the purge finds the source no longer in the trash). If it then fails before deleting a source's rows (step
1 lists the trash folder: a storage outage fails it; or another holder kept the row lock past the timeout), it
puts that retention back: the caller was told to retry (ConflictError for the lock), and the source stays in the
trash, restorable, as if the purge was never asked for.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
from sqlalchemy import Engine, func, select, update
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.orm import Session

from shoal.catalog.locks import lock_source, lock_sources, lock_timed_out, set_lock_timeout
from shoal.catalog.models import DataSource, Index, Tenant
from shoal.catalog.repo import _spec
from shoal.errors import AlreadyExistsError, ConflictError, NotFoundError
from shoal.index.generations import is_hidden
from shoal.log.records import DataSourceSpec
from shoal.storage import Storage
from shoal.storage.layout import trash_dir
from shoal.upkeep import gc_queue as garbage
from shoal.upkeep import leftovers
from shoal.upkeep.drops import cancel_reindexes, delete_now, delete_source_rows

log = logging.getLogger(__name__)


PURGED = "trash-purged"  # garbage reason of the files of a purged data source


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
    files: int = 0  # files deleted (already missing ones not counted)
    pending: int = 0  # queued files of an earlier, interrupted purge finished by this run
    keys: int = 0  # Redis keys of deleted data sources deleted (shoal.upkeep.leftovers)
    jobs: int = 0  # reindex jobs of dropped indexes deleted past their retention (a full run's backstop)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "purged": [{"tenant": t, "name": n, "version": v, "id": i} for t, n, v, i in self.sources],
            "files_deleted": self.files,
            "pending_finished": self.pending,
            "redis_keys_deleted": self.keys,
            "reindex_jobs_deleted": self.jobs,
        }


def _trashed(s: Session, row: DataSource, tenant: str) -> TrashedSource:
    indexes = s.execute(
        select(Index.name, Index.version).where(Index.data_source_id == row.id).order_by(Index.name, Index.version)
    ).all()
    assert row.deleted_at is not None and row.purge_after is not None
    return TrashedSource(
        row.id, tenant, _spec(row), row.head_seq, row.created_at, row.deleted_at, row.purge_after,
        # Generations built aside (`{version}~g{n}`) are no index of their own: lists leave them out.
        tuple((n, v) for n, v in indexes if not is_hidden(v)),
    )


class Trash:
    """The trash of one tenant."""

    def __init__(self, engine: Engine, tenant_id: int, tenant: str) -> None:
        self.engine = engine
        self.tenant_id = tenant_id
        self.tenant = tenant

    def _trashed_row(self, s: Session, source_id: int, *, lock: bool = False) -> DataSource:
        if lock:
            lock_source(s, source_id, missing_ok=True)
        q = select(DataSource).where(
            DataSource.id == source_id, DataSource.tenant_id == self.tenant_id, DataSource.deleted_at.is_not(None)
        )
        row = s.scalars(q.execution_options(populate_existing=True)).one_or_none()
        if row is None:
            raise NotFoundError(f"data source #{source_id} is not in the trash of tenant {self.tenant!r}")
        return row

    def soft_delete(
        self, name: str, version: str, retention: dt.timedelta, *, source_id: int | None = None
    ) -> TrashedSource:
        """Move the live data source `name`/`version` and its indexes to the trash until `retention` from now;
        NotFoundError if there is no such live source (or, with `source_id`, if the live one is another: the
        source the caller read was dropped or replaced meanwhile, and a newer one is not the caller's to move)."""
        where = [DataSource.tenant_id == self.tenant_id, DataSource.name == name, DataSource.version == version,
                 DataSource.deleted_at.is_(None)]
        if source_id is not None:
            where.append(DataSource.id == source_id)
        with Session(self.engine) as s, s.begin():
            # The row lock waits for a commit in flight on the source, so none lands half way through.
            locked = lock_sources(s, *where)
            row = s.get(DataSource, locked[0].id, populate_existing=True) if locked else None
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
            # Builds stop in the trash, so a reindex could never finish; left building, it would keep a new
            # index under the name from being reindexed. A restore brings the index back as it serves.
            index_ids = list(s.scalars(select(Index.id).where(Index.data_source_id == row.id)))
            cancel_reindexes(s.connection(), index_ids, "the data source was moved to the trash")
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
            try:
                # Flushed here, inside the try: the UPDATE of the indexes below would otherwise autoflush the
                # source row's change first, and its unique violation escape as an internal error.
                s.flush()
                s.execute(update(Index).where(Index.data_source_id == trashed.id).values(deleted_at=None))
                s.flush()
            except IntegrityError:  # a create raced the checks above: the unique indexes decide
                # Named from `trashed`: the failed flush rolled the session back, and `row` cannot be read now.
                raise AlreadyExistsError(
                    f"cannot restore data source {trashed.spec.name!r} version {trashed.spec.version!r}: its name, "
                    "or an index's, was taken while it was in the trash"
                ) from None
        log.info("trash: data source %s/%s (#%d) of tenant %s restored from the trash",
                 trashed.spec.name, trashed.spec.version, trashed.id, self.tenant)
        return trashed

    def expire(self, source_ids: Sequence[int] | None = None) -> list[int]:
        """End the retention now of the given sources in the trash (all of the tenant's when None), so the
        next purge deletes them; the ids of those in the trash."""
        return self._expire(source_ids)[0]

    def _expire(
        self, source_ids: Sequence[int] | None, lock_timeout_ms: int | None = None
    ) -> tuple[list[int], dict[int, tuple[dt.datetime, dt.datetime]]]:
        """`expire`, telling also what it changed: {id: (the retention it ended, the one it set)}. With
        `lock_timeout_ms`, ConflictError (nothing changed) when a row lock stays held longer than that."""
        try:
            return self._expire_locked(source_ids, lock_timeout_ms)
        except OperationalError as exc:
            if lock_timeout_ms is None or not lock_timed_out(exc):
                raise
            raise ConflictError(
                f"data sources of tenant {self.tenant!r} in the trash were held by another transaction (a commit, "
                f"a GC run, a restore) for more than {lock_timeout_ms} ms; nothing changed: retry the purge",
                expected="purged", actual="in the trash",
            ) from None

    def _expire_locked(
        self, source_ids: Sequence[int] | None, lock_timeout_ms: int | None
    ) -> tuple[list[int], dict[int, tuple[dt.datetime, dt.datetime]]]:
        with Session(self.engine) as s, s.begin():
            set_lock_timeout(s, lock_timeout_ms)
            scope = [DataSource.tenant_id == self.tenant_id, DataSource.deleted_at.is_not(None)]
            if source_ids is not None:
                scope.append(DataSource.id.in_(list(source_ids)))
            # Read under the row locks the UPDATE then takes anyway (in id order: two purges cannot deadlock),
            # so the retentions read are the ones it ends.
            before = {row.id: row.purge_after for row in s.execute(
                select(DataSource.id, DataSource.purge_after)
                .where(*scope, DataSource.purge_after > func.now())
                .order_by(DataSource.id)
                .with_for_update()
            )}
            ended = s.execute(
                update(DataSource)
                .where(DataSource.id.in_(list(before)))
                .values(purge_after=func.now())
                .returning(DataSource.id, DataSource.purge_after)
            ).all() if before else []
            ids = sorted(s.scalars(select(DataSource.id).where(*scope)))
        changed = {i: (before[i], now) for i, now in ended if before[i] is not None and now is not None}
        if changed:
            log.info("trash: retention of data sources %s of tenant %s ended now (purge asked for)",
                     sorted(changed), self.tenant)
        return ids, changed

    def _put_back(self, changed: dict[int, tuple[dt.datetime, dt.datetime]]) -> list[int]:
        """Give back their retention to the sources of `changed` (`_expire`'s) still in the trash with the
        retention `_expire` set (not purged, nor restored or expired again meanwhile); their ids."""
        back: list[int] = []
        with Session(self.engine) as s, s.begin():
            # No lock timeout of its own: after a purge skipped a source whose row lock another transaction
            # (a commit, a GC run) held past the timeout, this waits for that transaction to end, as a restore
            # would. Giving up instead would leave the source unrestorable until beat's next purge.
            for source_id, (retention, ended_at) in sorted(changed.items()):
                back += s.scalars(
                    update(DataSource)
                    .where(DataSource.id == source_id, DataSource.deleted_at.is_not(None),
                           DataSource.purge_after == ended_at)
                    .values(purge_after=retention)
                    .returning(DataSource.id)
                )
        return back

    def purge(
        self,
        storage: Storage,
        source_ids: Sequence[int] | None = None,
        *,
        redis_client: redis.Redis | None = None,
        lock_timeout_ms: int = 30_000,
    ) -> PurgeResult:
        """Purge now the given sources in the trash (all of the tenant's when None), retention or not; with
        `redis_client`, their Redis keys go too (`purge_due`). Each source's row lock is waited for, up to
        `lock_timeout_ms`: a restore holding it either commits first (the source is no longer in the trash and
        is left out of the result) or refuses (its retention ended) and this purge deletes the source.

        A purge that raises (the storage is unavailable, say) leaves each source it did not purge in the trash
        with its retention as it was: restorable, and purged by beat's run once that retention ends. So does
        ConflictError, raised when a source asked for is still in the trash after the run (another transaction
        held its row lock past `lock_timeout_ms`); a retry purges it."""
        ids, changed = self._expire(source_ids, lock_timeout_ms)
        try:
            result = purge_due(self.engine, storage, source_ids=ids, redis_client=redis_client,
                               wait_ms=lock_timeout_ms)
        except Exception as exc:
            # The retention was ended only so that this purge finds the sources due (and no restore races it);
            # left ended, a failed purge would leave them unrestorable, the caller told to retry later.
            self._give_back(changed, exc)
            raise
        self._refuse_unpurged(ids, result, changed)
        return result

    def _refuse_unpurged(
        self, ids: Sequence[int], result: PurgeResult, changed: dict[int, tuple[dt.datetime, dt.datetime]]
    ) -> None:
        """ConflictError, after giving their retention back, if sources of `ids` that `result` did not purge are
        still in the trash: answered "not found" instead, the caller would think them gone while they stay
        listed, and with their retention left ended no restore could take them back."""
        purged = {i for _, _, _, i in result.sources}
        with Session(self.engine) as s:
            left = sorted(s.scalars(select(DataSource.id).where(
                DataSource.id.in_([i for i in ids if i not in purged]), DataSource.deleted_at.is_not(None)
            )))
        if not left:  # each one was purged, restored, or purged by someone else meanwhile
            return
        error = ConflictError(
            f"data sources {left} of tenant {self.tenant!r} were not purged: another transaction (a commit, a "
            "GC run, a restore) held their row lock past the lock timeout; they stay in the trash as they were: "
            "retry the purge",
            expected="purged", actual="in the trash",
        )
        self._give_back({i: changed[i] for i in left if i in changed}, error)
        raise error

    def _give_back(self, changed: dict[int, tuple[dt.datetime, dt.datetime]], failure: Exception) -> None:
        """`_put_back` after a failed purge, logged; if that fails too, the sources stay due (beat purges
        them)."""
        if not changed:  # the purge ended no retention (each had ended already): nothing to put back
            return
        try:
            back = self._put_back(changed)
        except Exception as exc:  # noqa: BLE001 - the purge's own error is the one to raise
            log.warning("trash: a purge of data sources %s of tenant %s failed (%s), and their retention could "
                        "not be put back (%s): beat's next purge run purges them", sorted(changed), self.tenant,
                        failure, exc)
            return
        if back:
            log.info("trash: a purge of data sources %s of tenant %s failed (%s); they stay in the trash, "
                     "restorable until their retention ends", back, self.tenant, failure)


# -- the purge ----------------------------------------------------------------------------------------------


def due_sources(engine: Engine, source_ids: Sequence[int] | None = None) -> list[int]:
    """Ids of the data sources in the trash whose retention has ended (of `source_ids` when given)."""
    with Session(engine) as s:
        q = select(DataSource.id).where(DataSource.deleted_at.is_not(None), DataSource.purge_after <= func.now())
        if source_ids is not None:
            q = q.where(DataSource.id.in_(list(source_ids)))
        return list(s.scalars(q.order_by(DataSource.purge_after, DataSource.id)))


def purge_due(
    engine: Engine,
    storage: Storage,
    *,
    source_ids: Sequence[int] | None = None,
    lock_timeout_ms: int = 30_000,
    redis_client: redis.Redis | None = None,
    wait_ms: int | None = None,
) -> PurgeResult:
    """Purge every data source in the trash whose retention ended (of `source_ids` when given): its rows go
    and its files are queued in one transaction, then its Redis keys (with `redis_client`; best effort) and its
    files are deleted. A run over every source first runs the backstop (`leftovers.sweep`: keys of deleted
    data sources, with `redis_client`, and reindex jobs of dropped indexes past their retention) and finishes
    what an interrupted run left queued. Idempotent; safe to run concurrently and to kill anywhere.

    A source whose row lock another transaction holds is skipped (beat's sweep takes it next time), unless
    `wait_ms` is given (a purge asked for now): then the lock is waited for up to `wait_ms`, and a source still
    locked after it is skipped (`Trash.purge` tells the caller to retry)."""
    result = PurgeResult([])

    def announce(row: garbage.GarbageRow) -> None:
        result.files += 1
        log.info("purge: deleted file %s", row.path)

    if source_ids is None:
        # First: it needs no storage, so a storage outage (which fails what follows) does not stop it.
        swept = leftovers.sweep(engine, redis_client)
        result.keys, result.jobs = swept.keys, swept.jobs
        queued = garbage.due(engine, dt.datetime.now(dt.UTC), reason=PURGED)
        if queued:
            done = delete_now(engine, storage, [r.path for r in queued], reason=PURGED,
                              lock_timeout_ms=lock_timeout_ms, announce=announce)
            result.pending = done.deleted + done.already_gone + done.kept
    for source_id in due_sources(engine, source_ids):
        purged = _delete_rows(engine, storage, source_id, wait_ms)
        if purged is None:
            continue
        owner, files = purged
        result.sources.append(owner)
        # Its rows are gone for good, and the soft delete announced the drop: the keys have no reader left.
        result.keys += leftovers.forget_source_keys(redis_client, [source_id])
        delete_now(engine, storage, files, reason=PURGED, lock_timeout_ms=lock_timeout_ms, announce=announce)
    return result


def _delete_rows(
    engine: Engine, storage: Storage, source_id: int, wait_ms: int | None = None
) -> tuple[tuple[str, str, str, int], list[str]] | None:
    """Step 1: in one transaction, delete the source's rows and queue their files (and its trash folder's).
    None when the source is no longer due (restored, or purged by someone else meanwhile) or its row lock is
    held by another transaction (skipped at once; with `wait_ms`, once that wait ran out)."""
    try:
        return _delete_locked_rows(engine, storage, source_id, wait_ms)
    except OperationalError as exc:
        if wait_ms is None or not lock_timed_out(exc):
            raise
        # Rolled back: nothing changed. The caller tells whoever asked for the purge to retry.
        log.warning("purge: data source #%d skipped: its row lock (or a shard's) stayed held past %d ms",
                    source_id, wait_ms)
        return None


def _delete_locked_rows(
    engine: Engine, storage: Storage, source_id: int, wait_ms: int | None
) -> tuple[tuple[str, str, str, int], list[str]] | None:
    """`_delete_rows`, the lock timeout raised as the driver's OperationalError."""
    with Session(engine) as s, s.begin():
        # Beat's sweep skips a locked row (its next run takes it). A purge asked for now waits: a restore holding
        # the lock refuses an ended retention and lets go, and skipping would leave the source in the trash,
        # due to no one but beat's next run, and answer the caller "not in the trash".
        locked = lock_sources(s, DataSource.id == source_id, DataSource.deleted_at.is_not(None),
                              DataSource.purge_after <= func.now(), lock_timeout_ms=wait_ms,
                              skip_locked=wait_ms is None)
        row = s.get(DataSource, source_id, populate_existing=True) if locked else None
        if row is None:
            return None
        tenant = s.scalars(select(Tenant.name).where(Tenant.id == row.tenant_id)).one()
        name, version, deleted_at = row.name, row.version, row.deleted_at
        indexes = len(list(s.scalars(select(Index.id).where(Index.data_source_id == row.id))))
        # The trash folder's files (a dataset's mirror) are listed here, so they are queued with the rows. A
        # storage outage (StorageUnavailableError, retried by the task) rolls the whole step back.
        extra = storage.list_files(trash_dir(tenant, row.id))
        files = delete_source_rows(s.connection(), row.id, PURGED, dt.datetime.now(dt.UTC), extra)
    log.info(
        "purge: deleted the catalog rows of data source %s/%s (#%d) of tenant %s (in the trash since %s) with "
        "%d indexes; %d files queued for deletion",
        name, version, source_id, tenant, deleted_at.isoformat() if deleted_at else "?", indexes, len(files),
    )
    return (tenant, name, version, source_id), files


def pending_files(engine: Engine) -> int:
    """How many files of purged data sources are queued and not deleted yet (0 once every purge finished)."""
    return garbage.pending(engine, reason=PURGED)
