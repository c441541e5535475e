"""Garbage collection: delete files no catalog row references, after a grace period, logging each deletion.

Files reach the queue (`garbage_files`) three ways: compaction queues the log segments it replaced, version
pruning queues the files of the index versions it deleted, and GC's own scan of the tenants' log folders
queues files nothing ever published (a commit or compaction that crashed, a killed writer's temp file) once
they are older than the grace period. A queued file is deleted only after its grace period, and only if no
log segment row and no kept index version references it (index versions share segment files, so a pruned
version's files are often still in use).

A log file is deleted only inside a transaction holding the row lock of the data source owning its folder:
commits write their file under that same lock, and compactions check their new files still exist under it
before publishing, so no row can ever point at a file GC deleted. The grace period protects readers that
listed a segment just before a compaction replaced it. Index folders are not scanned: a build writes its
files before it publishes, without a lock GC could take, so only files queued by the catalog go there.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow.fs as pafs
from sqlalchemy import Connection, Engine

from shoal.index.segment import segment_files
from shoal.upkeep import gc_queue as garbage
from shoal.storage import Storage

log = logging.getLogger(__name__)

CHUNK = 500  # files deleted per transaction (the data source's lock is held meanwhile)


@dataclass
class GcResult:
    """What one GC run did."""

    scanned: int = 0  # files looked at in the log folders
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
    parts = path.split("/")
    if len(parts) == 7 and parts[0] == "tenants" and parts[2] == "sources" and parts[5] == "log":
        return parts[1], parts[3], parts[4]
    return None


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
    """Queue unreferenced log files older than `grace_s` (with `scan`), then delete every queued file whose
    grace period ended by `now` and that no row references; of one tenant when given, else of all.

    Promises: a file a catalog row references is never deleted; every deletion is logged (here and in
    `garbage_files`); a crash at any point leaves at most files still queued, deleted by the next run.
    """
    now = now or dt.datetime.now(dt.UTC)
    result = GcResult()
    if scan:
        _scan(engine, storage, grace_s, now, tenant, result)
    by_owner: dict[tuple[str, str, str] | None, list[garbage.GarbageRow]] = defaultdict(list)
    for row in garbage.due(engine, now, tenant=tenant):
        by_owner[log_owner(row.path)].append(row)
    failure: OSError | None = None
    for owner, rows in by_owner.items():
        for start in range(0, len(rows), CHUNK):
            try:
                _delete_chunk(engine, storage, owner, rows[start : start + CHUNK], lock_timeout_ms, result)
            except OSError as exc:  # storage trouble with some files: the rest still go, these stay queued
                log.warning("gc: could not delete files of %s: %s (they stay queued)", owner or "other folders", exc)
                failure = failure or exc
    garbage.prune_log(engine, now)
    result.pending = garbage.pending(engine, tenant=tenant)
    if failure is not None:
        raise failure
    return result


def _scan(
    engine: Engine, storage: Storage, grace_s: float, now: dt.datetime, tenant: str | None, result: GcResult
) -> None:
    for name in [tenant] if tenant else garbage.tenants(engine):
        folder = storage.path(f"tenants/{name}/sources")
        selector = pafs.FileSelector(folder, recursive=True, allow_not_found=True)
        prefix = len(storage.root) + 1
        found = [
            (info.path[prefix:], info.mtime)
            for info in storage.fs.get_file_info(selector)
            if info.type == pafs.FileType.File and log_owner(info.path[prefix:]) is not None
        ]
        if not found:
            continue
        # Read after listing: a file whose commit landed meanwhile is seen as referenced.
        referenced = garbage.log_paths_of_tenant(engine, name)
        due: dict[str, dt.datetime] = {}
        for path, mtime in found:
            result.scanned += 1
            if path in referenced:
                continue
            # Younger files may belong to a commit or compaction still in flight: a later scan sees them.
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
) -> None:
    with engine.begin() as conn:
        if owner is not None:
            garbage.lock_log_owner(conn, *owner, lock_timeout_ms)
        refs = _referenced(conn, [r.path for r in rows])
        kept = [r.id for r in rows if r.path in refs]
        gone: list[int] = []
        for r in rows:
            if r.path in refs:
                log.info("gc: kept %s: a catalog row references it (taken off the queue)", r.path)
                continue
            if _delete(storage, r.path):
                result.deleted += 1
                log.info("gc: deleted %s (%s; grace period ended %s)", r.path, r.reason, r.delete_after.isoformat())
            else:
                result.already_gone += 1
            gone.append(r.id)
        result.kept += len(kept)
        garbage.forget(conn, kept)
        # Recorded with the time it really happened, whatever `now` the run was asked to assume.
        garbage.mark_deleted(conn, gone, dt.datetime.now(dt.UTC))


def _referenced(conn: Connection, paths: list[str]) -> set[str]:
    """The paths a log segment row or a kept index version references (versions share segment files, so a
    pruned version's files may still be in use)."""
    found = garbage.log_paths_among(conn, paths)
    for path in set(paths) - found:
        folder = path.rsplit("/", 1)[0]
        # An index segment's manifest entry names its folder and its files relative to it; deletion files
        # by full path. A file in use is one that `segment_files` lists for some entry of some version.
        for fragment in {folder, path}:
            if any(
                path in segment_files(entry)
                for manifest in garbage.manifests_mentioning(conn, fragment)
                for entry in manifest.get("segments", [])
            ):
                found.add(path)
                break
    return found


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
