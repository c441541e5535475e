"""One deletion path (issue 12): a process SIGKILLed right after a drop committed its row delete leaves every
file it dropped queued, and GC later deletes exactly those files and nothing else.

Four drops, each in a real child process: an index drop, a data-source drop, a reindex generation drop and a
trash purge. Each child reports "committed" over its stdout pipe right after the drop's transaction committed
(for the generation drop and the purge, at the moment they would start deleting files), and the parent
SIGKILLs it once it read that line and saw the rows gone from the catalog: a condition, not a sleep. Then GC,
run as if the grace period had passed, must delete every file of the dropped rows, and every other file of
this tenant and of another tenant on the same storage root must still be there and searchable.
"""

from __future__ import annotations

import datetime as dt
import os
import select
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa
import pytest
from conftest import settings_env, wait_for
from sqlalchemy import func
from sqlalchemy import select as sql_select
from sqlalchemy.orm import Session

from shoal import DataSourceSpec, Shoal
from shoal.catalog.models import DataSource, Index, IndexFile, IndexShard, IndexVersion, LogSegment
from shoal.config.settings import Settings
from shoal.engines.metrics import Metric, exact_top_k
from shoal.index.builder import ShardBuilder
from shoal.index.reindex import start_reindex
from shoal.log.records import IndexSpec
from shoal.upkeep import gc_queue as garbage
from shoal.upkeep.trash import Trash

pytestmark = pytest.mark.slow

DIM = 4

# The child: one drop, then "committed" as soon as its transaction committed, then it waits to be killed.
# `delete_now` is what the generation drop and the purge call right after their COMMIT to delete files.
CHILD = r"""
import sys, time
import shoal.upkeep.drops as drops
import shoal.upkeep.trash as trash
from shoal import Shoal
from shoal.index.reindex import drop_generation

def committed(*args, **kwargs):
    print("committed", flush=True)
    time.sleep(600)  # the parent SIGKILLs the process here, before any file is deleted

drops.delete_now = committed
trash.delete_now = committed
op, arg = sys.argv[1], sys.argv[2]
with Shoal(notify=False) as shoal:
    if op == "index":
        shoal.drop_index(arg, "1")
    elif op == "source":
        shoal.drop_data_source(arg, "1")
    elif op == "generation":
        drop_generation(shoal.engine, shoal.storage, int(arg))
    elif op == "purge":
        trash.purge_due(shoal.engine, shoal.storage, source_ids=[int(arg)])
    committed()
"""


def populate(shoal: Shoal, name: str, indexes: list[str], rows: int = 40) -> int:
    """A data source `name` with `rows` points in a few commits, and built flat indexes over it."""
    shoal.create_data_source(DataSourceSpec(name, "1", DIM, {"id": "int64"}, ["id"]))
    rng = np.random.default_rng(abs(hash(name)) % 1000)
    producer = shoal.producer(name, "1")
    for index in indexes:
        shoal.create_index(IndexSpec(index, "1", name, "1", algorithm="flat", metric="euclidean",
                                     id_attributes=["id"], shard_count=2))
    for start in range(0, rows, 10):  # several commits, and a build after each: versions share files
        producer.upload_columns(rng.normal(size=(10, DIM)).astype(np.float32), {"id": list(range(start, start + 10))})
        for index in indexes:
            build(shoal, shoal.get_index(index, "1").id)
    return shoal.get_data_source(name, "1").id


def build(shoal: Shoal, index_id: int) -> None:
    found = shoal.shards.index_by_id(index_id)
    assert found is not None
    builder = ShardBuilder(shoal.engine, shoal.storage)
    for shard in found[1].shards:
        builder.materialize(shard.id)


def referenced(shoal: Shoal, *, sources: Sequence[int] = (), indexes: Sequence[int] = ()) -> set[str]:
    """The files the catalog rows of these data sources (with their indexes) and indexes reference."""
    with Session(shoal.engine) as s:
        index_ids = set(indexes) | set(s.scalars(sql_select(Index.id).where(Index.data_source_id.in_(list(sources)))))
        paths = set(s.scalars(sql_select(LogSegment.path).where(LogSegment.data_source_id.in_(list(sources)))))
        paths |= set(s.scalars(
            sql_select(IndexFile.path).join(IndexVersion, IndexVersion.id == IndexFile.version_id)
            .join(IndexShard, IndexShard.id == IndexVersion.shard_id).where(IndexShard.index_id.in_(index_ids))
        ))
    return paths


def exists(shoal: Shoal, table: type, row_id: int) -> bool:
    with Session(shoal.engine) as s:
        return bool(s.scalar(sql_select(func.count()).select_from(table).where(table.id == row_id)))  # type: ignore[attr-defined]


def kill_after_commit(settings: Settings, op: str, arg: str, gone: Callable[[], bool]) -> None:
    """Run one drop in a child process and SIGKILL it right after its transaction committed."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, op, arg], env=settings_env(settings),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        assert line.strip() == "committed", f"{op}: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}"
        wait_for(gone, 10, f"the {op} drop's rows to be gone")  # committed, as the child said
        os.kill(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def all_files(shoal: Shoal) -> set[str]:
    return set(shoal.storage.list_files("tenants"))


def assert_exact(shoal: Shoal, source: str, index: str) -> None:
    """Searching the index answers exactly what a brute force over the folded source answers."""
    state = shoal.fold(source, "1")
    vectors = np.asarray(state["__vector"].to_pylist(), dtype=np.float32).reshape(-1, DIM)
    queries = np.random.default_rng(3).normal(size=(5, DIM)).astype(np.float32)
    _, labels = exact_top_k(Metric("euclidean"), queries, vectors, 5)
    ids = state["id"].to_pylist()
    searcher = shoal.searcher(follow=False)
    try:
        hits = searcher.search(index, "1", queries, 5)
    finally:
        searcher.close()
    assert [[h.attributes["id"] for h in row] for row in hits] == [[ids[j] for j in row] for row in labels]


def test_sigkill_after_each_drop_commits_then_gc_deletes_exactly_what_they_left(
    make_settings: Callable[..., Settings],
) -> None:
    settings = make_settings("local")
    other_settings = make_settings("local")
    assert settings.storage_uri == other_settings.storage_uri  # one storage root, two tenants
    with Shoal(settings, notify=False) as shoal, Shoal(other_settings, notify=False) as other:
        populate(other, "keep", ["ix-keep", "ix-drop"])  # the other tenant: same names, never touched
        keep = populate(shoal, "keep", ["ix-keep", "ix-drop"])
        gone = populate(shoal, "gone", ["gone-ix"])
        trashed = populate(shoal, "trashed", ["trashed-ix"])
        # A generation of ix-keep built aside by a reindex, then abandoned.
        job = start_reindex(shoal.catalog, shoal.indexes, "ix-keep", "1", algorithm="hnsw",
                            params={"M": 8, "ef_construction": 40, "ef_search": 16})
        assert job.to_index_id is not None
        generation = job.to_index_id
        build(shoal, generation)
        # The purged source's trash folder holds a file too (what a dataset keeps there: its mirror).
        trash = Trash(shoal.engine, shoal.catalog.tenant_id, shoal.tenant)
        trash.soft_delete("trashed", "1", dt.timedelta(0))
        mirror = f"tenants/{shoal.tenant}/trash/{trashed}/dataset_metadata.json"
        shoal.storage.write_atomic(mirror, pa.py_buffer(b"{}"))

        drop_index = shoal.get_index("ix-drop", "1").id
        victims = {
            "index": referenced(shoal, indexes=[drop_index]),
            "source": referenced(shoal, sources=[gone]),
            "generation": referenced(shoal, indexes=[generation]),
            "purge": referenced(shoal, sources=[trashed]) | {mirror},
        }
        assert all(victims.values())
        dropped = set().union(*victims.values())
        kept = referenced(shoal, sources=[keep]) - victims["index"] - victims["generation"]
        assert kept and not kept & dropped
        before = all_files(shoal)
        assert dropped <= before

        kill_after_commit(settings, "index", "ix-drop", lambda: not exists(shoal, Index, drop_index))
        kill_after_commit(settings, "source", "gone", lambda: not exists(shoal, DataSource, gone))
        kill_after_commit(settings, "generation", str(generation), lambda: not exists(shoal, Index, generation))
        kill_after_commit(settings, "purge", str(trashed), lambda: not exists(shoal, DataSource, trashed))

        # Every drop committed and was killed before deleting anything: the files are all there, all queued.
        assert all_files(shoal) == before
        assert garbage.pending(shoal.engine, tenant=shoal.tenant) == len(dropped)
        assert exists(shoal, DataSource, keep) and exists(shoal, Index, shoal.get_index("ix-keep", "1").id)

        # Within the grace period GC keeps them (searchers may still read a dropped index); once it passed,
        # it deletes exactly those files: nothing this tenant or the other one still references.
        assert shoal.collect_garbage().deleted == len(victims["generation"] | victims["purge"])  # due at once
        later = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=settings.gc_grace_s + 1)
        result = shoal.collect_garbage(now=later)
        assert result.pending == 0 and result.kept == 0
        assert all_files(shoal) == before - dropped
        logged = {p for p, _, _ in garbage.deletion_log(shoal.engine, tenant=shoal.tenant, limit=10_000)}
        assert logged == dropped

        # What was kept still answers exactly, in this tenant and the other.
        assert_exact(shoal, "keep", "ix-keep")
        assert_exact(other, "keep", "ix-keep")
        assert_exact(other, "keep", "ix-drop")
        assert other.collect_garbage(now=later).deleted == 0
        assert garbage.deletion_log(other.engine, tenant=other.tenant) == []


def test_gc_scan_finds_orphans_in_index_folders(make_settings: Callable[..., Settings]) -> None:
    """A file under an index folder that no version names (a crashed build's) is queued by the scan once it
    is older than the grace period, then deleted; the files of kept versions are not touched."""
    with Shoal(make_settings("local", gc_grace_s=0), notify=False) as shoal:
        populate(shoal, "keep", ["ix-keep"], rows=20)
        index = shoal.get_index("ix-keep", "1")
        live = referenced(shoal, indexes=[index.id])
        orphan = f"tenants/{shoal.tenant}/indexes/ix-keep/1/gen-1/shard-0/crashed-build/rows.parquet"
        shoal.storage.write_atomic(orphan, pa.py_buffer(b"never published"))
        before = all_files(shoal)
        result = shoal.collect_garbage()
        assert (result.queued, result.deleted) == (1, 1)
        assert all_files(shoal) == before - {orphan}
        assert live <= all_files(shoal)
        assert_exact(shoal, "keep", "ix-keep")
