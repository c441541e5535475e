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
still in use), and for a dataset's metadata mirror (the one file of a dataset or trash folder a row owns) no
live data source of that name (or, in the trash folder, no data source in the trash with that id).

A file the scan found may belong to a commit, compaction or build still in flight (one slower than the grace
period), so its deletion has two steps. First one transaction locks the file's owner (the row lock of the
data source owning a log folder, the share lock of the shard rows owning an index folder), then its queue
row, checks no row references it, records the deletion (`deleted_at`) and commits. Then the file leaves
storage, with no lock held (on S3 each deletion costs several requests, and every commit to the source would
wait). The record is final (`gc_queue.enqueue` never reopens it for a uuid-named file), and every publisher
checks it before naming a file it wrote:

- a commit writes its log file under the data source's row lock, so the file is never older than the grace
  period while unpublished;
- a compaction checks under that same lock that none of its new files has a deletion record
  (`shoal.log.compaction_swap.replace_segments`);
- an index build or merge checks, holding its shard row and a share lock of the files' queue rows, that none
  of its new files has one (`publishable`).

So either the publish commits first, and the deletion (which waits for the owner's lock) sees its reference
and keeps the file, or the deletion is recorded first and the publish gives up (the build runs again). A crash
or a storage error between the two steps leaves a file whose deletion is recorded: no row can name it any
more, and the next scan deletes it.

Every other queued file was named by rows that are gone now (replaced, pruned, dropped, purged, released):
nothing publishes it again, so it leaves storage first, with no lock held either, and its deletion is recorded
after; a crash in between leaves it queued, and the next run (GC, a drop's `delete_now`, the purge) deletes it.
The grace period protects readers that listed a segment or loaded a version just before it was replaced or
dropped.

Once the last file of an index segment's folder is gone, the folder goes too (an empty directory locally, the
directory marker pyarrow leaves on S3): builds make a new one every time. Locally the folders above it that it
leaves empty go as well, up to the owner's folder (`indexes/{index}`, `sources/{source}`, `datasets/{name}`,
`trash/{id}`; the tenant's kind folders and the tenant's folder stay), each only once its owner is gone from the
catalog (no data source of that name and version, index of that name and version, for a `gen-{n}` folder and
below none of those of generation n, live data source of that dataset's name, data source in the trash with that
id), checked right before it goes; a directory is removed only while it is empty, and a write whose folder
vanished before its temp file was opened makes the folder again (`Storage.write_atomic`). On S3 they stay:
pyarrow removes a marker only with every object under it, and a listing just before cannot rule out a new owner
of the name writing there in between.

A folder holding a storage marker (`shoal-catalog.json`) is the root of another storage nested inside this one's
folders (another deployment's, set up by mistake): none of its files is this catalog's to judge, so the scan
skips it and everything below it, and no marker is ever deleted, nor a queued file in the folder of a queued
marker (a dropped dataset folder holding one). Processes refuse to start on a root nested so once the outer
storage has its marker (`shoal.storage.identity`); this protects the inner one when it came first.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import Connection, Engine, select

from shoal.catalog.locks import set_lock_timeout
from shoal.catalog.models import DataSource, Index, Tenant
from shoal.log.records import GENERATION_MARK
from shoal.storage import Storage, layout
from shoal.storage.identity import MARKER, check_storage_identity
from shoal.upkeep import gc_queue as garbage

log = logging.getLogger(__name__)

CHUNK = 500  # queued files one transaction checks (and for files the scan found, records under their owner's lock)

Announce = Callable[[garbage.GarbageRow], None]  # told about each file a deletion removed


@dataclass
class GcResult:
    """What one GC run did."""

    scanned: int = 0  # files looked at in the tenants' folders
    queued: int = 0  # unreferenced files the scan found and queued
    deleted: int = 0  # files deleted, each one logged
    already_gone: int = 0  # queued files that were not there any more (a previous run deleted them)
    kept: int = 0  # queued files a row turned out to reference, or another storage's: taken off the queue
    pending: int = 0  # queued files still in their grace period
    folders_removed: int = 0  # folders the deletions left empty, removed (with their owners gone)

    def to_json(self) -> dict[str, Any]:
        """The result as a JSON-ready dict."""
        return asdict(self)


Owner = tuple[str, str, str, str, int]  # (kind, tenant, name, version, shard number or 0)


def _owner(path: str) -> Owner | None:
    """Whose lock a deletion of `path` takes: a log folder's data source, an index folder's shard."""
    if (found := layout.parse_log_path(path)) is not None:
        return ("log", found.tenant, found.source, found.version, 0)
    if (shard := layout.parse_index_path(path)) is not None:
        return ("index", shard.tenant, shard.index, shard.version, shard.shard_no)
    return None


def _lock_owner(conn: Connection, owner: Owner | None, lock_timeout_ms: int) -> None:
    if owner is None:
        return
    kind, tenant, name, version, shard_no = owner
    if kind == "log":
        garbage.lock_log_owner(conn, tenant, name, version, lock_timeout_ms)
    else:
        garbage.lock_index_owner(conn, tenant, name, version, shard_no)


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

    Promises: nothing is deleted unless the storage's marker names this catalog (ConfigurationError saying why
    otherwise: shoal.storage.identity); a file a catalog row references is never deleted, nor one a publish
    names later; every deletion is logged (here and in `garbage_files`); a crash at any point leaves at most
    files still queued, or recorded as deleted but still in storage, both deleted by the next run (with `scan`).
    """
    # Nothing is scanned or deleted unless the storage's marker names this catalog: on another deployment's
    # storage (or one swapped under this process) every file would look unreferenced (a ConfigurationError).
    check_storage_identity(engine, storage)
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
    it hit stay queued, or for files the scan found keep their deletion record, and the next run deletes them;
    the rest still go), None when there was none."""
    # Another storage's files (a marker, the rest of a folder holding one: a dropped folder listed whole) are
    # never this catalog's garbage: taken off the queue, left in place.
    roots = _nested_roots(r.path for r in rows)
    foreign = [r for r in rows if _in_nested_storage(r.path, roots)]
    if foreign:
        log.warning("gc: kept %d queued files such as %s: %s marks them as another storage's (taken off the "
                    "queue)", len(foreign), foreign[0].path, MARKER)
        with engine.begin() as conn:
            garbage.forget(conn, [r.id for r in foreign])
        result.kept += len(foreign)
        rows = [r for r in rows if not _in_nested_storage(r.path, roots)]
    by_owner: dict[Owner | None, list[garbage.GarbageRow]] = defaultdict(list)
    for row in rows:
        by_owner[_owner(row.path)].append(row)
    failure: OSError | None = None
    emptied: set[str] = set()
    for owner, owned in by_owner.items():
        for start in range(0, len(owned), CHUNK):
            try:
                _delete_chunk(engine, storage, owner, owned[start : start + CHUNK], lock_timeout_ms, result,
                              announce, emptied)
            except OSError as exc:  # storage trouble with some files: the rest still go
                failure = failure or exc
    _remove_folders(engine, storage, emptied, result)
    return failure


def _scan(
    engine: Engine, storage: Storage, grace_s: float, now: dt.datetime, tenant: str | None, result: GcResult
) -> None:
    # A storage nested at `tenants/` or at a tenant's folder holds its marker there (not in a folder listed below).
    # StorageUnavailableError while the storage cannot be reached (the gc task retries it).
    if storage.exists(f"{layout.ROOT}/{MARKER}"):
        log.warning("gc: scanned nothing: %s/%s marks the tenants' folder as another storage's root", layout.ROOT,
                    MARKER)
        return
    for name in [tenant] if tenant else garbage.tenants(engine):
        if storage.exists(f"{layout.ROOT}/{name}/{MARKER}"):
            log.warning("gc: skipped tenant %s: %s in its folder marks it as another storage's root", name, MARKER)
            continue
        listed = [f for folder in layout.FOLDERS for f in storage.describe_files(layout.tenant_folder(name, folder))]
        roots = _nested_roots(f.path for f in listed)
        if roots:
            log.warning("gc: skipped %s: each holds %s, the root of another storage nested in this one",
                        ", ".join(sorted(roots)), MARKER)
        found = [
            (f.path, f.mtime) for f in listed
            if layout.is_managed(f.path) and not _in_nested_storage(f.path, roots)
        ]
        if not found:
            continue
        # Read after listing: a file whose commit or publish landed meanwhile is seen as referenced.
        with engine.connect() as conn:
            referenced = referenced_among(conn, [path for path, _ in found])
        result.scanned += len(found)
        unreferenced = [(path, mtime) for path, mtime in found if path not in referenced]
        # A file whose deletion was recorded but that is still there (a run killed, or a storage error, between
        # recording and deleting): the record is final, no row can name the file any more, so it goes now. A
        # mirror (fixed name) may have been written again since: it is queued again instead.
        with engine.connect() as conn:
            recorded = garbage.recorded_deleted(
                conn, [path for path, _ in unreferenced if not garbage.fixed_name(path)]
            )
        emptied: set[str] = set()
        _remove(storage, recorded, result, None, emptied)  # a storage error: the next scan tries again
        _remove_folders(engine, storage, emptied, result)
        finished = {r.path for r in recorded}
        due: dict[str, dt.datetime] = {}
        for path, mtime in unreferenced:
            if path in finished:
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
    owner: Owner | None,
    rows: list[garbage.GarbageRow],
    lock_timeout_ms: int,
    result: GcResult,
    announce: Announce | None,
    emptied: set[str],
) -> None:
    """Delete the files of those of `rows` no row references, logging each (see the module doc for the two
    orders), adding their folders to `emptied`. Raises the first storage error after trying every file."""
    found = [r for r in rows if r.reason == garbage.UNREFERENCED]
    released = [r for r in rows if r.reason != garbage.UNREFERENCED]
    failure: OSError | None = None
    if found:
        failure = _record_then_delete(engine, storage, owner, found, lock_timeout_ms, result, announce, emptied)
    if released:
        failure = _delete_then_record(engine, storage, released, lock_timeout_ms, result, announce,
                                      emptied) or failure
    if failure is not None:
        raise failure


def _unreferenced(conn: Connection, rows: list[garbage.GarbageRow], result: GcResult) -> list[garbage.GarbageRow]:
    """Lock the queue rows, take those a catalog row references off the queue, and return the others."""
    # Locked before the reference check: a publish naming one of these files waits for this transaction.
    queued = garbage.lock_queued(conn, [r.id for r in rows])
    rows = [r for r in rows if r.id in queued]  # another run may have done the rest meanwhile
    refs = referenced_among(conn, [r.path for r in rows])
    kept = [r for r in rows if r.path in refs]
    for r in kept:
        log.info("gc: kept %s: a catalog row references it (taken off the queue)", r.path)
    garbage.forget(conn, [r.id for r in kept])
    result.kept += len(kept)
    return [r for r in rows if r.path not in refs]


def _record_then_delete(
    engine: Engine,
    storage: Storage,
    owner: Owner | None,
    rows: list[garbage.GarbageRow],
    lock_timeout_ms: int,
    result: GcResult,
    announce: Announce | None,
    emptied: set[str],
) -> OSError | None:
    """Files the scan found, which a commit, compaction or build in flight may still publish: their deletion
    is recorded and committed under the owner's lock first, then they leave storage with no lock held."""
    with engine.begin() as conn:
        set_lock_timeout(conn, lock_timeout_ms)
        # The owner first: a commit or publish in flight holds it, then takes the queue rows (`publishable`).
        _lock_owner(conn, owner, lock_timeout_ms)
        gone = _unreferenced(conn, rows, result)
        # Recorded with the time it really happened, whatever `now` the run was asked to assume.
        garbage.mark_deleted(conn, [r.id for r in gone], dt.datetime.now(dt.UTC))
    _, failure = _remove(storage, gone, result, announce, emptied)
    return failure


def _delete_then_record(
    engine: Engine,
    storage: Storage,
    rows: list[garbage.GarbageRow],
    lock_timeout_ms: int,
    result: GcResult,
    announce: Announce | None,
    emptied: set[str],
) -> OSError | None:
    """Files that rows named until they were deleted (replaced, pruned, dropped, purged, released): nothing
    publishes them again, so they leave storage first and their deletion is recorded after; a crash in between
    leaves them queued for the next run (a drop's `delete_now`, the purge, or GC)."""
    with engine.begin() as conn:
        set_lock_timeout(conn, lock_timeout_ms)
        gone = _unreferenced(conn, rows, result)
    done, failure = _remove(storage, gone, result, announce, emptied)
    with engine.begin() as conn:
        garbage.mark_deleted(conn, [r.id for r in done], dt.datetime.now(dt.UTC))
    return failure


def _remove(
    storage: Storage,
    rows: Sequence[garbage.GarbageRow],
    result: GcResult,
    announce: Announce | None,
    emptied: set[str],
) -> tuple[list[garbage.GarbageRow], OSError | None]:
    """Delete the files of these rows, adding the folders they were in to `emptied` (`_remove_folders` removes
    those left empty); the rows whose file is gone now, and the first storage error (after trying every
    file)."""
    failure: OSError | None = None
    done: list[garbage.GarbageRow] = []
    for r in rows:
        try:
            existed = _delete(storage, r.path)
        except OSError as exc:
            log.warning("gc: could not delete %s: %s (the next run tries again)", r.path, exc)
            failure = failure or exc
            continue
        done.append(r)
        if existed:
            result.deleted += 1
            log.info("gc: deleted %s (%s; grace period ended %s)", r.path, r.reason, r.delete_after.isoformat())
            if announce is not None:
                announce(r)
        else:
            result.already_gone += 1
        # Gone either way: a file already gone may be a crashed run's, which left its folder behind.
        emptied.add(r.path.rpartition("/")[0])
    return done, failure


def _remove_folders(engine: Engine, storage: Storage, emptied: set[str], result: GcResult) -> None:
    """Remove those of the folders `emptied` that hold nothing now, and the folders above them left empty so,
    deepest first, never a tenant's kind folder nor anything above it; a folder other than an index segment's
    only once its owner is gone from the catalog (checked right before it goes, see the module doc). A folder
    that stays keeps every folder above it."""
    candidates: set[str] = set()
    for folder in emptied:
        while _owner_level(folder) is not None and folder not in candidates:
            candidates.add(folder)
            folder = folder.rpartition("/")[0]
    kept: set[str] = set()  # folders that stay, and so every folder above them
    for folder in sorted(candidates, key=lambda f: (-f.count("/"), f)):
        if folder in kept:
            continue
        # On S3 pyarrow removes a marker only with every object under it, and a listing just before cannot rule
        # out a writer landing in between: only a segment's folder, which nothing writes into again, goes there.
        if not storage.local and not _segment_folder(folder):
            removed = False
        else:
            try:
                removed = not _owner_present(engine, folder) and storage.remove_empty_dir(folder)
            except OSError as exc:  # only tidiness: the folder holds no file the catalog knows
                log.info("gc: could not remove the empty folder %s: %s", folder, exc)
                removed = False
        if removed:
            result.folders_removed += 1
            continue
        while folder:
            kept.add(folder)
            folder = folder.rpartition("/")[0]


def _owner_level(folder: str) -> int | None:
    """How far below its owner's folder a folder of a tenant's kind folder is (0: the owner's folder itself,
    such as `tenants/{t}/sources/{source}`); None for the kind folders, the tenant's folder and anything else
    GC never removes."""
    parts = folder.split("/")
    if len(parts) < 4 or parts[0] != layout.ROOT or parts[2] not in layout.FOLDERS or not all(parts):
        return None
    return len(parts) - 4


def _segment_folder(folder: str) -> bool:
    """Whether a folder is an index segment's (`tenants/{t}/indexes/{i}/{v}/gen-{n}/shard-N/{uuid}`) or one below
    it: named afresh by each build, nothing writes into it once its files are gone."""
    parts = folder.split("/")
    return len(parts) >= 8 and parts[2] == "indexes" and layout.parse_index_path(folder) is not None


def _owner_present(engine: Engine, folder: str) -> bool:
    """Whether the catalog still holds the owner of a folder below a tenant's kind folder, who may write into it
    again: for `sources/{s}` any data source named s, for `sources/{s}/{v}/...` one of that version (live or in
    the trash); for `indexes/{i}` any index named i, for `indexes/{i}/{v}` one of that version or one of its
    generations, for `indexes/{i}/{v}/gen-{n}/...` one of those whose generation is n; for `datasets/{n}/...`
    a live data source named n; for `trash/{id}/...` a data source in the trash with that id. Never for an
    index segment's folder (`.../shard-N/{uuid}` and below): nothing writes into it again once its files are
    gone."""
    tenant, kind, *rest = folder.split("/")[1:]
    owner = rest[0]
    with engine.connect() as conn:
        if kind == "sources":
            q = select(DataSource.id).join(Tenant, Tenant.id == DataSource.tenant_id).where(
                Tenant.name == tenant, DataSource.name == owner)
            if len(rest) > 1:
                q = q.where(DataSource.version == rest[1])
            return conn.execute(q.limit(1)).first() is not None
        if kind == "indexes":
            if _segment_folder(folder):
                return False  # an index segment's folder (uuid-named) or one below it
            return _index_owner_present(conn, tenant, rest)
        if kind == "datasets":
            return bool(garbage.live_source_names(conn, tenant, [owner]))
        return owner.isdigit() and bool(garbage.trashed_source_ids(conn, tenant, [int(owner)]))


def _index_owner_present(conn: Connection, tenant: str, rest: Sequence[str]) -> bool:
    """Whether the catalog holds an index that may write into the folder `indexes/{rest...}` of `tenant`: for
    `{i}` any index named i; for `{i}/{v}` one of that version or one of its generations (`{v}~g{n}`), live or
    in the trash; for `{i}/{v}/gen-{n}` and below, one of those whose generation is n."""
    q = select(Index.generation).join(Tenant, Tenant.id == Index.tenant_id).where(
        Tenant.name == tenant, Index.name == rest[0])
    if len(rest) > 1:
        # A generation's folder keeps the version it was built under (older ones: `{v}~g{n}`).
        base = rest[1].partition(GENERATION_MARK)[0]
        q = q.where((Index.version == base) | Index.version.startswith(base + GENERATION_MARK, autoescape=True))
    generation = _generation_of(rest[2]) if len(rest) > 2 else None
    if generation is not None:
        # Only the index row of generation n writes into `gen-{n}`: its folder outlives that row for nothing
        # (a swept or cancelled generation's would stay empty forever, one per reindex). A reindex allocates n
        # and inserts its row in one transaction (shoal.index.reindex._start_job) and builds only after that
        # commits, so no file of gen-n is written while no row of n is visible; a number a dropped generation
        # had is taken again only by a reindex started after the drop (n = highest generation left + 1), whose
        # build makes the folder again if it went meanwhile (Storage.write_atomic).
        q = q.where(Index.generation == generation)
    return conn.execute(q.limit(1)).first() is not None


def _generation_of(folder_name: str) -> int | None:
    """The generation number of a `gen-{n}` folder name; None for any other name."""
    prefix, _, number = folder_name.partition("-")
    return int(number) if prefix == "gen" and number.isascii() and number.isdigit() else None


def _nested_roots(paths: Iterable[str]) -> set[str]:
    """The folders, among those of `paths`, that hold a storage marker: roots of other storages nested in this
    one's folders (this storage's own marker, at its root, is none)."""
    return {folder for folder, _, name in (path.rpartition("/") for path in paths) if folder and name == MARKER}


def _in_nested_storage(path: str, roots: set[str]) -> bool:
    """True for a marker (never deleted, wherever it lies) and for a file in one of `roots` or below."""
    folder, _, name = path.rpartition("/")
    if name == MARKER:
        return True
    while folder:
        if folder in roots:
            return True
        folder = folder.rpartition("/")[0]
    return False


def referenced_among(conn: Connection, paths: Iterable[str]) -> set[str]:
    """The paths among `paths` a catalog row references: a log segment, a kept index version, or for the
    metadata mirror of a dataset folder a live data source of that name, for the one of a trash folder a data
    source in the trash with that id (the folders' owners; those files have fixed names, so they are known by
    their owner). Any other file of those folders (a killed writer's temp file) is nobody's."""
    paths = sorted(set(paths))
    found: set[str] = set()
    for start in range(0, len(paths), CHUNK):
        chunk = paths[start : start + CHUNK]
        found |= garbage.log_paths_among(conn, chunk) | garbage.index_paths_among(conn, chunk)
    owners: dict[tuple[str, str, str], list[str]] = defaultdict(list)  # (tenant, folder, owner) -> paths
    for path in paths:
        if garbage.fixed_name(path) and (o := layout.parse_owner_path(path)) is not None:
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
    """Whether a version may be published naming these files it wrote: False when GC recorded the deletion of
    one of them (a build that ran past the grace period, whose files the scan took for a crash's). Call it
    inside the publishing transaction, after taking the shard row's lock: it waits for a deletion of one of
    them in flight (see the module doc)."""
    gone = garbage.deleted_among(conn, sorted(set(new_files)))
    if gone:
        log.warning("gc: a build's file was collected before it published (%s, ...): the build must run again",
                    sorted(gone)[0])
    return not gone


def _delete(storage: Storage, path: str) -> bool:
    """Delete one file; False when it was already gone. Other storage errors propagate (an outage as
    StorageUnavailableError)."""
    return storage.delete(path)


def _aware(value: dt.datetime) -> dt.datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)
