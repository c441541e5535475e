"""Garbage collection: delete files no catalog row references, after a grace period, logging each deletion.

Every file leaves storage through the queue (`garbage_files`); whatever deletes catalog rows that reference
files queues those files in the same transaction, so a crash can never leave a file that no row names and
nothing will delete. Files reach the queue from:

- compaction (the log segments it replaced) and version pruning (the files of the versions it deleted);
- drops (`shoal.upkeep.drops`): an index, a data source, a reindex generation, a data source the trash purge
  deleted, a dataset's metadata mirror;
- GC's own scan of each tenant's folders (log, index, dataset and trash folders): files nothing ever
  published or whose deletion was never queued (a crashed commit, compaction or build, a killed writer's temp
  file, leftovers of the older purge) are queued once they are older than the grace period.

A queued file is deleted only after its grace period, and only if no row references it: no log segment row,
no kept index version (`index_files`; versions share segment files, so a pruned version's files are often
still in use), and for a dataset's metadata mirror no live data source of that name (or, in the trash folder,
no data source in the trash with that id).

A log file is deleted only inside a transaction holding the row lock of the data source owning its folder:
commits write their file under that same lock, and compactions check their new files still exist under it
before publishing, so no row can ever point at a file GC deleted. An index build writes its files before it
publishes, without a lock GC could take; instead, each deletion locks the file's queue row, and a publish
checks under a share lock of those rows that none of its new files was deleted (`publishable`): either the
publish commits first, and the deletion sees its reference and keeps the file, or the publish sees the file
deleted and gives up (the build runs again). The grace period protects readers that listed a segment or
loaded a version just before it was replaced or dropped.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow.fs as pafs
from sqlalchemy import Connection, Engine

from shoal.catalog.locks import set_lock_timeout
from shoal.storage import Storage, layout
from shoal.upkeep import gc_queue as garbage

log = logging.getLogger(__name__)

CHUNK = 500  # files deleted per transaction (the data source's lock is held meanwhile)

Announce = Callable[[garbage.GarbageRow], None]  # told about each file a deletion removed


@dataclass
class GcResult:
    """What one GC run did."""

    scanned: int = 0  # files looked at in the tenants' folders
    queued: int = 0  # unreferenced files the scan found and queued
    deleted: int = 0  # files deleted, each one logged
    already_gone: int = 0  # queued files that were not there any more (a previous run deleted them)
    kept: int = 0  # queued files a row turned out to reference: taken off the queue, not deleted
    pending: int = 0  # queued files still in their grace period

    def to_json(self) -> dict[str, Any]:
        """The result as a JSON-ready dict."""
        return asdict(self)


def log_owner(path: str) -> tuple[str, str, str] | None:
    """(tenant, data source, version) of a path inside a log folder, None for any other path."""
    owner = layout.parse_log_path(path)
    return (owner.tenant, owner.source, owner.version) if owner is not None else None


def collect_garbage(
    engine: Engine,
    storage: Storage,
    *,
    grace_s: float,
    now: dt.datetime | None = None,
    tenant: str | None = None,
    lock_timeout_ms: int = 30_000,
    scan: bool = True,
) -> GcResult:
    """Queue unreferenced files of the tenants' folders older than `grace_s` (with `scan`), then delete every
    queued file whose grace period ended by `now` and that no row references; of one tenant when given, else
    of all.

    Promises: a file a catalog row references is never deleted; every deletion is logged (here and in
    `garbage_files`); a crash at any point leaves at most files still queued, deleted by the next run.
    """
    now = now or dt.datetime.now(dt.UTC)
    result = GcResult()
    if scan:
        _scan(engine, storage, grace_s, now, tenant, result)
    failure = delete_queued(engine, storage, garbage.due(engine, now, tenant=tenant), result,
                            lock_timeout_ms=lock_timeout_ms)
    garbage.prune_log(engine, now)
    result.pending = garbage.pending(engine, tenant=tenant)
    if failure is not None:
        raise failure
    return result


def delete_queued(
    engine: Engine,
    storage: Storage,
    rows: Sequence[garbage.GarbageRow],
    result: GcResult,
    *,
    lock_timeout_ms: int = 30_000,
    announce: Announce | None = None,
) -> OSError | None:
    """Delete these queued files (their grace periods are the caller's business) unless a row references one,
    counting into `result`; `announce` hears of each file deleted. Returns the first storage error (the files
    it hit stay queued, the rest still go), None when there was none."""
    by_owner: dict[tuple[str, str, str] | None, list[garbage.GarbageRow]] = defaultdict(list)
    for row in rows:
        by_owner[log_owner(row.path)].append(row)
    failure: OSError | None = None
    for owner, owned in by_owner.items():
        for start in range(0, len(owned), CHUNK):
            try:
                _delete_chunk(engine, storage, owner, owned[start : start + CHUNK], lock_timeout_ms, result,
                              announce)
            except OSError as exc:  # storage trouble with some files: the rest still go, these stay queued
                log.warning("gc: could not delete files of %s: %s (they stay queued)", owner or "other folders", exc)
                failure = failure or exc
    return failure


def _scan(
    engine: Engine, storage: Storage, grace_s: float, now: dt.datetime, tenant: str | None, result: GcResult
) -> None:
    prefix = len(storage.root) + 1
    for name in [tenant] if tenant else garbage.tenants(engine):
        found: list[tuple[str, dt.datetime | None]] = []
        for folder in layout.FOLDERS:
            selector = pafs.FileSelector(storage.path(layout.tenant_folder(name, folder)), recursive=True,
                                         allow_not_found=True)
            found += [
                (info.path[prefix:], info.mtime)
                for info in storage.fs.get_file_info(selector)
                if info.type == pafs.FileType.File and layout.is_managed(info.path[prefix:])
            ]
        if not found:
            continue
        # Read after listing: a file whose commit or publish landed meanwhile is seen as referenced.
        with engine.connect() as conn:
            referenced = referenced_among(conn, [path for path, _ in found])
        due: dict[str, dt.datetime] = {}
        for path, mtime in found:
            result.scanned += 1
            if path in referenced:
                continue
            # Younger files may belong to a commit, compaction or build still in flight: a later scan sees them.
            written = _aware(mtime) if mtime is not None else now
            if written + dt.timedelta(seconds=grace_s) <= now:
                due[path] = written + dt.timedelta(seconds=grace_s)
        for path, after in due.items():
            result.queued += garbage.enqueue(engine, [path], garbage.UNREFERENCED, after)


def _delete_chunk(
    engine: Engine,
    storage: Storage,
    owner: tuple[str, str, str] | None,
    rows: list[garbage.GarbageRow],
    lock_timeout_ms: int,
    result: GcResult,
    announce: Announce | None,
) -> None:
    with engine.begin() as conn:
        set_lock_timeout(conn, lock_timeout_ms)
        if owner is not None:
            garbage.lock_log_owner(conn, *owner, lock_timeout_ms)
        # Locked before the reference check: a publish naming one of these files waits for this transaction.
        queued = garbage.lock_queued(conn, [r.id for r in rows])
        rows = [r for r in rows if r.id in queued]  # another run may have done the rest meanwhile
        refs = referenced_among(conn, [r.path for r in rows])
        kept = [r.id for r in rows if r.path in refs]
        gone: list[int] = []
        for r in rows:
            if r.path in refs:
                log.info("gc: kept %s: a catalog row references it (taken off the queue)", r.path)
                continue
            if _delete(storage, r.path):
                result.deleted += 1
                log.info("gc: deleted %s (%s; grace period ended %s)", r.path, r.reason, r.delete_after.isoformat())
                if announce is not None:
                    announce(r)
            else:
                result.already_gone += 1
            gone.append(r.id)
        result.kept += len(kept)
        garbage.forget(conn, kept)
        # Recorded with the time it really happened, whatever `now` the run was asked to assume.
        garbage.mark_deleted(conn, gone, dt.datetime.now(dt.UTC))


def referenced_among(conn: Connection, paths: Iterable[str]) -> set[str]:
    """The paths among `paths` a catalog row references: a log segment, a kept index version, or for a file
    of a dataset folder a live data source of that name, for one of a trash folder a data source in the trash
    with that id (the folder's owners; those files have fixed names, so they are known by their owner)."""
    paths = sorted(set(paths))
    found: set[str] = set()
    for start in range(0, len(paths), CHUNK):
        chunk = paths[start : start + CHUNK]
        found |= garbage.log_paths_among(conn, chunk) | garbage.index_paths_among(conn, chunk)
    owners: dict[tuple[str, str, str], list[str]] = defaultdict(list)  # (tenant, folder, owner) -> paths
    for path in paths:
        if (o := layout.parse_owner_path(path)) is not None:
            owners[(o.tenant, o.kind, o.owner)].append(path)
    for tenant in {t for t, _, _ in owners}:
        names = [o for t, f, o in owners if t == tenant and f == "datasets"]
        ids = [int(o) for t, f, o in owners if t == tenant and f == "trash" and o.isdigit()]
        live = garbage.live_source_names(conn, tenant, names)
        trashed = {str(i) for i in garbage.trashed_source_ids(conn, tenant, ids)}
        for (t, folder, owner), owned in owners.items():
            if t == tenant and owner in (live if folder == "datasets" else trashed):
                found.update(owned)
    return found


def publishable(conn: Connection, new_files: Sequence[str]) -> bool:
    """Whether a version may be published naming these files it wrote: False when GC deleted one of them
    (a build that ran past the grace period, whose files the scan took for a crash's). Call it inside the
    publishing transaction: it waits for a deletion of one of them in flight (see the module doc)."""
    gone = garbage.deleted_among(conn, sorted(set(new_files)))
    if gone:
        log.warning("gc: a build's file was collected before it published (%s, ...): the build must run again",
                    sorted(gone)[0])
    return not gone


def _delete(storage: Storage, path: str) -> bool:
    """Delete one file; False when it was already gone. Storage errors propagate (the row stays queued)."""
    full = storage.path(path)
    if storage.fs.get_file_info(full).type == pafs.FileType.NotFound:
        return False
    try:
        storage.fs.delete_file(full)
    except FileNotFoundError:
        return False
    return True


def _aware(value: dt.datetime) -> dt.datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)
