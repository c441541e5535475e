"""GC hardening: a deletion is recorded (and committed) before its file leaves storage, and that record is final.

Each test drives one interleaving from the test itself: a GC run, a build, a compaction or an upload paused
at a precise step (an Event a hook waits on, released by the test), or a GC child process SIGKILLed at the
point it reports over its stdout pipe. Then what a user would check: searches answer exactly, the log reads,
uploads go through, and no file is left behind for good.
"""

from __future__ import annotations

import datetime as dt
import os
import select
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from conftest import settings_env, wait_for
from sqlalchemy import select as sql_select
from sqlalchemy import text
from sqlalchemy.orm import Session

import shoal.index.builder as builder_module
import shoal.log.compaction as compaction
import shoal.upkeep.gc as gc
from shoal import DataSourceSpec, Shoal
from shoal.catalog.indexes import ShardCatalog
from shoal.catalog.models import GarbageFile, IndexFile, LogSegment
from shoal.engines.metrics import Metric, exact_top_k
from shoal.errors import LeaseBusyError, NotFoundError, ReindexConflictError
from shoal.index.builder import ShardBuilder
from shoal.index.history import prune_versions
from shoal.log.compaction import due_for_compaction
from shoal.log.records import IndexSpec
from shoal.log.retention import sources_with_retention
from shoal.storage import layout
from shoal.upkeep import gc_queue as garbage
from shoal.upkeep.trash import Trash

DIM = 4
HOUR = dt.timedelta(hours=1)


def make_source(shoal: Shoal, name: str = "src", index: str | None = "idx", **metadata: Any) -> None:
    shoal.create_data_source(DataSourceSpec(name, "1", DIM, {"id": "int64"}, ["id"], custom_metadata=metadata))
    if index is not None:
        shoal.create_index(IndexSpec(index, "1", name, "1", algorithm="flat", metric="euclidean",
                                     id_attributes=["id"]))


def upload(shoal: Shoal, ids: range, seed: int, name: str = "src") -> None:
    vectors = np.random.default_rng(seed).normal(size=(len(ids), DIM)).astype(np.float32)
    shoal.producer(name, "1").upload_columns(vectors, {"id": list(ids)})


def build(shoal: Shoal, index: str = "idx") -> None:
    builder = ShardBuilder(shoal.engine, shoal.storage)
    for shard in shoal.get_index(index, "1").shards:
        builder.materialize(shard.id)


def assert_exact(shoal: Shoal, source: str = "src", index: str = "idx") -> None:
    """A strong search of the index answers exactly what a brute force over the folded source answers (it reads
    every file of the version it serves, plus the log tail above its watermark)."""
    state = shoal.fold(source, "1")
    vectors = np.asarray(state["__vector"].to_pylist(), dtype=np.float32).reshape(-1, DIM)
    queries = np.random.default_rng(3).normal(size=(5, DIM)).astype(np.float32)
    _, labels = exact_top_k(Metric("euclidean"), queries, vectors, 5)
    ids = state["id"].to_pylist()
    searcher = shoal.searcher(follow=False)
    try:
        hits = searcher.search(index, "1", queries, 5, consistency="strong")
    finally:
        searcher.close()
    assert [[h.attributes["id"] for h in row] for row in hits] == [[ids[j] for j in row] for row in labels]


def unreferenced_index_files(shoal: Shoal) -> set[str]:
    """The files of the tenant's index folder no kept version names (a build's before it publishes)."""
    on_disk = set(shoal.storage.list_files(layout.indexes_dir(shoal.tenant)))
    with Session(shoal.engine) as s:
        named = set(s.scalars(sql_select(IndexFile.path).where(IndexFile.path.in_(sorted(on_disk)))))
    return on_disk - named


def deletion_recorded(shoal: Shoal, paths: set[str]) -> dict[str, bool]:
    with Session(shoal.engine) as s:
        rows = s.execute(sql_select(GarbageFile.path, GarbageFile.deleted_at).where(GarbageFile.path.in_(paths)))
        found = {path: deleted_at is not None for path, deleted_at in rows}
    return {p: found.get(p, False) for p in paths}


class HeldBuild:
    """An index build in a thread whose files are written and whose publish waits until `release()`."""

    def __init__(self, shoal: Shoal, monkeypatch: pytest.MonkeyPatch) -> None:
        self.wrote, self.gate = threading.Event(), threading.Event()
        self.outcome: dict[str, object] = {}
        original = ShardCatalog.publish_version

        def held(catalog: ShardCatalog, *args: Any, **kwargs: Any) -> int | None:
            self.wrote.set()
            assert self.gate.wait(60), "the test never released the build"
            return original(catalog, *args, **kwargs)

        monkeypatch.setattr(ShardCatalog, "publish_version", held)
        self.thread = threading.Thread(target=self._run, args=(shoal,))
        self.thread.start()
        assert self.wrote.wait(60), "the build never got to its publish"

    def _run(self, shoal: Shoal) -> None:
        try:
            build(shoal)
            self.outcome["published"] = True
        except LeaseBusyError as exc:  # the publish gave up: the build runs again later
            self.outcome["refused"] = exc

    def release(self) -> dict[str, object]:
        self.gate.set()
        self.thread.join(60)
        return self.outcome


# -- 1. overlapping GC runs -----------------------------------------------------------------------------------


def test_a_gc_scan_from_an_older_listing_never_reopens_a_recorded_deletion(
    make_shoal: Callable[..., Shoal], monkeypatch: pytest.MonkeyPatch
) -> None:
    """GC run 1 lists storage (an in-flight build's files among them) and pauses; run 2 collects those files
    (the build ran past the grace period) and records it; run 1 then queues them from its old listing. The
    records must stand, so the build's publish gives up instead of naming deleted files for good."""
    shoal = make_shoal(gc_grace_s=3600)
    make_source(shoal)
    upload(shoal, range(0, 10), seed=1)
    build(shoal)
    upload(shoal, range(10, 20), seed=2)
    later = dt.datetime.now(dt.UTC) + 2 * HOUR  # both runs: the build has been running for two hours

    held = HeldBuild(shoal, monkeypatch)
    in_flight = unreferenced_index_files(shoal)
    assert in_flight

    listed, resume_scan = threading.Event(), threading.Event()
    scanned, resume_delete = threading.Event(), threading.Event()
    original_refs, original_delete = gc.referenced_among, gc.delete_queued
    run1: dict[str, object] = {}

    def is_run1() -> bool:
        return threading.current_thread().name == "gc-run-1"

    def refs_after_listing(conn: Any, paths: Any) -> set[str]:
        if is_run1() and not listed.is_set():
            listed.set()
            assert resume_scan.wait(60)
        return original_refs(conn, paths)

    def delete_later(*args: Any, **kwargs: Any) -> OSError | None:
        if is_run1():
            scanned.set()
            assert resume_delete.wait(60)
        return original_delete(*args, **kwargs)

    monkeypatch.setattr(gc, "referenced_among", refs_after_listing)
    monkeypatch.setattr(gc, "delete_queued", delete_later)
    thread = threading.Thread(name="gc-run-1", target=lambda: run1.update(result=gc.collect_garbage(
        shoal.engine, shoal.storage, grace_s=3600, now=later, tenant=shoal.tenant)))
    thread.start()
    try:
        assert listed.wait(60), "GC run 1 never listed storage"
        run2 = gc.collect_garbage(shoal.engine, shoal.storage, grace_s=3600, now=later, tenant=shoal.tenant)
        assert run2.deleted == len(in_flight)
        resume_scan.set()
        assert scanned.wait(60), "GC run 1 never finished its scan"
        # Run 1 queued the same files from its older listing: their deletion records stand.
        assert deletion_recorded(shoal, in_flight) == dict.fromkeys(in_flight, True)
        outcome = held.release()
        assert "refused" in outcome, outcome  # the publish found its files collected and gave up
    finally:
        resume_scan.set()
        resume_delete.set()
        held.release()
        thread.join(60)
    assert "result" in run1
    assert_exact(shoal)  # the old version still serves, complete
    build(shoal)  # the build runs again and publishes the new points
    assert_exact(shoal)
    assert shoal.get_index("idx", "1").shards[0].id and shoal.fold("src", "1").num_rows == 20


def test_only_a_fixed_name_file_is_queued_again_after_its_deletion(make_shoal: Callable[..., Shoal]) -> None:
    """A dataset's metadata mirror may be written again after GC deleted it, so queueing it again reopens its
    row; a uuid-named file is never written twice, so its deletion record stays (and nothing is queued)."""
    shoal = make_shoal(gc_grace_s=0)
    mirror = layout.dataset_metadata_path(shoal.tenant, "ds")
    segment = f"{layout.shard_dir(shoal.tenant, 'idx', '1', 1, 0)}/{uuid.uuid4()}/rows.parquet"
    for path in (mirror, segment):
        shoal.storage.write_atomic(path, pa.py_buffer(b"x"))
    now = dt.datetime.now(dt.UTC)
    assert garbage.enqueue(shoal.engine, [mirror, segment], "test", now) == 2
    assert shoal.collect_garbage(scan=False).deleted == 2
    assert garbage.enqueue(shoal.engine, [mirror, segment], garbage.UNREFERENCED, now) == 1
    assert deletion_recorded(shoal, {mirror, segment}) == {mirror: False, segment: True}


def test_a_gc_deletion_waits_for_a_publish_in_flight_naming_its_files(
    make_shoal: Callable[..., Shoal], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build's publish checked its files (no deletion recorded, none queued yet) and has not committed yet
    when a GC scan queues them and goes on to delete them: the deletion must wait for the publish (it holds its
    shard row) and then find the files referenced, rather than delete files the publish names a moment later."""
    shoal = make_shoal(gc_grace_s=3600)
    make_source(shoal)
    upload(shoal, range(0, 10), seed=1)
    build(shoal)
    upload(shoal, range(10, 20), seed=2)
    later = dt.datetime.now(dt.UTC) + 2 * HOUR  # the build's files look like a crash's to this run
    original = builder_module.publishable
    runs: list[threading.Thread] = []
    result: dict[str, gc.GcResult] = {}

    def gc_waits_for_a_lock() -> bool:
        with shoal.engine.connect() as conn:
            return bool(conn.execute(text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock' AND query ILIKE '%index_shards%'"
            )).scalar())

    def checked_then_gc(conn: Any, new_files: Any) -> bool:
        ok = original(conn, new_files)  # inside the publish, holding the shard row, not committed yet
        thread = threading.Thread(target=lambda: result.update(r=shoal.collect_garbage(now=later)))
        thread.start()
        runs.append(thread)
        wait_for(lambda: not thread.is_alive() or gc_waits_for_a_lock(), 30, "GC to finish or to wait for the publish")
        return bool(ok)

    monkeypatch.setattr(builder_module, "publishable", checked_then_gc)
    try:
        build(shoal)
    finally:
        for thread in runs:
            thread.join(60)
    assert runs and result["r"].deleted == 0 and result["r"].kept > 0
    assert unreferenced_index_files(shoal) == set()
    assert_exact(shoal)


# -- 2. a GC killed between recording and deleting ----------------------------------------------------------

CHILD = r"""
import datetime as dt, sys
import shoal.upkeep.gc as gc
from shoal import Shoal

original = gc._delete

def deleting(storage, path):
    gone = original(storage, path)
    print("deleted " + path, flush=True)
    sys.stdin.readline()  # the parent SIGKILLs the process here, in the middle of the chunk
    return gone

gc._delete = deleting
with Shoal(notify=False) as shoal:
    shoal.collect_garbage(now=dt.datetime.fromisoformat(sys.argv[1]))
"""


def test_a_gc_killed_in_the_middle_of_a_chunk_leaves_no_publishable_deleted_file(
    make_shoal: Callable[..., Shoal], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GC run collects an in-flight build's files (past the grace period) and is SIGKILLed right after
    deleting the first of them. The deletion must be on record, so the build's publish gives up; the next
    run deletes the rest."""
    shoal = make_shoal(gc_grace_s=3600)
    make_source(shoal)
    upload(shoal, range(0, 10), seed=1)
    build(shoal)
    upload(shoal, range(10, 20), seed=2)
    later = dt.datetime.now(dt.UTC) + 2 * HOUR

    held = HeldBuild(shoal, monkeypatch)
    in_flight = unreferenced_index_files(shoal)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, later.isoformat()], env=settings_env(shoal.settings),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline().strip() if ready else ""
        assert line.startswith("deleted "), f"{line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        gone = line.split(" ", 1)[1]
        assert gone in in_flight and not shoal.storage.exists(gone)
        assert deletion_recorded(shoal, {gone}) == {gone: True}
        outcome = held.release()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        held.release()
    assert "refused" in outcome, outcome
    assert_exact(shoal)
    # The files the killed run recorded but never reached go with the next run; nothing of the build is left.
    shoal.collect_garbage(now=later)
    assert not any(shoal.storage.exists(p) for p in in_flight)
    assert deletion_recorded(shoal, in_flight) == dict.fromkeys(in_flight, True)
    build(shoal)
    assert_exact(shoal)


# -- 3. no lock held through the storage deletes --------------------------------------------------------------


def test_an_upload_goes_through_while_gc_deletes_the_sources_log_files(
    make_shoal: Callable[..., Shoal], monkeypatch: pytest.MonkeyPatch
) -> None:
    """GC deleting a data source's log files (slow on S3: several requests each) must not hold the source's
    row lock meanwhile: every commit to the source waits for it (here with a short lock timeout)."""
    shoal = make_shoal(gc_grace_s=3600, lock_timeout_ms=500, commit_retries=1)
    make_source(shoal, index=None)
    upload(shoal, range(0, 10), seed=1)
    strays = [f"{shoal.log_dir('src', '1')}/{j:020d}-{uuid.uuid4()}.parquet" for j in range(3)]
    for path in strays:  # a crashed writer's files
        shoal.storage.write_atomic(path, pa.py_buffer(b"x"))

    deleting, resume = threading.Event(), threading.Event()
    original = gc._delete

    def slow_delete(storage: Any, path: str) -> bool:
        deleting.set()
        assert resume.wait(60)
        return original(storage, path)

    monkeypatch.setattr(gc, "_delete", slow_delete)
    result: dict[str, gc.GcResult] = {}
    thread = threading.Thread(target=lambda: result.update(r=shoal.collect_garbage(
        now=dt.datetime.now(dt.UTC) + 2 * HOUR)))
    thread.start()
    try:
        assert deleting.wait(60), "GC never started deleting"
        upload(shoal, range(100, 101), seed=3)  # while GC is in the middle of its deletes
    finally:
        resume.set()
        thread.join(60)
    assert result["r"].deleted == len(strays)
    assert not any(shoal.storage.exists(p) for p in strays)
    assert sorted(shoal.fold("src", "1")["id"].to_pylist()) == [*range(10), 100]


# -- compaction: the same check as builds --------------------------------------------------------------------


def test_a_compaction_never_publishes_a_file_gc_recorded_as_deleted(
    make_shoal: Callable[..., Shoal], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compaction that ran past the grace period: GC takes its new file for a crash's, records its deletion
    and is about to delete it when the compaction swaps. The swap must give up (its file is going), not
    publish a segment row whose file GC deletes right after."""
    shoal = make_shoal(gc_grace_s=3600, lock_timeout_ms=2000)
    make_source(shoal, index=None)
    for round_ in range(3):  # the same keys three times: the older entries are superseded
        upload(shoal, range(0, 10), seed=round_)
    state = shoal.fold("src", "1")
    later = dt.datetime.now(dt.UTC) + 2 * HOUR

    deleting, resume = threading.Event(), threading.Event()
    original_delete, original_replace = gc._delete, compaction.replace_segments

    def paused_delete(storage: Any, path: str) -> bool:
        deleting.set()
        assert resume.wait(60)
        return original_delete(storage, path)

    def replace_while_gc_deletes(*args: Any, **kwargs: Any) -> None:
        # The compaction's new files are written: a GC run collects them and pauses before deleting one.
        monkeypatch.setattr(gc, "_delete", paused_delete)
        thread = threading.Thread(target=lambda: shoal.collect_garbage(now=later))
        thread.start()
        try:
            assert deleting.wait(60), "GC never started deleting"
            original_replace(*args, **kwargs)
        finally:
            resume.set()
            thread.join(60)

    monkeypatch.setattr(compaction, "replace_segments", replace_while_gc_deletes)
    result = shoal.compact("src", "1")
    assert result.raced and not result.changed
    with Session(shoal.engine) as s:
        paths = list(s.scalars(sql_select(LogSegment.path).where(LogSegment.path.like(f"tenants/{shoal.tenant}/%"))))
    assert paths and all(shoal.storage.exists(p) for p in paths)
    assert shoal.fold("src", "1").equals(state)


# -- 4. reindex jobs of an index that is gone -----------------------------------------------------------------


def test_a_reindex_left_building_by_a_dropped_source_does_not_block_the_new_index(
    make_shoal: Callable[..., Shoal],
) -> None:
    shoal = make_shoal()
    make_source(shoal)
    upload(shoal, range(0, 20), seed=1)
    build(shoal)
    old = shoal.reindex("idx", "1", algorithm="hnsw", wait=False)  # no worker: it stays building
    assert old.state == "building"
    shoal.drop_data_source("src", "1")
    assert shoal.generations.job(old.id).state == "cancelled"

    make_source(shoal)  # the same names again
    upload(shoal, range(0, 20), seed=2)
    build(shoal)
    assert shoal.reindex_jobs("idx", "1") == []
    job = shoal.reindex("idx", "1", algorithm="hnsw", wait=True)
    assert job.state == "swapped", job
    assert [j.id for j in shoal.reindex_jobs("idx", "1")] == [job.id]


def test_a_reindex_of_an_index_in_the_trash_does_not_block_the_new_index(make_shoal: Callable[..., Shoal]) -> None:
    shoal = make_shoal()
    trash = Trash(shoal.engine, shoal.catalog.tenant_id, shoal.tenant)
    make_source(shoal)
    upload(shoal, range(0, 20), seed=1)
    build(shoal)
    old = shoal.reindex("idx", "1", algorithm="hnsw", wait=False)  # no worker: it stays building
    trashed = trash.soft_delete("src", "1", dt.timedelta(days=1))
    assert shoal.generations.job(old.id).state == "cancelled"  # builds stop in the trash

    make_source(shoal)
    upload(shoal, range(0, 20), seed=2)
    build(shoal)
    assert shoal.reindex_jobs("idx", "1") == []
    job = shoal.reindex("idx", "1", algorithm="hnsw", wait=True)
    assert job.state == "swapped", job
    assert_exact(shoal)
    assert trash.get(trashed.id).indexes == trashed.indexes


def test_a_rollback_never_swaps_the_generations_of_an_index_in_the_trash(make_shoal: Callable[..., Shoal]) -> None:
    """The trashed index of the same name was reindexed: the new index has no reindex to roll back, and the
    trashed one is left as it was (it serves as before once restored)."""
    shoal = make_shoal()
    trash = Trash(shoal.engine, shoal.catalog.tenant_id, shoal.tenant)
    make_source(shoal)
    upload(shoal, range(0, 20), seed=1)
    build(shoal)
    assert shoal.reindex("idx", "1", algorithm="hnsw", wait=True).state == "swapped"
    trashed = trash.soft_delete("src", "1", dt.timedelta(days=1))

    make_source(shoal)
    upload(shoal, range(0, 20), seed=2)
    build(shoal)
    with pytest.raises(ReindexConflictError, match="no reindex to roll back"):
        shoal.rollback("idx", "1")
    shoal.drop_data_source("src", "1")
    with pytest.raises(NotFoundError, match="index 'idx' version '1' not found"):
        shoal.rollback("idx", "1")  # no such index at all now: not "no reindex to roll back"
    trash.restore(trashed.id)
    assert shoal.get_index("idx", "1").spec.algorithm == "hnsw"


# -- 5. emptied index segment folders -------------------------------------------------------------------------


def empty_folders(storage: Any, folder: str) -> list[str]:
    """Folders under `folder` with nothing in them (local directories, or S3 directory marker objects)."""
    infos = storage.fs.get_file_info(pafs.FileSelector(storage.path(folder), recursive=True, allow_not_found=True))
    parents = {i.path.rsplit("/", 1)[0] for i in infos}
    return sorted(i.path for i in infos if i.type == pafs.FileType.Directory and i.path not in parents)


def test_gc_removes_the_folders_of_the_index_segments_it_deleted(
    make_shoal: Callable[..., Shoal], storage_kind: str
) -> None:
    """Every merge replaces a segment folder; once GC deleted its files, the folder goes too (locally an
    empty directory, on S3 the marker object pyarrow leaves) instead of piling up with every build."""
    shoal = make_shoal(storage_kind)
    make_source(shoal)
    upload(shoal, range(0, 10), seed=0)
    build(shoal)
    builder = ShardBuilder(shoal.engine, shoal.storage)
    index = shoal.get_index("idx", "1")
    deleted = 0
    for cycle in range(1, 5):
        upload(shoal, range(0, 10), seed=cycle)
        build(shoal)
        for shard in index.shards:
            assert builder.merge(shard.id, force=True).changed
        far = dt.datetime.now(dt.UTC) + 3 * HOUR
        prune_versions(shoal.engine, 0, 0, now=far, index_id=index.id)
        deleted += shoal.collect_garbage(now=far).deleted
        assert empty_folders(shoal.storage, layout.indexes_dir(shoal.tenant)) == []
    assert deleted > 0
    assert_exact(shoal)


# -- 6. stray files in dataset and trash folders ------------------------------------------------------------


def test_gc_collects_stray_files_of_dataset_and_trash_folders_but_keeps_their_mirrors(
    make_shoal: Callable[..., Shoal],
) -> None:
    """A writer killed while writing a live dataset's mirror (or a trashed one's copy) leaves a temp file in
    the folder: only the mirror itself belongs to the folder's owner, so GC collects the temp file."""
    shoal = make_shoal(gc_grace_s=3600)
    make_source(shoal, "ds", index=None)
    make_source(shoal, "old", index=None)
    trashed = Trash(shoal.engine, shoal.catalog.tenant_id, shoal.tenant).soft_delete("old", "1", dt.timedelta(days=1))
    mirrors = [layout.dataset_metadata_path(shoal.tenant, "ds"),
               f"{layout.trash_dir(shoal.tenant, trashed.id)}/dataset_metadata.json"]
    strays = [f"{layout.dataset_dir(shoal.tenant, 'ds')}/.tmp-{uuid.uuid4().hex}",
              f"{layout.trash_dir(shoal.tenant, trashed.id)}/.tmp-{uuid.uuid4().hex}"]
    for path in mirrors + strays:
        shoal.storage.write_atomic(path, pa.py_buffer(b"{}"))
    result = shoal.collect_garbage(now=dt.datetime.now(dt.UTC) + 2 * HOUR)
    assert result.deleted == len(strays)
    assert [shoal.storage.exists(p) for p in mirrors + strays] == [True, True, False, False]


# -- 7. sweeps and the trash ----------------------------------------------------------------------------------


def test_the_retention_and_compaction_sweeps_leave_a_source_in_the_trash_alone(
    make_shoal: Callable[..., Shoal],
) -> None:
    shoal = make_shoal()
    make_source(shoal, index=None, retention_days=1)
    for round_ in range(2):
        upload(shoal, range(0, 10), seed=round_)
    source_id = shoal.get_data_source("src", "1").id

    def swept() -> tuple[bool, bool]:
        retained = source_id in [r.id for r in sources_with_retention(shoal.engine)]
        compacted = source_id in due_for_compaction(shoal.engine, min_seqs=1, tombstone_retention_s=0)
        return retained, compacted

    assert swept() == (True, True)
    trash = Trash(shoal.engine, shoal.catalog.tenant_id, shoal.tenant)
    trashed = trash.soft_delete("src", "1", dt.timedelta(days=1))
    assert swept() == (False, False)
    trash.restore(trashed.id)
    assert swept() == (True, True)
    assert shoal.fold("src", "1").num_rows == 10
