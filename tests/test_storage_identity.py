"""A storage belongs to one catalog: its root holds a marker naming the catalog's id (shoal.storage.identity).

The defect this guards against (session 23, workers item 1): a worker of deployment A started with deployment B's
storage by mistake started without complaint, and its garbage collection took every file of B for unreferenced
and deleted B's log. Each test uses real catalogs (the session's and fresh databases, migrated) and real storage
(a local directory, and S3 on a moto server where it matters).
"""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import new_database

from shoal import DataSourceSpec, Shoal
from shoal.catalog.db import migrate
from shoal.config.settings import Settings
from shoal.datasets.service import DatasetService
from shoal.errors import ConfigurationError
from shoal.storage import Storage, layout
from shoal.storage.identity import MARKER, catalog_id, ensure_storage_identity, read_marker
from shoal.upkeep.gc import collect_garbage

DIM = 4
SPEC = DataSourceSpec("docs", "1", DIM, {"id": "int64"}, ["id"])


@pytest.fixture
def other_db(pg_url: str) -> Iterator[str]:
    """A second new, empty database on the test server (besides `fresh_db`), dropped afterwards."""
    with new_database(pg_url) as url:
        yield url


def fill(shoal: Shoal) -> None:
    """A data source with ten points: one log segment."""
    shoal.create_data_source(SPEC)
    shoal.producer("docs", "1").upload_columns(np.ones((10, DIM), np.float32), {"id": np.arange(10)})


def files_of(storage: Storage) -> list[str]:
    """Every file of the tenants' folders (what GC could delete)."""
    return storage.list_files(layout.ROOT)


def marker_of(storage: Storage) -> dict[str, str]:
    return json.loads(storage.read(MARKER).to_pybytes())


@pytest.fixture
def deployments(
    make_settings: Callable[..., Settings], fresh_db: str, other_db: str, storage_kind: str
) -> Iterator[tuple[Shoal, Shoal]]:
    """Deployments A and B as the defect's repro has them: each its own catalog and storage, the same tenant name
    in both, a data source with data in each."""
    migrate(fresh_db)
    migrate(other_db)
    a_settings = make_settings(storage_kind, database_url=fresh_db)
    b_settings = make_settings(storage_kind, database_url=other_db, tenant=a_settings.tenant)
    if storage_kind == "local":  # make_settings gives every local Settings of a test the same root
        b_settings = b_settings.model_copy(update={"storage_uri": f"{b_settings.storage_uri}-b"})
    a, b = Shoal(a_settings, notify=False), Shoal(b_settings, notify=False)
    try:
        fill(a)
        fill(b)
        yield a, b
    finally:
        a.close()
        b.close()


def on_storage_of(shoal: Shoal, other: Shoal) -> Settings:
    """`shoal`'s settings with `other`'s storage: SHOAL_STORAGE_URI set to another deployment's by mistake."""
    return shoal.settings.model_copy(update={"storage_uri": other.settings.storage_uri})


def test_a_process_on_another_catalogs_storage_is_refused_at_start_and_its_gc_deletes_nothing(
    deployments: tuple[Shoal, Shoal], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The defect's scenario: A's processes started with B's storage. `Shoal()`, a worker's task and `shoal worker`
    are refused in one line naming the storage and both catalogs; GC with A's catalog on B's storage deletes
    nothing and says why; B's data reads as before."""
    from conftest import use_settings_env

    from shoal.workers import tasks
    from shoal.workers.base import ShoalTask

    a, b = deployments
    a_id, b_id = catalog_id(a.engine), catalog_id(b.engine)
    assert a_id != b_id
    wrong = on_storage_of(a, b)
    b_files = files_of(b.storage)
    assert b_files

    refusal = f"belongs to another catalog: its {MARKER} names catalog {b_id}, but catalog"
    with pytest.raises(ConfigurationError, match="check SHOAL_STORAGE_URI and SHOAL_DATABASE_URL") as refused:
        Shoal(wrong, notify=False)
    assert refusal in str(refused.value) and a_id in str(refused.value) and "\n" not in str(refused.value)
    assert b.settings.storage_uri in str(refused.value)

    # A worker's task (its process's runtime is made by the first task): the GC task refuses, deleting nothing.
    use_settings_env(monkeypatch, wrong)
    ShoalTask.reset_context()
    try:
        with pytest.raises(ConfigurationError, match=refusal):
            tasks.collect_garbage()
    finally:
        ShoalTask.reset_context()

    # GC itself, given A's catalog and B's storage (as if the storage were swapped under a running worker), with
    # no grace: nothing scanned, nothing deleted, and an error saying why.
    with pytest.raises(ConfigurationError, match=f"garbage collection deleted nothing: .* belongs to another "
                                                  f"catalog \\(its {MARKER} names {b_id}, this catalog is {a_id}\\)"):
        collect_garbage(a.engine, b.storage, grace_s=0, now=dt.datetime.now(dt.UTC) + dt.timedelta(days=1))
    assert files_of(b.storage) == b_files
    assert b.fold("docs", "1").num_rows == 10

    # `shoal worker` refuses before it starts Celery (the broker is never reached: port 1).
    done = subprocess.run([sys.executable, "-m", "shoal.cli", "worker", "--no-beat"], env=wrong.child_env(),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 1 and len(lines) == 1, (done.returncode, lines)
    assert lines[0].startswith("error: ") and refusal in lines[0] and a_id in lines[0], lines
    assert files_of(b.storage) == b_files
    assert marker_of(a.storage)["catalog_id"] == a_id and marker_of(b.storage)["catalog_id"] == b_id


def test_gc_deletes_nothing_once_the_marker_is_gone_and_a_restart_writes_it_again(
    make_settings: Callable[..., Settings],
) -> None:
    """The marker removed under a running process (or the storage swapped for an empty one): GC deletes nothing,
    even a stray file past its grace, and says why. A process started on the storage writes the marker again
    (the storage holds files this catalog references), and GC works again."""
    settings = make_settings("local", gc_grace_s=0)
    with Shoal(settings, notify=False) as shoal:
        fill(shoal)
        stray = layout.segment_path(shoal.tenant, "docs", "1", 99, uuid.uuid4())
        shoal.storage.write_atomic(stray, pa.py_buffer(b"left by a crashed commit"))
        later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
        shoal.storage.delete_quietly(MARKER)
        with pytest.raises(ConfigurationError, match=f"garbage collection deleted nothing: storage .* holds no "
                                                      f"{MARKER}"):
            collect_garbage(shoal.engine, shoal.storage, grace_s=0, now=later)
        assert shoal.storage.exists(stray)
        with Shoal(settings, notify=False) as restarted:
            assert marker_of(restarted.storage)["catalog_id"] == catalog_id(restarted.engine)
        result = collect_garbage(shoal.engine, shoal.storage, grace_s=0, now=later)
        assert result.queued == 1 and result.deleted == 1 and not shoal.storage.exists(stray)
        assert shoal.fold("docs", "1").num_rows == 10


def test_the_marker_is_written_on_first_use_and_one_catalog_may_use_many_roots(
    make_settings: Callable[..., Settings], storage_kind: str
) -> None:
    """The first process on a storage writes the marker (local and S3); the catalog's next processes open it;
    another root of the same catalog gets a marker naming the same catalog (tests share one catalog so)."""
    first = make_settings(storage_kind)
    with Shoal(first, notify=False) as shoal:
        mine = shoal.runtime.catalog_id
        assert mine == catalog_id(shoal.engine)
        written = marker_of(shoal.storage)
        assert written["catalog_id"] == mine and dt.datetime.fromisoformat(written["written_at"])
        fill(shoal)
    with Shoal(first, notify=False) as again:
        assert again.fold("docs", "1").num_rows == 10
        assert marker_of(again.storage) == written  # read, not rewritten
    second = make_settings(storage_kind)
    if storage_kind == "local":
        second = second.model_copy(update={"storage_uri": f"{second.storage_uri}-second"})
    with Shoal(second, notify=False) as other_root:
        assert other_root.runtime.catalog_id == mine and marker_of(other_root.storage)["catalog_id"] == mine


def test_a_storage_with_data_but_no_marker_is_claimed_only_by_its_own_catalog(
    deployments: tuple[Shoal, Shoal],
) -> None:
    """B's storage as a Shoal before markers left it (B's data, no marker): A's process is refused (it would have
    claimed it, and its GC deleted B's data); B's own process, whose files are there, writes B's marker."""
    a, b = deployments
    b.storage.fs.delete_file(b.storage.path(MARKER))
    b_files = files_of(b.storage)
    with pytest.raises(ConfigurationError, match=f"holds files but no {MARKER}, and none of the files catalog .* "
                                                  f"\\(id {a.runtime.catalog_id}\\) references"):
        Shoal(on_storage_of(a, b), notify=False)
    assert read_marker(b.storage) is None and files_of(b.storage) == b_files
    with Shoal(b.settings, notify=False) as upgraded:
        assert marker_of(upgraded.storage)["catalog_id"] == b.runtime.catalog_id
        assert upgraded.fold("docs", "1").num_rows == 10


def test_processes_starting_at_once_on_a_new_storage_agree(make_settings: Callable[..., Settings]) -> None:
    """Eight processes of one catalog opening a new storage at once all open it, and one marker is there."""
    with Shoal(make_settings("local"), notify=False) as shoal:
        root = f"{shoal.settings.storage_uri}-new"
        settings = shoal.settings.model_copy(update={"storage_uri": root})
        storages = [Storage.from_settings(settings) for _ in range(8)]
        with ThreadPoolExecutor(8) as pool:
            ids = list(pool.map(lambda s: ensure_storage_identity(shoal.engine, s, settings), storages))
        assert set(ids) == {shoal.runtime.catalog_id}
        assert sorted(p.name for p in Path(root).iterdir()) == [MARKER]  # no temp file left


def test_a_marker_that_is_not_one_is_refused_naming_it(make_settings: Callable[..., Settings]) -> None:
    settings = make_settings("local")
    Path(settings.storage_uri or "").mkdir(parents=True)
    (Path(settings.storage_uri or "") / MARKER).write_text("{not json")
    with pytest.raises(ConfigurationError, match=f"{MARKER} is not a catalog marker"):
        Shoal(settings, notify=False)


@pytest.mark.parametrize("content", ["old segments, newer empty sources", "a dataset without vectors"])
def test_a_storage_without_marker_holding_this_catalogs_files_is_claimed(
    make_settings: Callable[..., Settings], content: str
) -> None:
    """The first start after the upgrade (no marker yet) refused a deployment's own storage as another's when
    its newest data sources were still empty, or when all it held was a dataset's metadata mirror: the sample
    of referenced files missed older segments and mirrors."""
    settings = make_settings("local")
    with Shoal(settings, notify=False) as shoal:
        if content == "a dataset without vectors":
            searcher = shoal.searcher(follow=False)
            try:
                DatasetService(shoal, searcher).create("ds", DIM)
            finally:
                searcher.close()
        else:
            fill(shoal)
            for i in range(25):
                shoal.create_data_source(DataSourceSpec(f"empty{i}", "1", DIM, {"id": "int64"}, ["id"]))
        storage = Storage.from_settings(settings)
        assert storage.list_files(layout.ROOT)  # what the storage holds besides the marker
    (Path(storage.root) / MARKER).unlink()
    with Shoal(settings, notify=False):  # claimed: the marker written again
        assert read_marker(storage) is not None


def test_a_database_url_password_given_as_a_query_parameter_is_masked() -> None:
    from shoal.config.settings import mask_url

    shown = mask_url("postgresql://shoal@127.0.0.1:1/shoal?sslmode=require&password=s3cretPW")
    assert "s3cretPW" not in shown and shown.endswith("sslmode=require&password=***")
