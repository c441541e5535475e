"""Deleting catalog rows that reference files: one transaction deletes the rows and queues their files.

This is the only way published files leave storage (see `shoal.upkeep.gc`): the transaction that deletes the
rows naming files also queues those files into `garbage_files`, so a crash right after its COMMIT leaves them
queued, and the next GC run deletes them; a crash before it changes nothing.

The grace a drop gives its files:

- an index or a data source dropped by its owner (`drop_index`, `drop_data_source`): the normal grace
  (SHOAL_GC_GRACE_S). Searchers keep serving a dropped index from memory until they notice the drop (within
  SHOAL_SEARCHER_POLL_S plus a refresh, README "Fast paths"), may reload a segment they had evicted meanwhile,
  and a strong search may be reading the dropped source's log tail; the grace lets them finish. The count
  these return is of files queued, not yet deleted.
- a generation dropped by a reindex (failed or cancelled: it never served; or replaced more than
  SHOAL_REINDEX_KEEP_S ago) and a data source the trash purge deleted (hidden since its soft delete, for its
  whole retention): no searcher can still read them, so they are due at once, and the caller deletes them
  right after the COMMIT through GC's checked deletion (`delete_now`).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable, Sequence

from sqlalchemy import Connection, Engine, delete, func, select, update

from shoal.catalog.locks import lock_source
from shoal.catalog.models import DataSource, Index, LogSegment, ReindexJob
from shoal.errors import NotFoundError
from shoal.index.generations import forget_jobs, generation_ids
from shoal.storage import Storage
from shoal.upkeep import gc
from shoal.upkeep import gc_queue as garbage

log = logging.getLogger(__name__)

INDEX_DROPPED = "index-dropped"
SOURCE_DROPPED = "data-source-dropped"
GENERATION_DROPPED = "generation-dropped"
RELEASED = "released"  # files a caller gave up without a row (a dataset's metadata mirror)


def drop_index(
    engine: Engine,
    index_id: int,
    *,
    reason: str = INDEX_DROPPED,
    delete_after: dt.datetime,
    version: str | None = None,
    generations: bool = False,
) -> list[str]:
    """Delete the live index `index_id` (still under `version` when given: a swap renames generations) with
    its shards and versions, and queue every file its versions referenced to go after `delete_after`, in one
    transaction; the files queued. With `generations` (an owner's drop), every other generation of the index
    goes with it (one being built, one kept for rollback or for a tag), a reindex still building ends as
    cancelled, and the index's jobs are marked as a dropped index's (`generations.forget_jobs`), so a new index
    under the name, or one restored from the trash, starts clean. NotFoundError if the index is gone, in the
    trash or renamed."""
    with engine.begin() as conn:
        # Locks in the order every writer of these rows takes them: the data source's row, then the index row,
        # then the shards. A drop of the data source (source, shards, then the index rows its DELETE cascades to)
        # racing this one waits for it, or commits first and this finds no index; never a deadlock.
        source_id = conn.scalar(select(Index.data_source_id).where(Index.id == index_id))
        if source_id is None or lock_source(conn, source_id, missing_ok=True) is None:
            raise NotFoundError(f"index {index_id} not found")
        query = select(Index.id).where(Index.id == index_id, Index.deleted_at.is_(None))
        if version is not None:
            query = query.where(Index.version == version)
        found = conn.execute(query.with_for_update()).one_or_none()
        if found is None:
            raise NotFoundError(f"index {index_id} not found")
        ids = generation_ids(conn, index_id) if generations else [index_id]
        garbage.lock_shards(conn, ids)  # a publish in flight commits first (and is listed) or fails
        files = sorted(garbage.index_files_of(conn, ids))
        if generations:
            cancel_reindexes(conn, ids, "the index was dropped")
            forget_jobs(conn, ids)  # gone for good: no index of the name (one restored from the trash) lists them
        conn.execute(delete(Index).where(Index.id.in_(ids)))  # cascades to shards, versions, index_files
        garbage.enqueue(conn, files, reason, delete_after)
    return files


def cancel_reindexes(conn: Connection, index_ids: Sequence[int], why: str) -> int:
    """Inside the caller's transaction: end as cancelled (with `why` as the error) every reindex still building
    from or into one of these indexes, so none is left building for an index that is gone (it would block a
    reindex of a new index under the name); how many."""
    if not index_ids:
        return 0
    ids = list(index_ids)
    return int(conn.execute(
        update(ReindexJob)
        .where(ReindexJob.state == "building", ReindexJob.from_index_id.in_(ids) | ReindexJob.to_index_id.in_(ids))
        .values(state="cancelled", error=why, updated_at=func.now(), finished_at=func.now())
    ).rowcount or 0)


def drop_data_source(engine: Engine, source_id: int, *, delete_after: dt.datetime) -> list[str]:
    """Delete the live data source `source_id` with every row below it (log segments, indexes, their
    versions), and queue every file those rows referenced to go after `delete_after`, in one transaction; the
    files queued. NotFoundError if the source is gone or in the trash."""
    with engine.begin() as conn:
        lock_source(conn, source_id, live=True)  # a commit in flight finishes first; a later one finds no row
        return delete_source_rows(conn, source_id, SOURCE_DROPPED, delete_after)


def delete_source_rows(
    conn: Connection, source_id: int, reason: str, delete_after: dt.datetime, extra: Iterable[str] = ()
) -> list[str]:
    """Inside the caller's transaction, which holds the source's row lock: queue the files of the source's
    rows (log segments, index versions) and `extra`, end its indexes' reindexes still building as cancelled
    and mark their jobs as a dropped index's (`generations.forget_jobs`), then delete the rows; the files
    queued."""
    index_ids = list(conn.scalars(select(Index.id).where(Index.data_source_id == source_id)))
    garbage.lock_shards(conn, index_ids)
    cancel_reindexes(conn, index_ids, "the data source was dropped")
    forget_jobs(conn, index_ids)  # gone for good: no index of the name (one restored from the trash) lists them
    files = set(conn.scalars(select(LogSegment.path).where(LogSegment.data_source_id == source_id)))
    files |= garbage.index_files_of(conn, index_ids)
    files |= set(extra)
    conn.execute(delete(DataSource).where(DataSource.id == source_id))  # cascades to every row below it
    garbage.enqueue(conn, files, reason, delete_after)
    return sorted(files)


def delete_now(
    engine: Engine,
    storage: Storage,
    paths: Sequence[str],
    *,
    reason: str | None = None,
    lock_timeout_ms: int = 30_000,
    announce: gc.Announce | None = None,
) -> gc.GcResult:
    """Delete at once those of `paths` that are queued and due (of `reason` when given), through GC's checked
    deletion: a file a row references again is kept. Raises the first storage error after trying them all
    (what it hit stays queued for GC)."""
    rows = garbage.due_among(engine, paths, dt.datetime.now(dt.UTC), reason=reason)
    result = gc.GcResult()
    failure = gc.delete_queued(engine, storage, rows, result, lock_timeout_ms=lock_timeout_ms, announce=announce)
    if failure is not None:
        raise failure
    return result


def release_files(
    engine: Engine,
    storage: Storage,
    paths: Iterable[str] = (),
    *,
    folders: Iterable[str] = (),
    reason: str = RELEASED,
    lock_timeout_ms: int = 30_000,
) -> int:
    """Give up files no row names any more (`paths`, and every file under `folders`): queue them, then delete
    them at once through GC's checked deletion; how many were deleted. For the dataset service's metadata
    mirrors: GC knows a mirror's owner by its folder (a live data source of the dataset's name; a source in the
    trash with the trash folder's id), so a mirror written again meanwhile is kept. A crash between the two
    steps leaves the files queued for the next GC run."""
    wanted = set(paths)
    for folder in folders:
        wanted.update(storage.list_files(folder))  # StorageUnavailableError while the storage is away
    if not wanted:
        return 0
    garbage.enqueue(engine, sorted(wanted), reason, dt.datetime.now(dt.UTC))
    return delete_now(engine, storage, sorted(wanted), lock_timeout_ms=lock_timeout_ms).deleted
