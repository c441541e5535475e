"""GC removes the folders its deletions leave empty up to the dropped owner's folder locally (on S3, where a
folder is a directory marker removed only with everything under it, only an index segment's folder), keeps
those of live owners, and a local write racing with such a removal still lands."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from shoal import DataPoint, DataSourceSpec, Shoal
from shoal.catalog.indexes import ShardCatalog
from shoal.datasets.service import DatasetService
from shoal.index.builder import ShardBuilder
from shoal.index.reindex import drop_expired_generations, start_reindex
from shoal.log.records import IndexSpec
from shoal.storage import Storage, layout

DIM = 2


def stored(shoal: Shoal) -> set[str]:
    """Everything the storage holds under the tenant's folder, relative to it: files, and folders (a trailing
    slash) as the storage has them: local directories, S3 objects whose key ends in a slash (directory markers)."""
    storage = shoal.storage
    top = layout.tenant_prefix(shoal.settings.tenant).rstrip("/")
    if storage.local:
        base = Path(storage.path(top))
        return {str(p.relative_to(base)) + ("/" if p.is_dir() else "") for p in base.rglob("*")}
    import boto3

    s3 = boto3.client("s3", endpoint_url=shoal.settings.s3_endpoint_url, aws_access_key_id="test",
                      aws_secret_access_key="test", region_name="us-east-1")
    bucket, _, root = storage.root.partition("/")
    prefix = f"{root}/{top}/"
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"][len(prefix):] for page in pages for o in page.get("Contents", [])}


def source_with_index(shoal: Shoal, builder: ShardBuilder, name: str) -> None:
    """A data source `name` with four points, and a built index `name.I` on it."""
    shoal.create_data_source(DataSourceSpec(name, "1", DIM, {"id": "int64"}, ["id"]))
    shoal.create_index(IndexSpec(f"{name}.I", "1", name, "1", algorithm="flat", metric="euclidean"))
    shoal.producer(name, "1").upload([DataPoint({"id": i}, [float(i), 1.0]) for i in range(4)])
    for shard in shoal.get_index(f"{name}.I", "1").shards:
        builder.materialize(shard.id)


def test_gc_removes_the_folders_of_dropped_owners_and_keeps_live_ones(
    make_shoal: Callable[..., Shoal], storage_kind: str
) -> None:
    """After a data source, its index and datasets (one hard-deleted, one soft-deleted and purged) are dropped,
    GC (grace 0) leaves nothing of them in storage: no file, no empty folder, no directory marker. What live
    owners hold stays exactly as it was."""
    shoal = make_shoal(storage_kind, gc_grace_s=0)
    builder = ShardBuilder(shoal.engine, shoal.storage)
    searcher = shoal.searcher(follow=False)
    try:
        datasets = DatasetService(shoal, searcher)
        source_with_index(shoal, builder, "live")
        datasets.create("keptds", DIM)
        live = stored(shoal)
        assert any(p.startswith("indexes/live.I/1/gen-1/shard-0/") for p in live)
        assert "datasets/keptds/dataset_metadata.json" in live

        source_with_index(shoal, builder, "gone")
        datasets.create("harddel", DIM)
        datasets.create("softdel", DIM)
        trash_id = datasets.delete("softdel").trash_id
        assert any(p.startswith(f"trash/{trash_id}/") for p in stored(shoal))
        datasets.purge("softdel", trash_id)
        datasets.delete("harddel", hard=True)
        assert shoal.drop_index("gone.I", "1") > 0
        assert shoal.drop_data_source("gone", "1") > 0
    finally:
        searcher.close()

    result = shoal.collect_garbage(now=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5))
    assert result.deleted > 0

    now = stored(shoal)
    if shoal.storage.local:
        # The tenant's kind folders themselves may stay (here `trash/`).
        left = {p for p in now if p.count("/") > 1 or not p.endswith("/")}
        assert left == {p for p in live if p.count("/") > 1 or not p.endswith("/")}
        for gone in ("sources/gone/", "indexes/gone.I/", "datasets/harddel/", "datasets/softdel/",
                     f"trash/{trash_id}/"):
            assert not any(p.startswith(gone) for p in left), gone
    else:
        # On S3 only a segment's folder goes (nothing writes into it again): removing an owner's marker would
        # remove whatever a new owner of the name wrote under it meanwhile. No file of a dropped owner stays.
        assert {p for p in now if not p.endswith("/")} == {p for p in live if not p.endswith("/")}
        shard = "indexes/gone.I/1/gen-1/shard-0/"  # removing a segment's folder leaves its parent's marker
        assert not any(p.startswith(shard) and p != shard for p in now), now
    searcher = shoal.searcher(follow=False)
    try:  # the live index still answers from its files
        assert len(searcher.search("live.I", "1", [[1.0, 1.0]], 2)[0]) == 2
    finally:
        searcher.close()


def generation_folders(shoal: Shoal, index: str) -> dict[str, set[str]]:
    """What the storage holds below each `gen-N` folder of version 1 of `index` ("gen-N" -> paths below it; an
    empty set for an empty folder)."""
    base = f"indexes/{index}/1/"
    found: dict[str, set[str]] = {}
    for p in stored(shoal):
        if p.startswith(base) and p != base:
            gen, _, below = p[len(base):].partition("/")
            found.setdefault(gen, set())
            if below:
                found[gen].add(below)
    return found


def test_gc_removes_the_folders_of_swept_generations_and_keeps_the_serving_one(
    make_shoal: Callable[..., Shoal],
) -> None:
    """Each reindex builds its generation in a new `gen-N` folder; once the generations it replaced are swept
    (their keep time over) and GC ran, their folders are gone too, not left empty forever, and the serving
    generation's folder keeps all its files."""
    shoal = make_shoal("local", gc_grace_s=0)
    builder = ShardBuilder(shoal.engine, shoal.storage)
    source_with_index(shoal, builder, "rx")
    assert shoal.reindex("rx.I", "1", algorithm="hnsw", wait=True).state == "swapped"
    assert shoal.reindex("rx.I", "1", algorithm="flat", wait=True).state == "swapped"
    assert set(generation_folders(shoal, "rx.I")) == {"gen-1", "gen-2", "gen-3"}
    serving = generation_folders(shoal, "rx.I")["gen-3"]

    swept = drop_expired_generations(shoal.engine, shoal.storage, keep_s=0, tenant_id=shoal.catalog.tenant_id)
    assert swept == 2
    shoal.collect_garbage(now=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5))

    left = generation_folders(shoal, "rx.I")
    assert set(left) == {"gen-3"}, f"folders of swept generations left behind: {sorted(left)}"
    assert left["gen-3"] == serving
    searcher = shoal.searcher(follow=False)
    try:  # the serving generation still answers from its files
        assert len(searcher.search("rx.I", "1", [[1.0, 1.0]], 2)[0]) == 2
    finally:
        searcher.close()


def test_gc_keeps_the_folder_of_a_generation_being_built_and_removes_it_once_cancelled(
    make_shoal: Callable[..., Shoal],
) -> None:
    """The `gen-N` folder of a reindex in flight stays while its generation's row exists, even when GC deletes
    the last file in it (here a killed writer's stray file, before anything was built): the build writes there
    next. Once the reindex is cancelled its generation's files and folders go, and the serving one's stay."""
    shoal = make_shoal("local", gc_grace_s=0)
    builder = ShardBuilder(shoal.engine, shoal.storage)
    source_with_index(shoal, builder, "fx")
    serving = generation_folders(shoal, "fx.I")["gen-1"]
    job = start_reindex(shoal.catalog, shoal.indexes, "fx.I", "1", algorithm="hnsw")
    assert job.definition["generation"] == 2
    stray = f"{layout.index_dir(shoal.settings.tenant, 'fx.I', '1')}/gen-2/shard-0/stray"
    shoal.storage.write_atomic(stray, pa.py_buffer(b"x"))

    result = shoal.collect_garbage(now=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5))
    assert result.deleted == 1 and not shoal.storage.exists(stray)
    assert generation_folders(shoal, "fx.I") == {"gen-1": serving, "gen-2": {"shard-0/"}}

    found = ShardCatalog(shoal.engine).index_by_id(job.to_index_id)  # type: ignore[arg-type]
    assert found is not None
    for shard in found[1].shards:
        builder.materialize(shard.id)
    assert any(p.startswith("shard-0/") and not p.endswith("/") for p in generation_folders(shoal, "fx.I")["gen-2"])
    assert shoal.cancel_reindex("fx.I", "1").state == "cancelled"
    shoal.collect_garbage(now=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5))
    assert generation_folders(shoal, "fx.I") == {"gen-1": serving}


WRITES = 1500

REMOVER = """
import os, sys, pyarrow.fs as pafs
from shoal.storage import Storage
root, folder, ready, stop = sys.argv[1:]
storage = Storage(pafs.LocalFileSystem(), root, local=True)
chain = [folder]
while chain[-1].count("/") > 3:  # as GC does: the folder, then the ones above it left empty
    chain.append(chain[-1].rpartition("/")[0])
removed = 0
open(ready, "w").close()
for _ in range(10_000_000):  # bounded: the test stops it long before
    if os.path.exists(stop):
        break
    # One GC run after another: a scan of the tenant's folders, then the removal of the folders left empty.
    try:
        storage.list_files("tenants/t")
    except FileNotFoundError:  # a folder or temp file gone while it was listed: the next run sees the rest
        pass
    for f in chain:
        if not storage.remove_empty_dir(f):
            break
        removed += 1
print(removed)
"""


def test_a_local_write_lands_while_gc_removes_its_empty_folder(tmp_path: Path) -> None:
    """GC removes a folder once it is empty; a new owner of the same name writing into it meanwhile made the
    folder, then saw it vanish before it could open its temp file in it (FileNotFoundError). Here another
    process removes the folder (and the ones above it) as fast as it can while this one writes files into it and
    deletes them, so the folder is empty between writes: every write must land. (Before the fix about one
    write in seventy failed: 42 to 49 of 3000 in three runs.)"""
    root = tmp_path / "storage"
    root.mkdir()
    storage = Storage(pafs.LocalFileSystem(), str(root), local=True)
    folder = "tenants/t/sources/s/1/log"
    ready, stop = tmp_path / "ready", tmp_path / "stop"
    remover = subprocess.Popen([sys.executable, "-c", REMOVER, str(root), folder, str(ready), str(stop)],
                               stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert remover.poll() is None and time.monotonic() < deadline, "the remover did not start"
        failures: list[str] = []
        data = pa.py_buffer(b"x" * 64)
        for i in range(WRITES):
            path = f"{folder}/f{i}"
            try:
                if i % 2:
                    storage.write_atomic(path, data)
                else:
                    storage.write_atomic_with(path, lambda out: out.write(b"y" * 64))
                assert storage.read(path).size == 64
            except (FileNotFoundError, FileExistsError) as exc:  # the folder vanished under the write
                failures.append(f"{path}: {exc}")
            storage.delete(path)
    finally:
        stop.touch()
        out, _ = remover.communicate(timeout=60)
    assert remover.returncode == 0, "the remover failed"
    removed = int(out.strip())
    assert removed > 100, "the remover hardly ran: the race was not exercised"
    assert failures == [], f"{len(failures)} of {WRITES} writes failed, such as {failures[0]}"
