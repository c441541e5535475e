"""The `shoal` command line against a real Postgres: data sources, import, log, servers, settings.

Indexes, search, status, the worker and the demo are in test_cli_index.py.

The module runs on its own data directory (embedded Postgres and Valkey, stopped at the end) unless the
session names a catalog with SHOAL_DATABASE_URL (or SHOAL_TEST_DATABASE_URL); every test works in its own
tenant.
"""

from __future__ import annotations

import importlib
import json
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import module_cli_env
from typer.testing import CliRunner, Result

import shoal.api.serve
import shoal.servers.broker
from shoal import Shoal
from shoal.cli import app
from shoal.config.settings import mask_url
from shoal.demo import load_demo
from shoal.errors import ConfigurationError

runner = CliRunner()
DIM = 384
up_module = importlib.import_module("shoal.cli.up")  # `shoal.cli.up` is also the name of the command function


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """SHOAL_* variables for this module: a fresh data dir and storage; servers stopped at teardown."""
    with module_cli_env(tmp_path_factory, "cli") as data_dir:
        yield data_dir


@pytest.fixture
def tenant(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh tenant, set as SHOAL_TENANT for in-process and child-process calls."""
    name = "cli" + uuid.uuid4().hex[:12]
    monkeypatch.setenv("SHOAL_TENANT", name)
    return name


def shoal_cli(*args: str, code: int = 0, input: str | None = None) -> Result:
    """Run `shoal ARGS` in process; assert the exit code and that no traceback was printed."""
    result = runner.invoke(app, list(args), input=input)
    assert result.exit_code == code, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    assert "Traceback" not in result.output
    if code == 1:
        assert isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def create_packages(name: str) -> None:
    shoal_cli("source", "create", name, "1", "--dim", str(DIM), "--attr", "id:int64,package:string",
              "--attr", "section:string", "--permanent", "id")


def fold(name: str, version: str = "1") -> pa.Table:
    with Shoal() as client:
        return client.fold(name, version)


def head(name: str, version: str = "1") -> int:
    with Shoal() as client:
        return client.get_data_source(name, version).head_seq


# -- data sources ---------------------------------------------------------------------------------------


def test_source_create_get_list_drop(tenant: str) -> None:
    created = shoal_cli(
        "source", "create", "docs.v", "2.0", "--dim", "8", "--attr", "id:int64", "--attr", "title:string",
        "--attr", "at:datetime", "--permanent", "id", "--description", "test docs", "--metadata", '{"team": "x"}',
    )
    assert "created" in created.stdout and tenant in created.stdout

    got = json.loads(shoal_cli("source", "get", "docs.v", "2.0", "--json").stdout)
    assert got["tenant"] == tenant
    assert got["vector_dimension"] == 8 and got["vectors_are_sparse"] is False
    assert got["attribute_types"] == {"id": "int64", "title": "string", "at": "datetime"}
    assert got["permanent_attributes"] == ["id"]
    assert got["custom_metadata"] == {"team": "x"} and got["description"] == "test docs"
    assert got["head_seq"] == 0
    table = shoal_cli("source", "get", "docs.v", "2.0").stdout
    assert "docs.v/2.0" in table and "title: string" in table and "id: int64 (permanent)" in table

    shoal_cli("source", "create", "other", "1", "--dim", "3", "--attr", "k:guid", "--permanent", "k", "--sparse")
    listed = json.loads(shoal_cli("source", "list", "--json").stdout)
    assert [(r["name"], r["version"], r["vectors_are_sparse"]) for r in listed] == [
        ("docs.v", "2.0", False),
        ("other", "1", True),
    ]
    table = shoal_cli("source", "list").stdout
    assert "docs.v" in table and "other" in table and "k:guid" in table
    # Another tenant sees none of them (a tenant that does not exist is not found, and not created by a read).
    assert "not found" in shoal_cli("source", "list", "--tenant", tenant + "-b", code=1).stderr
    shoal_cli("tenant", "create", tenant + "-b")
    assert "No data sources" in shoal_cli("source", "list", "--tenant", tenant + "-b").stdout

    again = shoal_cli("source", "create", "docs.v", "2.0", "--dim", "8", "--attr", "id:int64", "--permanent", "id",
                      code=1)
    assert "already exists" in again.stderr
    same = shoal_cli("source", "create", "other", "1", "--dim", "3", "--attr", "k:guid", "--permanent", "k",
                     "--sparse", "--exist-ok")
    assert "exists already" in same.stdout

    refused = shoal_cli("source", "drop", "docs.v", "2.0", input="n\n", code=1)
    assert "Drop data source docs.v/2.0" in refused.output
    assert shoal_cli("source", "get", "docs.v", "2.0", "--json").exit_code == 0
    dropped = shoal_cli("source", "drop", "docs.v", "2.0", "--yes")
    assert "Dropped data source docs.v/2.0" in dropped.stdout
    missing = shoal_cli("source", "get", "docs.v", "2.0", code=1)
    assert missing.stdout == ""
    assert missing.stderr.startswith("error: ") and "not found" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


def test_invalid_input_is_one_line_and_exit_1(tenant: str) -> None:
    bad_name = shoal_cli("source", "create", "../x", "1", "--dim", "3", "--attr", "id:int64", "--permanent", "id",
                         code=1)
    assert "invalid data source name '../x'" in bad_name.stderr
    assert "must match ^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$" in bad_name.stderr
    assert len(bad_name.stderr.strip().splitlines()) == 1

    bad_type = shoal_cli("source", "create", "s", "1", "--dim", "3", "--attr", "id:integer", "--permanent", "id",
                         code=1)
    assert "allowed: bool, int64, float64, string, guid, datetime" in bad_type.stderr
    bad_key = shoal_cli("source", "create", "s", "1", "--dim", "3", "--attr", "id:int64", "--permanent", "name",
                        code=1)
    assert "'name'" in bad_key.stderr and "permanent attribute" in bad_key.stderr
    bad_dim = shoal_cli("source", "create", "s", "1", "--dim", "0", "--attr", "id:int64", "--permanent", "id", code=1)
    assert "vector dimension" in bad_dim.stderr
    bad_tenant = shoal_cli("source", "list", "--tenant", "Not/A/Tenant", code=1)
    assert "invalid tenant name" in bad_tenant.stderr
    # Malformed options are usage errors (Typer's exit code 2).
    shoal_cli("source", "create", "s", "1", "--dim", "3", "--attr", "id", "--permanent", "id", code=2)
    shoal_cli("source", "create", "s", "1", "--dim", "3", "--attr", "id:int64", "--permanent", "id",
              "--metadata", "[1]", code=2)
    # Nothing was created, not even the tenant (a reading command does not create it).
    assert "not found" in shoal_cli("source", "list", "--json", code=1).stderr


# -- import ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[np.ndarray, pa.Table, Path]:
    """The demo sample as float16 vectors and attributes, plus a folder for files made from it."""
    vectors, table = load_demo(1200)
    return vectors.astype(np.float16), table, tmp_path_factory.mktemp("files")


def test_import_parquet_with_extra_columns_is_idempotent(tenant: str, sample: tuple) -> None:
    vectors16, table, folder = sample
    path = folder / "packages.parquet"
    emb = pa.FixedSizeListArray.from_arrays(pa.array(vectors16.reshape(-1), pa.float16()), DIM)
    pq.write_table(table.append_column("emb", emb), path)  # extra columns: priority, version, description...
    create_packages("pk")

    first = shoal_cli("import", "pk", "1", str(path), "--vectors-column", "emb", "--batch-size", "500")
    assert "Imported 1,200 points" in first.stdout and "points/s" in first.stdout
    assert "Last write token: pk/1@1200" in first.stdout
    state = fold("pk")
    assert state.num_rows == 1200
    assert state["id"].to_pylist() == table["id"].to_pylist()
    assert state["package"].to_pylist() == table["package"].to_pylist()
    got = np.asarray(state["__vector"].combine_chunks().flatten().to_numpy(), dtype=np.float32).reshape(-1, DIM)
    np.testing.assert_array_equal(got, vectors16.astype(np.float32))

    again = shoal_cli("import", "pk", "1", str(path), "--vectors-column", "emb", "--batch-size", "500")
    assert "3 of 3 batches were imported before" in again.stdout
    assert "Imported 0 points" in again.stdout and "read 1,200" in again.stdout  # this run wrote nothing
    assert "Last write token: pk/1@1200" in again.stdout
    assert head("pk") == 1200

    # A variable-length list column, a smaller batch and a limit: new batch ids, last write wins.
    lists = pa.ListArray.from_arrays(pa.array(np.arange(0, 1201 * DIM, DIM, dtype=np.int32)),
                                     pa.array(vectors16.astype(np.float32).reshape(-1)))
    path2 = folder / "lists.parquet"
    pq.write_table(table.select(["id", "package", "section"]).append_column("vector", lists), path2)
    shoal_cli("import", "pk", "1", str(path2), "--limit", "250", "--batch-size", "100")
    assert head("pk") == 1450 and fold("pk").num_rows == 1200


def test_import_npy_with_attributes_file(tenant: str, sample: tuple) -> None:
    vectors16, table, folder = sample
    npy, attrs = folder / "vectors.npy", folder / "attrs.parquet"
    np.save(npy, vectors16)
    pq.write_table(table.rename_columns(["key" if c == "id" else c for c in table.column_names]), attrs)
    create_packages("np")

    missing = shoal_cli("import", "np", "1", str(npy), "--attributes", str(attrs), code=1)
    assert "no column for attribute(s) id" in missing.stderr and "--attr-map" in missing.stderr
    assert head("np") == 0

    args = ["import", "np", "1", str(npy), "--attributes", str(attrs), "--attr-map", "key=id", "--limit", "700",
            "--batch-size", "300"]
    done = shoal_cli(*args)
    assert "Imported 700 points from vectors.npy" in done.stdout
    state = fold("np")
    assert state["id"].to_pylist() == list(range(700))
    got = np.asarray(state["__vector"].combine_chunks().flatten().to_numpy(), dtype=np.float32).reshape(-1, DIM)
    np.testing.assert_array_equal(got, vectors16[:700].astype(np.float32))
    again = shoal_cli(*args)
    assert "were imported before" in again.stdout
    assert head("np") == 700

    shoal_cli("import", "np", "1", str(npy), code=2)  # a .npy file needs --attributes
    short = folder / "short.parquet"
    pq.write_table(table.slice(0, 10), short)
    mismatch = shoal_cli("import", "np", "1", str(npy), "--attributes", str(short), code=1)
    assert "row i must belong to vector i" in mismatch.stderr


def test_import_rejects_bad_rows_naming_the_file_row(tenant: str, sample: tuple) -> None:
    vectors16, table, folder = sample
    vectors = vectors16[:30].astype(np.float32)
    vectors[25, 3] = np.nan
    path = folder / "bad.parquet"
    emb = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), DIM)
    pq.write_table(table.slice(0, 30).append_column("vector", emb), path)
    create_packages("bad")
    result = shoal_cli("import", "bad", "1", str(path), "--batch-size", "10", code=1)
    assert "point 25" in result.stderr and "finite" in result.stderr
    assert "20 rows before row 20 were imported" in result.stderr
    assert head("bad") == 20


def test_log_takes_options_before_the_name(tenant: str, sample: tuple) -> None:
    vectors16, table, _ = sample
    create_packages("opt")
    with Shoal() as client:
        cols = {c: table[c].slice(0, 5) for c in ("id", "package", "section")}
        client.producer("opt", "1").upload_columns(vectors16[:5], cols)
    # Options before NAME were refused ("No such option"): only a first argument without "-" meant `show`.
    shown = shoal_cli("log", "--tenant", tenant, "opt", "1").stdout
    assert f"Log of opt/1 (tenant {tenant!r})" in shown and ".parquet" not in shown
    assert shoal_cli("log", "--segments", "opt", "1").stdout.count(".parquet") == 1
    assert "live points" in shoal_cli("log", "--show", "2", "--tenant", tenant, "opt", "1").stdout
    other = shoal_cli("log", "--tenant", tenant + "-b", "opt", "1", code=1)
    assert "not found" in other.stderr
    # Subcommands and the group's help are what they were.
    help_text = shoal_cli("log", "--help").stdout
    assert "compact" in help_text and "expire" in help_text and "show" in help_text
    assert "Compaction of opt/1" in shoal_cli("log", "compact", "opt", "1", "--tenant", tenant).stdout
    assert "nothing to expire" in shoal_cli("log", "expire", "--tenant", tenant, "opt", "1").stdout
    shoal_cli("log", "--no-such-option", "opt", "1", code=2)


def test_search_errors_speak_of_the_query(tenant: str, tmp_path: Path) -> None:
    shoal_cli("source", "create", "sq", "1", "--dim", "2", "--attr", "id:int64,lang:string", "--permanent", "id,lang")
    shoal_cli("index", "create", "sq.flat", "1", "--source", "sq", "--source-version", "1", "--metric", "euclidean",
              "--split-attr", "lang")
    # A split value of the wrong type said "invalid input, nothing written" on a read.
    line = one_error_line(shoal_cli("search", "sq.flat", "1", "--query", "0,1", "--split", "id=abc", code=1))
    assert line.startswith("error: invalid query: attribute 'id': 'abc' is not a int64 value"), line
    assert "nothing written" not in line
    # A complex query file was taken, its imaginary part dropped with a ComplexWarning.
    for name, array in (("cplx.npy", np.array([[1 + 2j, 3 + 0j]])), ("bools.npy", np.array([[True, False]]))):
        np.save(tmp_path / name, array)
        refused = shoal_cli("search", "sq.flat", "1", "--query-file", str(tmp_path / name), code=2)
        assert f"{name} must hold real numbers" in " ".join(refused.stderr.replace("│", " ").split())
    for array in (np.array([[1, 2]], dtype=np.int16), np.array([0.5, 1], dtype=np.float16)):
        np.save(tmp_path / "ok.npy", array)
        got = json.loads(shoal_cli("search", "sq.flat", "1", "--query-file", str(tmp_path / "ok.npy"),
                                   "--json").stdout)
        assert got == [{"query": 0, "hits": []}]


# -- log, servers, settings ---------------------------------------------------------------------------------


def test_log_shows_head_segments_and_state(tenant: str, sample: tuple) -> None:
    vectors16, table, _ = sample
    create_packages("lg")
    with Shoal() as client:
        producer = client.producer("lg", "1")
        cols = {c: table[c].slice(0, 50) for c in ("id", "package", "section")}
        producer.upload_columns(vectors16[:50], cols)
        producer.delete({"id": [0, 1]})
    text = shoal_cli("log", "lg", "1", "--segments", "--show", "3").stdout
    for expected in ("head seq", "52", "segments", "upserts", "tombstones", "live points", "48", "384-d"):
        assert expected in text
    assert text.count(".parquet") == 2
    assert "libhypre64-dev" not in text  # id 0 is deleted; the state starts at id 2
    plain = shoal_cli("log", "lg", "1").stdout
    assert "head seq" in plain and "live points" not in plain and ".parquet" not in plain


def test_server_status_and_settings(cli_env: Path, tenant: str) -> None:
    shoal_cli("tenant", "list")  # makes sure the catalog is up
    status = shoal_cli("server", "status").stdout
    assert "catalog" in status and "broker" in status and "storage" in status
    assert "running" in status or "reachable" in status
    shown = json.loads(shoal_cli("settings", "--json").stdout)
    assert shown["data_dir"] == str(cli_env) and shown["tenant"] == tenant
    assert "SHOAL_TENANT" in shoal_cli("settings").stdout
    secret = runner.invoke(app, ["settings", "--json"], env={"SHOAL_REDIS_URL": "redis://u:hunter2@host:6379/0",
                                                             "SHOAL_S3_SECRET_KEY": "hunter3"})
    assert secret.exit_code == 0 and "hunter2" not in secret.stdout and "hunter3" not in secret.stdout
    bad = runner.invoke(app, ["source", "list"], env={"SHOAL_MAX_BATCH_POINTS": "many"})
    assert bad.exit_code == 1 and "invalid settings: max_batch_points" in bad.stderr


def one_error_line(result: Result) -> str:
    """The one red line a failed command printed on stderr (no traceback, nothing on stdout)."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.stdout == ""
    return lines[0]


def test_config_file_named_but_missing_or_malformed(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A mistyped SHOAL_CONFIG was ignored: every command ran on the defaults (the embedded catalog).
    monkeypatch.setenv("SHOAL_CONFIG", "/nonexistent/shoal.toml")
    for args in (["settings"], ["source", "list"], ["migrate"]):
        line = one_error_line(shoal_cli(*args, code=1))
        assert "SHOAL_CONFIG" in line and "/nonexistent/shoal.toml" in line and "no such file" in line
    # A malformed file was a traceback on every command.
    bad = cli_env / "bad.toml"
    bad.write_text("database_url = [\n")
    monkeypatch.setenv("SHOAL_CONFIG", str(bad))
    for args in (["settings"], ["source", "list"]):
        line = one_error_line(shoal_cli(*args, code=1))
        assert str(bad) in line and "is not valid TOML: Invalid value" in line


def test_api_port_out_of_range_is_a_usage_error(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    served: list[dict] = []
    monkeypatch.setattr(shoal.api.serve, "serve", lambda app, **options: served.append(options))
    # 70000 listened on 70000 mod 65536 (4464) while saying 70000; -1 failed obscurely inside uvicorn.
    for port in ("70000", "65536", "0", "-1"):
        shoal_cli("api", "--port", port, "--workers", "2", code=2)
    assert served == []
    shoal_cli("api", "--port", "65535", "--workers", "2")
    assert [(o["host"], o["port"]) for o in served] == [("127.0.0.1", 65535)]


class _FakeProc:
    """Stands in for a child process of `shoal up` that never exits."""

    pid = 0

    def poll(self) -> int | None:
        return None


def test_up_refuses_anonymous_writes_beyond_loopback(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Keyless callers may write (whatever catalog the session uses): `shoal api` refuses 0.0.0.0 then.
    monkeypatch.setenv("SHOAL_ANONYMOUS_TENANT", "anon")
    monkeypatch.setenv("SHOAL_ANONYMOUS_ROLE", "write")
    monkeypatch.delenv("SHOAL_ALLOW_ANONYMOUS_WRITES", raising=False)

    def catalog_reached(_: object) -> None:
        raise ConfigurationError("the catalog check was reached")  # the first thing `up` starts

    monkeypatch.setattr(up_module, "check_catalog", catalog_reached)
    # It started the API child, which refused, and restarted it forever.
    line = one_error_line(shoal_cli("up", "--host", "0.0.0.0", "--port", "1", "--no-consumer", code=1))
    assert line.startswith("error: refusing to listen on 0.0.0.0") and "--allow-anonymous-writes" in line
    no_api = shoal_cli("up", "--no-api", "--host", "0.0.0.0", "--no-consumer", code=1)  # no API: nothing to refuse
    assert one_error_line(no_api) == "error: the catalog check was reached"

    # --allow-anonymous-writes (as `shoal api` has) lets it start, and reaches the API child's argv.
    started: list[list[str]] = []

    def start(argv: list[str], *_: object) -> _FakeProc:
        started.append(argv)
        return _FakeProc()

    def supervise(*_: object, **__: object) -> None:
        raise KeyboardInterrupt  # as Ctrl-C would, once everything started

    monkeypatch.setattr(up_module, "check_catalog", lambda _: None)
    monkeypatch.setattr(shoal.servers.broker, "broker_url", lambda _: "redis://127.0.0.1:1/0")
    monkeypatch.setattr(up_module, "check_broker", lambda _: None)
    monkeypatch.setattr(up_module, "start_worker_process", start)
    monkeypatch.setattr(up_module, "stop_worker_process", lambda *_: "stopped")
    monkeypatch.setattr(up_module, "_start", start)
    monkeypatch.setattr(up_module, "_supervise", supervise)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shoal_cli("up", "--host", "0.0.0.0", "--port", str(port), "--no-consumer", "--allow-anonymous-writes")
    api = [argv for argv in started if "api" in argv]
    assert len(api) == 1 and api[0][-5:] == ["--host", "0.0.0.0", "--port", str(port), "--allow-anonymous-writes"]


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this host")
def test_up_port_check_takes_ipv6_hosts() -> None:
    # An IPv6 host was bound with an IPv4 socket: "port N on ::1 is in use" for any free port.
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        port = s.getsockname()[1]
    assert not up_module._port_taken("::1", port)
    assert not up_module._port_taken("::", port)
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", port))
        s.listen()
        assert up_module._port_taken("::1", port)


def test_mask_url() -> None:
    assert mask_url("postgresql://u:pw@db.example:5432/shoal") == "postgresql://u:***@db.example:5432/shoal"
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    # A URL without a host keeps its `//` when its query is masked (it was shown as postgresql:/db?...).
    assert mask_url("postgresql:///db?host=/run/pg&password=x") == "postgresql:///db?host=/run/pg&password=***"
    assert mask_url("postgresql://u:p@h/db?password=s#f") == "postgresql://u:***@h/db?password=***#f"
