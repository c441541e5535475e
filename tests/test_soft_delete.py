"""Soft delete (issue 6): the trash over real HTTP, restore, name reuse, the purge (in process, through a real
Celery worker with beat, and SIGKILLed at random moments), `?hard=true`, and the isolation of other tenants.

Real Postgres, Valkey and storage from conftest's fixtures; no mocks. The end of a retention is simulated by
moving `purge_after` into the past in the catalog (or by a zero retention)."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import random
import select
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from conftest import serve_api, settings_env, start_worker, stop_process, use_settings_env, wait_for
from sqlalchemy import func, update
from sqlalchemy import select as sql_select
from sqlalchemy.orm import Session

from shoal import Shoal
from shoal.auth import create_key
from shoal.catalog.models import DataSource, Index, IndexShard, IndexVersion, LogSegment
from shoal.config.settings import Settings
from shoal.index.builder import ShardBuilder
from shoal.log.heads import head_key
from shoal.searcher.announce import index_token_key
from shoal.upkeep import gc_queue as garbage
from shoal.upkeep.trash import PURGED, Trash, pending_files, purge_due
from shoal.workers.base import ShoalTask

API = "/api/v1"


@pytest.fixture
def served(make_settings: Callable[..., Settings]) -> Iterator[Callable[..., tuple[httpx.Client, Settings]]]:
    """Serve the API for fresh tenants (anonymous too), each client with its tenant's admin key (deletes need a
    key, hard deletes and purges an admin one); every tenant shares one storage root."""
    with contextlib.ExitStack() as stack:

        def start(**overrides: Any) -> tuple[httpx.Client, Settings]:
            settings = make_settings("local", **overrides)
            settings = settings.model_copy(update={"anonymous_tenant": settings.tenant})
            url = stack.enter_context(serve_api(settings))
            with Shoal(settings, notify=False) as shoal:
                key = create_key(shoal.engine, settings.tenant, "admin")[1]
            headers = {"Authorization": f"ApiKey {key}"}
            return stack.enter_context(httpx.Client(base_url=url + API, headers=headers, timeout=30)), settings

        yield start


def create(http: httpx.Client, name: str, dimensions: int = 2, **extra: Any) -> dict[str, Any]:
    r = http.post("/datasets", json={"name": name, "dimensions": dimensions, "metric_type": "euclidean",
                                     "index_type": "flat", **extra})
    assert r.status_code == 201, r.text
    return r.json()  # type: ignore[no-any-return]


def upsert(http: httpx.Client, name: str, *vectors: tuple[str, list[float]]) -> int:
    r = http.post(f"/datasets/{name}/vectors", json={"vectors": [{"id": i, "values": v} for i, v in vectors]})
    assert r.status_code == 200, r.text
    return int(r.json()["write_token"])


def search(http: httpx.Client, name: str, vector: list[float], consistency: str = "strong") -> httpx.Response:
    return http.post(f"/datasets/{name}/search", json={"vector": vector, "top_k": 10, "consistency": consistency})


def ids(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return [h["id"] for h in r.json()["results"]]


def assert_error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["success", "error_code", "message", "details"], body
    assert body["success"] is False and body["error_code"] == code, body
    return body  # type: ignore[no-any-return]


def materialize(settings: Settings, name: str) -> None:
    """Build the dataset's index in this process (so index artifacts exist in storage)."""
    with Shoal(settings, notify=False) as shoal:
        for shard in shoal.get_index(name, "1").shards:
            ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)


def files_of(shoal: Shoal, name: str) -> list[str]:
    """Every file of the tenant that belongs to a dataset called `name` (log, index, mirror) or to its trash."""
    t = shoal.tenant
    return [f for folder in (f"tenants/{t}/sources/{name}", f"tenants/{t}/indexes/{name}",
                             f"tenants/{t}/datasets/{name}", f"tenants/{t}/trash")
            for f in shoal.storage.list_files(folder)]


def rows_of(shoal: Shoal, source_id: int) -> dict[str, int]:
    """How many catalog rows still belong to the data source with that id (and, as "trash_files", how many
    files of the tenant's purges are queued and not deleted yet)."""
    with Session(shoal.engine) as s:
        index_ids = list(s.scalars(sql_select(Index.id).where(Index.data_source_id == source_id)))
        return {
            "data_sources": s.scalar(sql_select(func.count()).where(DataSource.id == source_id)) or 0,
            "log_segments": s.scalar(
                sql_select(func.count()).where(LogSegment.data_source_id == source_id)) or 0,
            "indexes": len(index_ids),
            "index_shards": s.scalar(
                sql_select(func.count()).where(IndexShard.index_id.in_(index_ids))) or 0 if index_ids else 0,
            "trash_files": garbage.pending(shoal.engine, tenant=shoal.tenant, reason=PURGED),
        }


def collect_after_grace(shoal: Shoal) -> None:
    """Run GC as if SHOAL_GC_GRACE_S had passed: files a drop queued are deleted."""
    shoal.collect_garbage(now=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=shoal.settings.gc_grace_s + 1))


def end_retention(shoal: Shoal, source_id: int) -> None:
    """Simulate the end of the retention: move the source's `purge_after` into the past, in the catalog."""
    with Session(shoal.engine) as s, s.begin():
        moved = s.execute(
            update(DataSource)
            .where(DataSource.id == source_id, DataSource.deleted_at.is_not(None))
            .values(purge_after=func.now() - dt.timedelta(seconds=1))
        ).rowcount
    assert moved == 1


def assert_no_row_points_at_a_missing_file(shoal: Shoal) -> int:
    """Every file a catalog row of the tenant references exists (live or in the trash); how many were checked.
    (Other tests' tenants share the catalog but not this storage root.)"""
    from shoal.index.segment import segment_files

    tenant_id = shoal.catalog.tenant_id
    with Session(shoal.engine) as s:
        paths = set(s.scalars(
            sql_select(LogSegment.path).join(DataSource, DataSource.id == LogSegment.data_source_id)
            .where(DataSource.tenant_id == tenant_id)
        ))
        manifests = s.scalars(
            sql_select(IndexVersion.manifest)
            .join(IndexShard, IndexShard.id == IndexVersion.shard_id)
            .join(Index, Index.id == IndexShard.index_id)
            .where(Index.tenant_id == tenant_id)
        )
        for manifest in manifests:
            for entry in manifest["segments"]:
                paths.update(segment_files(entry))
    missing = sorted(p for p in paths if not shoal.storage.exists(p))
    assert not missing, f"catalog rows point at {len(missing)} missing files, e.g. {missing[:3]}"
    return len(paths)


@pytest.fixture
def purge_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Settings], None]]:
    """Give this process a worker's environment for `settings`, so task functions run here directly."""

    def use(settings: Settings) -> None:
        use_settings_env(monkeypatch, settings)
        ShoalTask.reset_context()

    yield use
    ShoalTask.reset_context()


# -- the acceptance cycle ------------------------------------------------------------------------------------


def test_delete_restore_delete_again_purge_leaves_other_tenants_untouched(
    served: Callable[..., tuple[httpx.Client, Settings]], purge_env: Callable[[Settings], None],
    redis_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    http, settings = served(redis_url=redis_url)
    other, other_settings = served(redis_url=redis_url)
    assert settings.storage_uri == other_settings.storage_uri and settings.tenant != other_settings.tenant
    for client, s in ((http, settings), (other, other_settings)):
        create(client, "docs", description="mine")
        upsert(client, "docs", ("a", [1, 0]), ("b", [0, 1]))
        upsert(client, "docs", ("c", [3, 3]))
        materialize(s, "docs")
    shoal = Shoal(settings, notify=False)
    other_shoal = Shoal(other_settings, notify=False)
    try:
        source_id = shoal.get_data_source("docs", "1").id
        before = files_of(shoal, "docs")
        assert any("/indexes/docs/" in f for f in before) and any("/sources/docs/" in f for f in before)
        other_before = files_of(other_shoal, "docs")
        assert len(other_before) == len(before)

        # Delete: a soft delete into the tenant's trash.
        r = http.delete("/datasets/docs")
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["success"], body["dataset_id"], body["deleted"], body["soft"], body["trash_id"]) == (
            True, "docs", True, True, source_id)
        purge_after = dt.datetime.fromisoformat(body["purge_after"])
        expected = dt.datetime.now(dt.UTC) + dt.timedelta(days=30)
        assert abs((purge_after - expected).total_seconds()) < 120

        # Hidden everywhere: dataset routes, Vektonn and management routes, the Python API.
        assert_error(http.get("/datasets/docs"), 404, "DATASET_NOT_FOUND")
        assert http.get("/datasets").json()["total"] == 0
        assert_error(search(http, "docs", [0, 0]), 404, "DATASET_NOT_FOUND")
        assert_error(search(http, "docs", [0, 0], "eventual"), 404, "DATASET_NOT_FOUND")
        assert_error(http.post("/search/multi-dataset", json={"dataset_ids": ["docs"], "vector": [0, 0]}),
                     404, "DATASET_NOT_FOUND")
        assert_error(http.post("/datasets/docs/vectors", json={"vectors": [{"id": "x", "values": [0, 0]}]}),
                     404, "DATASET_NOT_FOUND")
        assert_error(http.get("/datasets/docs/stats"), 404, "DATASET_NOT_FOUND")
        assert_error(http.delete("/datasets/docs"), 404, "DATASET_NOT_FOUND")
        base = str(http.base_url).rstrip("/").removesuffix(API)
        r = httpx.post(f"{base}/api/v1/search/docs/1", json={"k": 1, "queryVectors": [{"coordinates": [0, 0]}]})
        assert r.status_code == 404 and "not found" in r.text, r.text
        r = httpx.post(f"{base}/api/v1/upload/docs/1", json=[])
        assert r.status_code == 404 and "not found" in r.text, r.text
        assert httpx.get(f"{base}/api/v1/data-sources").json() == []
        assert httpx.get(f"{base}/api/v1/data-sources/docs/1").status_code == 404
        with pytest.raises(Exception, match="not found"):
            shoal.get_data_source("docs", "1")
        with pytest.raises(Exception, match="not found"):
            shoal.producer("docs", "1")
        assert shoal.list_data_sources() == [] and shoal.list_indexes() == []
        assert not (shoal.storage.exists(f"tenants/{settings.tenant}/datasets/docs/dataset_metadata.json"))
        # The files stay where they are (the catalog says they are in the trash); the mirror moved to the trash.
        trash_mirror = f"tenants/{settings.tenant}/trash/{source_id}/dataset_metadata.json"
        assert json.loads(shoal.storage.read(trash_mirror).to_pybytes())["purge_after"] == body["purge_after"]

        # The trash lists it.
        trash = http.get("/trash").json()
        assert trash["total"] == 1
        [item] = trash["datasets"]
        assert (item["id"], item["trash_id"], item["purge_after"], item["description"], item["vector_count"]) == (
            "docs", source_id, body["purge_after"], "mine", 3)
        assert other.get("/trash").json()["total"] == 0  # the other tenant's trash is its own

        # The name is free: a new dataset takes it, and then restoring is a clear conflict.
        create(http, "docs", 3)
        upsert(http, "docs", ("z", [1, 1, 1]))
        assert ids(search(http, "docs", [0, 0, 0])) == ["z"]
        body = assert_error(http.post("/trash/docs/restore"), 409, "DATASET_ALREADY_EXISTS")
        assert body["details"]["trash_id"] == source_id and "took" in body["message"]
        assert http.delete("/datasets/docs", params={"hard": "true"}).json()["soft"] is False

        # Restore within retention: the data is back, searchable at once (the built index is intact).
        r = http.post("/trash/docs/restore")
        assert r.status_code == 200, r.text
        assert (r.json()["id"], r.json()["dimensions"], r.json()["description"]) == ("docs", 2, "mine")
        assert http.get("/trash").json()["total"] == 0
        assert ids(search(http, "docs", [0, 0])) == ["a", "b", "c"]
        assert ids(search(http, "docs", [0, 0], "eventual")) == ["a", "b", "c"]
        assert shoal.get_data_source("docs", "1").id == source_id
        assert shoal.storage.exists(f"tenants/{settings.tenant}/datasets/docs/dataset_metadata.json")
        assert not shoal.storage.exists(trash_mirror)
        upsert(http, "docs", ("d", [5, 5]))  # writable again
        assert ids(search(http, "docs", [0, 0])) == ["a", "b", "c", "d"]
        assert_error(http.post("/trash/docs/restore"), 404, "DATASET_NOT_FOUND")  # nothing left to restore

        # Delete again, then the retention ends: the purge task (run here) deletes files and rows.
        r = http.delete("/datasets/docs")
        assert r.json()["soft"] is True and r.json()["trash_id"] == source_id
        end_retention(shoal, source_id)
        assert_error(http.post("/trash/docs/restore"), 404, "DATASET_NOT_FOUND")  # the purge owns it now
        purge_env(settings)
        from shoal.workers.tasks import purge_trash

        caplog.set_level(logging.INFO, logger="shoal.upkeep.trash")
        keys = [head_key(source_id), index_token_key(source_id)]
        assert shoal.runtime.redis().exists(*keys) == 2  # announced by its writes and its drop
        result = purge_trash()
        assert shoal.runtime.redis().exists(*keys) == 0  # the purge leaves nothing of the source in Redis
        purged = [p for p in result["purged"] if p["id"] == source_id]
        assert purged == [{"tenant": settings.tenant, "name": "docs", "version": "1", "id": source_id}]
        collect_after_grace(shoal)  # the hard-deleted second "docs" above: its drop queued its files
        assert files_of(shoal, "docs") == []
        assert rows_of(shoal, source_id) == {"data_sources": 0, "log_segments": 0, "indexes": 0,
                                             "index_shards": 0, "trash_files": 0}
        assert http.get("/trash").json()["total"] == 0
        deleted_lines = [m for m in caplog.messages if m.startswith("purge: deleted file")
                         or m.startswith("purge: deleted folder")]
        assert len(deleted_lines) == result["files_deleted"] >= 4  # one line per file or folder deleted
        assert any(m.startswith("purge: deleted the catalog rows of data source docs/1") for m in caplog.messages)
        assert all(p["id"] != source_id for p in purge_trash()["purged"])  # a rerun finds nothing more

        # The other tenant's dataset of the same name is untouched.
        assert files_of(other_shoal, "docs") == other_before
        assert ids(search(other, "docs", [0, 0])) == ["a", "b", "c"]
        assert ids(search(other, "docs", [0, 0], "eventual")) == ["a", "b", "c"]
        assert other.get("/datasets/docs").json()["vector_count"] == 3
        assert_no_row_points_at_a_missing_file(shoal)
    finally:
        shoal.close()
        other_shoal.close()


def test_hard_delete_is_immediate(served: Callable[..., tuple[httpx.Client, Settings]]) -> None:
    http, settings = served()
    create(http, "docs")
    upsert(http, "docs", ("a", [1, 0]))
    materialize(settings, "docs")
    with Shoal(settings, notify=False) as shoal:
        source_id = shoal.get_data_source("docs", "1").id
        assert files_of(shoal, "docs")
        r = http.delete("/datasets/docs", params={"hard": "true"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["deleted"], body["soft"], body["trash_id"], body["purge_after"]) == (True, False, None, None)
        assert body["files_deleted"] >= 3
        collect_after_grace(shoal)  # the drop queued the files (searchers may still read them)
        assert files_of(shoal, "docs") == []
        assert rows_of(shoal, source_id)["data_sources"] == 0
        assert http.get("/trash").json()["total"] == 0
        assert_error(http.post("/trash/docs/restore"), 404, "DATASET_NOT_FOUND")
        create(http, "docs")  # the name is free


def test_trash_picks_restores_and_purges_by_trash_id(served: Callable[..., tuple[httpx.Client, Settings]]) -> None:
    http, settings = served(trash_retention_days=0.5)
    create(http, "docs", description="first")
    first = http.delete("/datasets/docs").json()
    create(http, "docs", description="second")
    second = http.delete("/datasets/docs").json()
    assert first["trash_id"] != second["trash_id"]
    purge_after = dt.datetime.fromisoformat(second["purge_after"])
    assert abs((purge_after - dt.datetime.now(dt.UTC) - dt.timedelta(hours=12)).total_seconds()) < 120

    page = http.get("/trash", params={"limit": 1}).json()
    assert (page["total"], [d["description"] for d in page["datasets"]]) == (2, ["second"])  # newest first
    assert [d["description"] for d in http.get("/trash", params={"offset": 1}).json()["datasets"]] == ["first"]
    assert_error(http.post("/trash/docs/restore", params={"trash_id": 999999999}), 404, "DATASET_NOT_FOUND")
    assert_error(http.post("/trash/nope/restore"), 404, "DATASET_NOT_FOUND")
    assert_error(http.post("/trash/Bad!/restore"), 400, "INVALID_DATASET_NAME")

    # Restore the older one by its trash id; the newer one then conflicts with it.
    r = http.post("/trash/docs/restore", params={"trash_id": first["trash_id"]})
    assert r.status_code == 200 and r.json()["description"] == "first"
    assert_error(http.post("/trash/docs/restore"), 409, "DATASET_ALREADY_EXISTS")

    # Purge the newer one now, without waiting for its retention.
    with Shoal(settings, notify=False) as shoal:
        r = http.delete("/trash/docs")
        assert r.status_code == 200, r.text
        assert (r.json()["purged"], r.json()["trash_id"]) == (True, second["trash_id"])
        assert rows_of(shoal, second["trash_id"])["data_sources"] == 0
        assert not shoal.storage.list_files(f"tenants/{settings.tenant}/trash/{second['trash_id']}")
        assert http.get("/trash").json()["total"] == 0
        assert_error(http.delete("/trash/docs"), 404, "DATASET_NOT_FOUND")
        assert http.get("/datasets/docs").json()["description"] == "first"  # the live one is untouched


def test_python_api_trash_with_zero_retention(make_settings: Callable[..., Settings], storage_kind: str) -> None:
    """A data source (not a dataset) through the catalog's trash, on local and S3 storage: a zero retention
    purges at the next run; an index (and an alias) over it is hidden with it and its name free."""
    from shoal import DataSourceSpec
    from shoal.errors import AlreadyExistsError, NotFoundError
    from shoal.log.records import IndexSpec
    from shoal.upkeep.gc import _delete

    settings = make_settings(storage_kind)
    with Shoal(settings, notify=False) as shoal, Shoal(make_settings(storage_kind), notify=False) as other:
        spec = DataSourceSpec("src", "1", 2, {"id": "int64"}, ["id"])
        for s in (shoal, other):
            s.create_data_source(spec)
            s.create_index(IndexSpec("idx", "1", "src", "1", algorithm="flat", metric="euclidean"))
            s.producer("src", "1").upload_columns([[0.0, 1.0]], {"id": [1]})
            s.set_alias("current", "idx", "1")
            for shard in s.get_index("idx", "1").shards:
                ShardBuilder(s.engine, s.storage).materialize(shard.id)
        assert shoal.storage.list_files(f"tenants/{settings.tenant}/indexes/idx")
        trash = Trash(shoal.engine, shoal.catalog.tenant_id, shoal.tenant)
        trashed = trash.soft_delete("src", "1", dt.timedelta(days=1))
        assert trashed.indexes == (("idx", "1"),)
        with pytest.raises(NotFoundError):
            shoal.get_index("idx", "1")
        with pytest.raises(NotFoundError):
            shoal.get_alias("current")
        with pytest.raises(NotFoundError):
            trash.soft_delete("src", "1", dt.timedelta(days=1))
        shoal.create_data_source(spec)
        shoal.create_index(IndexSpec("idx", "1", "src", "1", algorithm="flat", metric="euclidean"))
        with pytest.raises(AlreadyExistsError, match="took"):
            trash.restore(trashed.id)
        shoal.drop_index("idx", "1")
        with pytest.raises(AlreadyExistsError, match="data source"):
            trash.restore(trashed.id)
        shoal.drop_data_source("src", "1")
        trash.restore(trashed.id)
        assert shoal.get_alias("current").index_name == "idx"
        assert shoal.fold("src", "1").num_rows == 1

        trash.soft_delete("src", "1", dt.timedelta(0))  # zero retention: due at once
        result = purge_due(shoal.engine, shoal.storage)
        assert (settings.tenant, "src", "1", trashed.id) in result.sources
        collect_after_grace(shoal)  # the dropped second "src" and "idx" above: their drops queued their files
        assert shoal.storage.list_files(f"tenants/{settings.tenant}/sources/src") == []
        assert shoal.storage.list_files(f"tenants/{settings.tenant}/indexes/idx") == []
        assert rows_of(shoal, trashed.id)["data_sources"] == 0
        assert other.fold("src", "1").num_rows == 1 and other.get_alias("current").index_name == "idx"
        assert other.storage.list_files(f"tenants/{other.tenant}/indexes/idx")
        # Deleting what is already gone is not an error (a rerun after a crash does exactly that).
        assert _delete(shoal.storage, f"tenants/{settings.tenant}/sources/src/1/log/missing.parquet") is False
        assert _delete(shoal.storage, f"tenants/{settings.tenant}/indexes/idx/1/gen-1/shard-0/missing") is False


# -- through a real worker -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_beat_purges_through_a_real_worker(
    served: Callable[..., tuple[httpx.Client, Settings]], redis_url: str, worker_catalog: str
) -> None:
    http, settings = served(database_url=worker_catalog, redis_url=redis_url, purge_interval_s=0.5,
                            sweep_interval_s=1.0)
    other, _ = served(database_url=worker_catalog, redis_url=redis_url)
    for client in (http, other):
        create(client, "docs")
        upsert(client, "docs", ("a", [1, 0]), ("b", [0, 1]))
    materialize(settings, "docs")
    with Shoal(settings, notify=False) as shoal:
        source_id = shoal.get_data_source("docs", "1").id
        assert http.delete("/datasets/docs").json()["soft"] is True
        assert files_of(shoal, "docs")
        worker = start_worker(settings, beat=True)
        try:
            # Within its retention nothing is purged, however often beat runs the task.
            wait_for(lambda: worker.log_path.read_text().count("purge_trash") >= 4, 60,  # type: ignore[attr-defined]
                     "beat to run purge_trash a few times")
            assert rows_of(shoal, source_id)["data_sources"] == 1 and files_of(shoal, "docs")
            end_retention(shoal, source_id)
            wait_for(lambda: not files_of(shoal, "docs") and rows_of(shoal, source_id)["data_sources"] == 0, 60,
                     "the worker to purge the dataset")
            wait_for(lambda: rows_of(shoal, source_id)["trash_files"] == 0, 30, "the purge's list to empty")
        finally:
            stop_process(worker)
        log_text = worker.log_path.read_text()  # type: ignore[attr-defined]
        assert f"purge: deleted the catalog rows of data source docs/1 (#{source_id})" in log_text
        assert "purge: deleted file" in log_text
    assert ids(search(other, "docs", [0, 0])) == ["a", "b"]


# -- crash safety --------------------------------------------------------------------------------------------

PURGE_CHILD = r"""
import sys
import shoal.upkeep.gc as gc
import shoal.upkeep.trash as trash
from shoal import Shoal

real_delete = gc._delete

def traced_delete(storage, path):
    print("deleting", path, flush=True)  # the parent kills after a random number of these
    return real_delete(storage, path)

gc._delete = traced_delete  # the purge deletes the files it queued through GC's checked deletion
with Shoal() as shoal:
    print("start", flush=True)
    result = trash.purge_due(shoal.engine, shoal.storage)
    print("done", len(result.sources), flush=True)
"""


@pytest.mark.slow
def test_sigkill_during_purge_leaves_no_row_pointing_at_a_missing_file(
    make_settings: Callable[..., Settings],
) -> None:
    from shoal import DataSourceSpec
    from shoal.log.records import IndexSpec

    settings = make_settings("local")
    rng = random.Random(20261122)
    with Shoal(settings, notify=False) as shoal:
        trash = Trash(shoal.engine, shoal.catalog.tenant_id, shoal.tenant)
        builder = ShardBuilder(shoal.engine, shoal.storage)

        def make(name: str) -> int:
            shoal.create_data_source(DataSourceSpec(name, "1", 4, {"id": "int64"}, ["id"]))
            shoal.create_index(IndexSpec(name, "1", name, "1", algorithm="flat", metric="euclidean", shard_count=2))
            producer = shoal.producer(name, "1")
            for batch in range(6):
                producer.upload_columns([[float(batch), 1.0, 2.0, float(i)] for i in range(8)],
                                        {"id": list(range(batch * 4, batch * 4 + 8))})
                if batch % 2:
                    for shard in shoal.get_index(name, "1").shards:
                        builder.materialize(shard.id)
            return shoal.get_data_source(name, "1").id

        doomed = [make(f"doomed{i}") for i in range(12)]
        keep = make("keep")
        for i in range(12):
            trash.soft_delete(f"doomed{i}", "1", dt.timedelta(days=30))
        for source_id in doomed:
            end_retention(shoal, source_id)
        kept_files = shoal.storage.list_files(f"tenants/{settings.tenant}/sources/keep")
        checked = assert_no_row_points_at_a_missing_file(shoal)
        assert checked > 100

        kills = 0
        # The first `killed_runs` runs are killed (unless one finishes first); the run after them is left to
        # finish, since how many runs a purge needs depends on how many files it deletes.
        killed_runs = 30
        for run in range(killed_runs + 1):
            proc = subprocess.Popen([sys.executable, "-c", PURGE_CHILD], env=settings_env(settings),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert proc.stdout is not None
            # Kill right as it starts (finishing the last run's list, or in the rows transaction), or after
            # 1..30 file deletions: between a file's deletion and its list entry's, or between two files.
            target = rng.choice([0, rng.randint(1, 30), rng.randint(1, 30)]) if run < killed_runs else None
            deletions = 0
            finished = False
            while True:
                ready, _, _ = select.select([proc.stdout], [], [], 60)
                assert ready, f"purge run {run} stalled"
                line = proc.stdout.readline()
                if not line or line.startswith("done"):
                    finished = True
                    break
                deletions += line.startswith("deleting")
                if target is None:
                    continue  # the last run: to the end
                if (target == 0 and line.startswith("start")) or (target and deletions >= target):
                    break
            if not finished:
                os.kill(proc.pid, signal.SIGKILL)
                kills += 1
            _, err = proc.communicate(timeout=60)
            if finished:
                assert proc.returncode == 0, err
                break
            assert proc.returncode == -signal.SIGKILL, err
            assert_no_row_points_at_a_missing_file(shoal)
        assert kills >= 3, "the purge finished before it could be killed a few times"
        assert finished, "the purge never finished"

        # Finished: nothing of the doomed sources is left, the kept one is intact and readable.
        assert pending_files(shoal.engine) == 0
        for i, source_id in enumerate(doomed):
            assert rows_of(shoal, source_id) == {"data_sources": 0, "log_segments": 0, "indexes": 0,
                                                 "index_shards": 0, "trash_files": 0}
            assert shoal.storage.list_files(f"tenants/{settings.tenant}/sources/doomed{i}") == []
        leftovers = [f for f in shoal.storage.list_files(f"tenants/{settings.tenant}/indexes")
                     if not f.startswith(f"tenants/{settings.tenant}/indexes/keep/")]
        assert leftovers == []
        assert shoal.storage.list_files(f"tenants/{settings.tenant}/sources/keep") == kept_files
        assert shoal.get_data_source("keep", "1").id == keep
        assert shoal.fold("keep", "1").num_rows == 28
        assert_no_row_points_at_a_missing_file(shoal)


# -- the CLI -------------------------------------------------------------------------------------------------


def test_cli_trash_list_restore_purge(
    served: Callable[..., tuple[httpx.Client, Settings]], purge_env: Callable[[Settings], None]
) -> None:
    from typer.testing import CliRunner

    from shoal.cli import app

    http, settings = served()
    purge_env(settings)  # the CLI reads the same settings from SHOAL_* variables
    runner = CliRunner()

    def cli(*args: str, code: int = 0) -> str:
        result = runner.invoke(app, list(args))
        assert result.exit_code == code, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
        assert "Traceback" not in result.output
        return result.output

    assert "is empty" in cli("trash", "list")
    create(http, "docs", description="cli")
    upsert(http, "docs", ("a", [1, 0]))
    trash_id = http.delete("/datasets/docs").json()["trash_id"]
    [item] = json.loads(cli("trash", "list", "--json"))
    assert (item["trash_id"], item["name"], item["dataset"], item["indexes"]) == (trash_id, "docs", True, ["docs/1"])
    assert "docs" in cli("trash", "list")
    assert "nothing named 'nope'" in cli("trash", "restore", "nope", code=1)

    assert f"Restored docs/1 (trash id {trash_id})" in cli("trash", "restore", "docs")
    assert ids(search(http, "docs", [0, 0])) == ["a"]
    with Shoal(settings, notify=False) as shoal:  # the restore rewrote the metadata mirror
        assert shoal.storage.exists(f"tenants/{settings.tenant}/datasets/docs/dataset_metadata.json")

        http.delete("/datasets/docs")
        assert json.loads(cli("trash", "purge", "--json"))["purged"] == []  # within retention: nothing due
        assert "1 purged" in cli("trash", "purge", "--now", "--yes")
        assert "is empty" in cli("trash", "list")
        assert files_of(shoal, "docs") == [] and rows_of(shoal, trash_id)["data_sources"] == 0


def test_a_producer_from_before_the_soft_delete_cannot_write_into_the_trash(local_shoal: Shoal) -> None:
    import numpy as np

    from shoal.catalog.repo import head_of
    from shoal.errors import NotFoundError
    from shoal.log.records import AttributeType, DataSourceSpec

    local_shoal.create_data_source(DataSourceSpec("late", "1", 2, {"id": AttributeType.INT64}, ["id"]))
    producer = local_shoal.producer("late", "1")
    producer.upload_columns(np.ones((3, 2), dtype=np.float32), {"id": [1, 2, 3]})
    source_id = producer.source.id
    Trash(local_shoal.engine, local_shoal.catalog.tenant_id, local_shoal.tenant).soft_delete(
        "late", "1", dt.timedelta(days=1)
    )
    with pytest.raises(NotFoundError, match="in the trash"):
        producer.upload_columns(np.ones((1, 2), dtype=np.float32), {"id": [4]})
    assert head_of(local_shoal.engine, source_id)[0] == 3
