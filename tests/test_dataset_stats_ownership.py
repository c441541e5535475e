"""A dataset's `/stats` storage figures count only its own files.

Index folders (`indexes/{name}/1/...`) and log folders (`sources/{name}/1/log/`) are keyed by name, so a dataset
deleted (to the trash, or for good with `?hard=true`) leaves its files beside those of a new dataset of the same
name until the purge or GC deletes them. The new dataset's `index_bytes` / `index_files` and `log_bytes` must not
count them: only the files its own catalog rows name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import serve_api
from sqlalchemy import select
from sqlalchemy.orm import Session

from shoal import Shoal
from shoal.auth import create_key
from shoal.catalog.models import DataSource, Index, IndexFile, IndexShard, IndexVersion, LogSegment, Tenant
from shoal.config.settings import Settings
from shoal.index.builder import ShardBuilder

Api = tuple[httpx.Client, Settings]


@pytest.fixture
def open_api(make_settings: Callable[..., Settings]) -> Iterator[Api]:
    """The API served for a fresh tenant (local storage), connected to its `/api/v1` with an admin key."""
    settings = make_settings("local")
    with Shoal(settings, notify=False) as shoal:
        key = create_key(shoal.engine, settings.tenant, "admin")[1]
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(serve_api(settings))
        http = stack.enter_context(
            httpx.Client(base_url=f"{url}/api/v1", headers={"Authorization": f"ApiKey {key}"}, timeout=60)
        )
        yield http, settings


def _create_and_fill(http: httpx.Client, settings: Settings, count: int) -> None:
    """Create dataset `st`, upload `count` vectors and build its index (no worker runs: built here)."""
    r = http.post("/datasets", json={"name": "st", "dimensions": 3, "metric_type": "euclidean", "index_type": "flat"})
    assert r.status_code == 201, r.text
    if count == 0:
        return
    vectors = [{"id": f"v{i}", "values": [float(i), 1.0, -float(i)]} for i in range(count)]
    r = http.post("/datasets/st/vectors", json={"vectors": vectors})
    assert r.status_code == 200, r.text
    with Shoal(settings, notify=False) as shoal:
        for shard in shoal.get_index("st", "1").shards:
            ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)


def _stats(http: httpx.Client) -> dict[str, Any]:
    r = http.get("/datasets/st/stats")
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _owned_files(settings: Settings) -> tuple[list[str], list[str]]:
    """(index files, log segments) the catalog's rows name for the live data source `st`."""
    with Shoal(settings, notify=False) as shoal, Session(shoal.engine) as s:
        source = s.scalars(
            select(DataSource.id)
            .join(Tenant, Tenant.id == DataSource.tenant_id)
            .where(Tenant.name == settings.tenant, DataSource.name == "st", DataSource.deleted_at.is_(None))
        ).one()
        index = s.scalars(
            select(IndexFile.path)
            .join(IndexVersion, IndexVersion.id == IndexFile.version_id)
            .join(IndexShard, IndexShard.id == IndexVersion.shard_id)
            .join(Index, Index.id == IndexShard.index_id)
            .where(Index.data_source_id == source)
        ).all()
        log = s.scalars(select(LogSegment.path).where(LogSegment.data_source_id == source)).all()
        return sorted(set(index)), sorted(log)


def _sizes(root: Path, paths: list[str]) -> tuple[int, int]:
    return sum((root / p).stat().st_size for p in paths), len(paths)


def _files_under(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


@pytest.mark.parametrize("hard", [False, True], ids=["trashed", "hard_deleted"])
def test_stats_of_a_recreated_dataset_count_only_its_own_files(open_api: Api, hard: bool) -> None:
    http, settings = open_api
    root = Path(str(settings.storage_uri))
    tenant = root / "tenants" / settings.tenant
    _create_and_fill(http, settings, 50)
    old = _stats(http)
    assert old["storage"]["index_files"] > 0 and old["storage"]["log_bytes"] > 0

    r = http.delete("/datasets/st", params={"hard": "true"} if hard else {})
    assert r.status_code == 200, r.text
    _create_and_fill(http, settings, 0)
    # The old dataset's files are still there (the trash keeps them; GC deletes them only after its grace)...
    assert _files_under(tenant / "indexes" / "st") == (old["storage"]["index_bytes"], old["storage"]["index_files"])
    empty = _stats(http)
    # ... but they are not the new, empty dataset's.
    assert empty["vector_count"] == 0
    assert {k: empty["storage"][k] for k in ("index_bytes", "index_files", "log_bytes")} == dict.fromkeys(
        ("index_bytes", "index_files", "log_bytes"), 0
    )
    assert empty["storage_size"] == empty["storage"]["metadata_bytes"]

    r = http.post("/datasets/st/vectors", json={"vectors": [{"id": "n1", "values": [1.0, 2.0, 3.0]}]})
    assert r.status_code == 200, r.text
    with Shoal(settings, notify=False) as shoal:
        for shard in shoal.get_index("st", "1").shards:
            ShardBuilder(shoal.engine, shoal.storage).materialize(shard.id)
    built = _stats(http)
    index_files, log_files = _owned_files(settings)
    assert index_files and log_files
    # Exactly the files the new dataset's catalog rows name, though the folders hold the old one's too.
    assert (built["storage"]["index_bytes"], built["storage"]["index_files"]) == _sizes(root, index_files)
    assert built["storage"]["log_bytes"] == _sizes(root, log_files)[0]
    on_disk = _files_under(tenant / "indexes" / "st")
    assert on_disk[1] == built["storage"]["index_files"] + old["storage"]["index_files"]
    assert built["vector_count"] == 1 and built["memory_usage_bytes"] == built["storage"]["index_bytes"]
    assert built["storage_size"] == sum(built["storage"][k] for k in ("log_bytes", "index_bytes", "metadata_bytes"))
