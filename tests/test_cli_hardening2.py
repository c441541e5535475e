"""The `shoal` command line refuses what it used to accept or crash on: a write token of another data source, a
batch id reused by a rewritten file, long file names sharing batch ids, a malformed SHOAL_DATABASE_URL, a broken
storage or placement at `shoal worker` / `shoal up` start, an unreachable broker in `shoal demo`, an endless
`status --watch`, sparse query files of the wrong width, conflicting `--attr-map` entries, a mistyped `--tenant`
on commands that only read, and a `--split` value with a comma.

The module runs on its own data directory (embedded Postgres and Valkey, stopped at the end) unless the
session names a catalog with SHOAL_TEST_DATABASE_URL; every test works in its own tenant.
"""

from __future__ import annotations

import importlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import kombu.exceptions
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from conftest import module_cli_env
from typer.testing import CliRunner, Result

from shoal import DataPoint, Shoal, SparseVector
from shoal.catalog.db import resolve_database_url
from shoal.cli import app
from shoal.cli.common import load_settings, reporting_errors
from shoal.config.settings import Settings
from shoal.errors import BatchIdReusedError, ConfigurationError, ValidationError
from shoal.intake.bulk import plan_import, run_import

runner = CliRunner()
up_module = importlib.import_module("shoal.cli.up")  # `shoal.cli.up` is also the name of the command function
worker_module = importlib.import_module("shoal.cli.worker")


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """SHOAL_* variables for this module: a fresh data dir and storage; servers stopped at teardown."""
    with module_cli_env(tmp_path_factory, "cli-hardening2") as data_dir:
        yield data_dir


@pytest.fixture
def tenant(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh tenant, set as SHOAL_TENANT for in-process calls."""
    name = "h2" + uuid.uuid4().hex[:12]
    monkeypatch.setenv("SHOAL_TENANT", name)
    return name


def shoal_cli(*args: str, code: int = 0, env: dict[str, str] | None = None) -> Result:
    """Run `shoal ARGS` in process; assert the exit code and that no traceback was printed."""
    result = runner.invoke(app, list(args), env=env)
    assert result.exit_code == code, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    assert "Traceback" not in result.output
    if code in (1, 2):
        assert isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def one_error_line(result: Result) -> str:
    """The one red line a failed command printed on stderr (no traceback, nothing on stdout)."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.stdout == ""
    return lines[0]


def usage_error(result: Result) -> str:
    """The text of a usage error (exit 2) with its box drawing removed."""
    return " ".join(result.stderr.replace("│", " ").split())


def head(name: str, version: str = "1") -> int:
    with Shoal(notify=False) as client:
        return client.get_data_source(name, version).head_seq


def ids_of(name: str, version: str = "1") -> list[int]:
    with Shoal(notify=False) as client:
        return sorted(client.fold(name, version)["id"].to_pylist())


# -- search -----------------------------------------------------------------------------------------------


def test_search_refuses_a_write_token_of_another_data_source(tenant: str) -> None:
    for source in ("Src.A", "Src.B"):
        shoal_cli("source", "create", source, "1", "--dim", "2", "--attr", "id:int64", "--permanent", "id")
        with Shoal(notify=False) as client:
            client.producer(source, "1").upload_columns(np.eye(2, dtype=np.float32), {"id": [1, 2]})
    shoal_cli("index", "create", "Idx.A", "1", "--source", "Src.A", "--source-version", "1")
    # Src.B's token was taken as seq 2 of Src.A's log (the Python API refuses it).
    line = one_error_line(shoal_cli("search", "Idx.A", "1", "-q", "0,1", "--consistency", "at_least:Src.B/1@2",
                                    code=1))
    assert "write token of data source Src.B/1" in line and "Idx.A/1" in line, line
    line = one_error_line(shoal_cli("search", "Idx.A", "1", "-q", "0,1", "--consistency", "at_least:Src.A/2@2",
                                    code=1))
    assert "write token of data source Src.A/2" in line, line
    # Its own data source's token, and a bare seq, still work.
    for level in ("at_least:Src.A/1@2", "at_least:2"):
        hits = json.loads(shoal_cli("search", "Idx.A", "1", "-q", "0,1", "--consistency", level, "--json").stdout)
        assert [h["attributes"]["id"] for h in hits[0]["hits"]] == [2, 1]
    for bad in ("at_least:Src.A@2", "at_least:/1@2", "at_least:Src.A/1@x"):
        assert "--consistency" in usage_error(shoal_cli("search", "Idx.A", "1", "-q", "0,1", "--consistency", bad,
                                                        code=2))


def test_sparse_query_file_of_another_width_is_refused(tenant: str, tmp_path: Path) -> None:
    shoal_cli("source", "create", "sp", "1", "--dim", "100", "--sparse", "--attr", "id:int64", "--permanent", "id")
    shoal_cli("index", "create", "sp.flat", "1", "--source", "sp", "--source-version", "1", "--algorithm",
              "flat_sparse", "--metric", "euclidean")
    with Shoal(notify=False) as client:
        client.producer("sp", "1").upload([DataPoint({"id": 1}, SparseVector([1], [1.0]))])
    # A [3] row was searched as if it were a 100-d vector; a dense index refuses such a file.
    np.save(tmp_path / "q3.npy", np.array([0.0, 1.0, 0.0]))
    line = one_error_line(shoal_cli("search", "sp.flat", "1", "--query-file", str(tmp_path / "q3.npy"),
                                    "--consistency", "strong", code=1))
    assert "wrong query dimension: expected 100, got 3" in line, line
    row = np.zeros(100)
    row[1] = 1.0
    np.save(tmp_path / "q100.npy", row)
    hits = json.loads(shoal_cli("search", "sp.flat", "1", "--query-file", str(tmp_path / "q100.npy"),
                                "--consistency", "strong", "--json").stdout)
    assert [h["attributes"]["id"] for h in hits[0]["hits"]] == [1]


def test_split_value_may_hold_a_comma(tenant: str) -> None:
    shoal_cli("source", "create", "geo", "1", "--dim", "2", "--attr", "id:int64,region:string", "--permanent",
              "id,region")
    shoal_cli("index", "create", "geo.flat", "1", "--source", "geo", "--source-version", "1", "--split-attr",
              "region")
    with Shoal(notify=False) as client:
        client.producer("geo", "1").upload_columns(
            np.array([[0, 1], [1, 0], [1, 1]], np.float32), {"id": [1, 2, 3], "region": ["eu,west", "eu", "us"]})
    # "region=eu,west" was read as region=eu plus a malformed item "west".
    hits = json.loads(shoal_cli("search", "geo.flat", "1", "-q", "0,1", "--split", "region=eu,west",
                                "--consistency", "strong", "--json").stdout)
    assert [h["attributes"]["id"] for h in hits[0]["hits"]] == [1]
    hits = json.loads(shoal_cli("search", "geo.flat", "1", "-q", "0,1", "--split", "region=eu",
                                "--consistency", "strong", "--json").stdout)
    assert [h["attributes"]["id"] for h in hits[0]["hits"]] == [2]


# -- import -----------------------------------------------------------------------------------------------


def test_import_of_a_rewritten_file_says_its_batch_ids_were_used(tenant: str, tmp_path: Path) -> None:
    npy, attrs = tmp_path / "emb.npy", tmp_path / "ids.parquet"
    np.save(npy, np.array([[0, 1], [1, 0]], np.float32))
    pq.write_table(pa.table({"id": [1, 2]}), attrs)
    shoal_cli("source", "create", "E", "1", "--dim", "2", "--attr", "id:int64", "--permanent", "id")
    shoal_cli("import", "E", "1", str(npy), "--attributes", str(attrs))
    np.save(npy, np.array([[5, 5], [6, 6]], np.float32))  # regenerated: same name and size, other vectors
    # It crashed with a TypeError traceback in _at_file_row.
    result = shoal_cli("import", "E", "1", str(npy), "--attributes", str(attrs), code=1)
    line = result.stderr.strip().splitlines()[-1]  # after the progress bar
    assert "emb.npy, batch at row 0" in line and "was already used for another batch" in line, line
    assert "--batch-prefix" in line
    assert head("E") == 2
    # The Python API keeps the error's class and batch id.
    with Shoal(notify=False) as client:
        producer = client.producer("E", "1")
        plan = plan_import(producer.spec, npy, attributes=attrs)
        with pytest.raises(BatchIdReusedError) as caught:
            run_import(producer, plan)
    assert caught.value.batch_id == plan.batch_id(0, 2)
    # Its own prefix imports it.
    shoal_cli("import", "E", "1", str(npy), "--attributes", str(attrs), "--batch-prefix", "regenerated")
    assert head("E") == 4


def test_long_file_names_that_differ_at_the_end_get_their_own_batch_ids(tenant: str, tmp_path: Path) -> None:
    base = "crawl_2024_11_embeddings_multilingual_minilm_l12_v2_documents_part_"  # 68 characters
    files = []
    for part, ids in (("0001", [1, 2, 3]), ("0002", [4, 5, 6])):
        path = tmp_path / f"{base}{part}.parquet"
        pq.write_table(pa.table({"id": ids, "vector": np.eye(3, 2, dtype=np.float32).tolist()}), path)
        files.append(path)
    assert files[0].stat().st_size == files[1].stat().st_size
    shoal_cli("source", "create", "L", "1", "--dim", "2", "--attr", "id:int64", "--permanent", "id")
    for path in files:
        assert "Imported 3 points" in shoal_cli("import", "L", "1", str(path)).stdout
    # The second file was skipped as "imported before": both names were cut to the same 60 characters.
    assert ids_of("L") == [1, 2, 3, 4, 5, 6]
    again = shoal_cli("import", "L", "1", str(files[1])).stdout
    assert "were imported before" in again and head("L") == 6


def test_conflicting_attr_map_entries_are_refused(tenant: str, tmp_path: Path) -> None:
    path = tmp_path / "two_keys.parquet"
    pq.write_table(pa.table({"key1": [1, 2], "key2": [100, 200], "vector": [[0.0, 1.0], [1.0, 0.0]]}), path)
    shoal_cli("source", "create", "M", "1", "--dim", "2", "--attr", "id:int64,other:int64", "--permanent", "id")
    # One of the two entries was dropped without a word.
    same_attribute = shoal_cli("import", "M", "1", str(path), "--attr-map", "key1=id", "--attr-map", "key2=id",
                               "--attr-map", "key2=other", code=2)
    assert "attribute 'id' is mapped from two columns (key1=id, key2=id)" in usage_error(same_attribute)
    same_column = shoal_cli("import", "M", "1", str(path), "--attr-map", "key1=id,key1=other", code=2)
    assert "column 'key1' is mapped twice (key1=id, key1=other)" in usage_error(same_column)
    assert head("M") == 0
    with Shoal(notify=False) as client, pytest.raises(ValidationError, match="'id' is mapped from column 'key1'"):
        plan_import(client.get_data_source("M", "1").spec, path, attr_map={"key1": "id", "key2": "id"})
    shoal_cli("import", "M", "1", str(path), "--attr-map", "key1=id", "--attr-map", "key2=other")
    assert ids_of("M") == [1, 2]


# -- settings and startup -----------------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["notaurl", "postgresql://h:notaport/db", "mysql://u@h/db", "sqlite:///x.db",
                                 "postgresql+psycopg2://u@h/db", "postgresql://u:hunter2@h:99999/db"])
def test_a_malformed_database_url_is_one_line_naming_the_setting(cli_env: Path, url: str) -> None:
    # Every command ended in a SQLAlchemy traceback (ArgumentError, ValueError, NoSuchModuleError).
    for args in (["source", "list"], ["tenant", "list"], ["migrate"], ["server", "status"]):
        line = one_error_line(shoal_cli(*args, code=1, env={"SHOAL_DATABASE_URL": url}))
        assert line.startswith("error: invalid settings: database_url:") and "SHOAL_DATABASE_URL" in line, line
        assert "hunter2" not in line


def test_a_malformed_database_url_is_refused_at_startup(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_DATABASE_URL", "postgresql://shoal:hunter2@db:5432x/shoal")
    with pytest.raises(ConfigurationError) as caught:
        load_settings()
    message = str(caught.value)
    assert message.startswith("invalid settings: database_url: ") and "SHOAL_DATABASE_URL" in message, message
    assert "port is not a number" in message and "hunter2" not in message and "\n" not in message
    # Settings made by model_copy skip validators: the catalog's URL resolution checks it again.
    monkeypatch.delenv("SHOAL_DATABASE_URL")
    copied = Settings().model_copy(update={"database_url": "mysql://u@h/db"})
    with pytest.raises(ConfigurationError, match="SHOAL_DATABASE_URL 'mysql://u@h/db' has scheme 'mysql'"):
        resolve_database_url(copied)


def test_well_formed_database_urls_are_accepted(cli_env: Path) -> None:
    for url in ("postgresql://u:p@db.example:5432/shoal", "postgres://u@db/shoal", "postgresql+psycopg://u@/shoal"
                "?host=/tmp", "postgresql://u:p@[::1]:5432/shoal"):
        assert Settings(database_url=url).database_url == url
    assert Settings(database_url=None).database_url is None  # the embedded default


def _catalog_reached(_: object) -> None:
    raise ConfigurationError("the catalog check was reached")  # the first thing that starts a server


def test_worker_and_up_check_the_storage_before_starting(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_module, "check_catalog", _catalog_reached)
    monkeypatch.setattr(up_module, "check_catalog", _catalog_reached)
    not_a_dir = cli_env / "a-file"
    not_a_dir.write_text("not a directory")
    monkeypatch.setenv("SHOAL_STORAGE_URI", str(not_a_dir))
    # The worker started and failed every task; `shoal up` started children that did.
    expected = f"error: SHOAL_STORAGE_URI: cannot use {not_a_dir} as the storage directory: it is not a directory"
    assert one_error_line(shoal_cli("worker", "--pool", "solo", code=1)) == expected
    assert one_error_line(shoal_cli("up", "--no-api", "--no-consumer", code=1)) == expected
    # The consumer requeued every message about once a second, for ever.
    assert one_error_line(shoal_cli("consume", code=1)) == expected


def test_up_checks_the_placement_when_it_serves_the_api(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up_module, "check_catalog", _catalog_reached)
    # The API child refused the placement at its start, and was restarted forever.
    monkeypatch.setenv("SHOAL_PLACEMENT_FILE", "/nonexistent/placement.yaml")
    line = one_error_line(shoal_cli("up", "--no-consumer", "--port", "1", code=1))
    assert line == "error: cannot read the placement file /nonexistent/placement.yaml: No such file or directory"
    monkeypatch.delenv("SHOAL_PLACEMENT_FILE")
    monkeypatch.setenv("SHOAL_NODE", "node-1")
    line = one_error_line(shoal_cli("up", "--no-consumer", "--port", "1", code=1))
    assert "SHOAL_NODE is set but SHOAL_PLACEMENT_FILE is not" in line
    # Without the API no placement is read.
    line = one_error_line(shoal_cli("up", "--no-api", "--no-consumer", code=1))
    assert line == "error: the catalog check was reached"


def test_demo_refuses_an_unreachable_broker_in_one_line(tenant: str) -> None:
    # It imported the sample, then ended in a kombu traceback when it published the deletions.
    result = shoal_cli("demo", "--points", "10", code=1, env={"SHOAL_REDIS_URL": "redis://127.0.0.1:1/0"})
    assert "cannot reach the broker at redis://127.0.0.1:1/0" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: cannot reach the broker")
    with Shoal(notify=False) as client:
        assert client.list_data_sources() == []  # refused before anything was written


def test_a_lost_broker_connection_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    # What a publish (kombu) raises when the broker goes away after the check: it was a traceback.
    @reporting_errors
    def publish() -> None:
        raise kombu.exceptions.OperationalError("Error 111 connecting to 127.0.0.1:1. Connection refused.")

    with pytest.raises(typer.Exit) as caught:
        publish()
    assert caught.value.exit_code == 1
    assert capsys.readouterr().err.strip() == (
        "error: cannot reach the broker: Error 111 connecting to 127.0.0.1:1. Connection refused.")


def test_status_watch_is_bounded(tenant: str) -> None:
    # inf and 1e300 printed one table, then an OverflowError traceback from time.sleep.
    for value in ("inf", "1e300", "nan", "86401"):
        assert "--watch" in usage_error(shoal_cli("status", "--watch", value, code=2))


# -- tenants ----------------------------------------------------------------------------------------------


def test_reading_commands_do_not_create_a_mistyped_tenant(tenant: str) -> None:
    shoal_cli("source", "create", "T", "1", "--dim", "2", "--attr", "id:int64", "--permanent", "id")
    shoal_cli("index", "create", "T.flat", "1", "--source", "T", "--source-version", "1")
    typo = tenant + "x"
    for args in (["source", "list"], ["source", "get", "T", "1"], ["source", "drop", "T", "1", "--yes"],
                 ["index", "list"], ["index", "get", "T.flat", "1"], ["status"], ["search", "T.flat", "1", "-q", "0,1"],
                 ["index", "create", "T.hnsw", "1", "--source", "T", "--source-version", "1"],
                 # Commands that work on what must exist: they created the mistyped tenant too.
                 ["alias", "list"], ["alias", "get", "a"], ["alias", "set", "a", "T.flat", "1"], ["alias", "drop", "a"],
                 ["trash", "list"], ["reindex", "T.flat", "1", "--status"], ["rollback", "T.flat", "1"],
                 ["log", "compact", "T", "1"], ["log", "expire", "T", "1"], ["gc"]):
        line = one_error_line(shoal_cli(*args, "--tenant", typo, code=1))
        assert line == f"error: tenant '{typo}' not found (`shoal tenant list` shows the tenants)", line
    tenants = [t["name"] for t in json.loads(shoal_cli("tenant", "list", "--json").stdout)]
    assert tenant in tenants and typo not in tenants
    assert "created" in shoal_cli("tenant", "create", typo).stdout  # it was refused as existing already
    assert "No data sources" in shoal_cli("source", "list", "--tenant", typo).stdout
    assert [s["name"] for s in json.loads(shoal_cli("source", "list", "--json").stdout)] == ["T"]  # untouched
    # The default tenant needs no creating: a fresh install lists nothing rather than failing.
    assert shoal_cli("status", "--tenant", "default").exit_code == 0
