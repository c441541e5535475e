"""What an operator meets when a setting or an option is wrong: one line, never a traceback.

A SHOAL_DATA_DIR that cannot be a folder, `shoal log --show` past any row count, a misspelt SHOAL_* variable,
and `shoal status` keeping its warnings off stdout. On the module's own data directory (embedded servers,
stopped at the end) unless the session names a catalog (SHOAL_TEST_DATABASE_URL); each test has its own tenant.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import typer
from conftest import module_cli_env
from typer.testing import CliRunner, Result

from shoal import DataSourceSpec, Shoal
from shoal.cli import app
from shoal.cli.common import load_settings, reporting_errors, unknown_variables
from shoal.errors import ConfigurationError
from shoal.log.records import IndexSpec
from shoal.servers.embedded import ensure_postgres, ensure_valkey

runner = CliRunner()
DIM = 4


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """SHOAL_* variables for this module: a fresh data dir and storage; servers stopped at teardown."""
    with module_cli_env(tmp_path_factory, "operr") as data_dir:
        yield data_dir


@pytest.fixture
def tenant(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh tenant, set as SHOAL_TENANT."""
    name = "op" + uuid.uuid4().hex[:12]
    monkeypatch.setenv("SHOAL_TENANT", name)
    return name


def shoal_cli(*args: str, code: int = 0) -> Result:
    """Run `shoal ARGS` in process; assert the exit code and that no traceback was printed."""
    result = runner.invoke(app, list(args))
    assert result.exit_code == code, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    assert "Traceback" not in result.output
    if code:
        assert isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def _source_with_points(name: str, count: int = 3) -> int:
    """A data source `name`/1 holding `count` points (no trigger queued); its head seq."""
    with Shoal(notify=False) as client:
        client.create_data_source(DataSourceSpec(name, "1", DIM, {"id": "int64"}, ["id"]))
        vectors = np.ones((count, DIM), dtype=np.float32)
        return client.producer(name, "1").upload_columns(vectors, {"id": np.arange(count)}).seq


# -- 2: SHOAL_DATA_DIR that cannot be a folder ------------------------------------------------------------


@pytest.mark.parametrize("command", [["server", "start"], ["source", "list"], ["status"]])
def test_a_data_dir_that_is_a_file_is_one_line_naming_it(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    in_the_way = tmp_path / "afile"
    in_the_way.write_text("x")
    for key in ("SHOAL_DATABASE_URL", "SHOAL_REDIS_URL", "SHOAL_STORAGE_URI"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SHOAL_DATA_DIR", str(in_the_way))
    monkeypatch.chdir(tmp_path)  # no stray ./shoal.toml
    result = shoal_cli(*command, code=1)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("error: SHOAL_DATA_DIR: cannot create the folder"), result.stderr
    assert str(in_the_way) in result.stderr and "a file, not a folder" in result.stderr


def test_embedded_servers_under_a_file_are_a_configuration_error(tmp_path: Path) -> None:
    """The worker's path with SHOAL_DATABASE_URL set: only the embedded Valkey is started (it used to end in
    NotADirectoryError .../valkey)."""
    in_the_way = tmp_path / "afile"
    in_the_way.write_text("x")
    with pytest.raises(ConfigurationError, match=r"SHOAL_DATA_DIR: cannot create the folder .*Not a directory"):
        ensure_valkey(in_the_way)
    with pytest.raises(ConfigurationError, match=r"SHOAL_DATA_DIR: .*a file, not a folder"):
        ensure_postgres(in_the_way)


def test_an_os_error_about_a_path_is_one_line_and_others_are_not_hidden() -> None:
    @reporting_errors
    def denied() -> None:
        raise PermissionError(13, "Permission denied", "/srv/shoal/x")

    @reporting_errors
    def a_bug() -> None:
        raise PermissionError("no path: a bug, whose traceback is wanted")

    with pytest.raises(typer.Exit) as exit_info:
        denied()
    assert exit_info.value.exit_code == 1
    with pytest.raises(PermissionError, match="no path"):
        a_bug()


# -- 3: `shoal log --show` past any row count --------------------------------------------------------------


def test_log_show_more_than_any_row_count_prints_every_row(tenant: str) -> None:
    _source_with_points("many", 3)
    result = shoal_cli("log", "many", "1", "--show", "100000000000000000000")
    assert "first 3 of 3 live points" in " ".join(result.stdout.split()), result.stdout  # the title may wrap


# -- 4: misspelt SHOAL_* variables -------------------------------------------------------------------------


def test_a_misspelt_variable_is_warned_about_once_with_the_nearest_name(
    cli_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tag = uuid.uuid4().hex[:6].upper()  # a name of this test's own: warnings are once per process
    monkeypatch.setenv(f"SHOAL_DATABSE_URL{tag}", "postgresql://u:p@db.example:5432/prod")
    monkeypatch.setenv(f"SHOAL_UNRELATED_{tag}", "1")
    load_settings()
    load_settings()
    warned = capsys.readouterr().err
    assert warned.count(f"SHOAL_DATABSE_URL{tag} is no setting; did you mean SHOAL_DATABASE_URL?") == 1, warned
    assert warned.count(f"SHOAL_UNRELATED_{tag} is no setting (ignored)") == 1, warned
    assert "SHOAL_DATA_DIR" not in warned and "SHOAL_TEST_DATABASE_URL" not in warned


def test_settings_and_directly_read_variables_are_no_warning() -> None:
    environ = {"SHOAL_DATA_DIR": "/x", "shoal_tenant": "t", "SHOAL_CONFIG": "s.toml", "SHOAL_TEST_DATABASE_URL": "u",
               "SHOAL_SHARED_DATA": "d", "SHOAL_TEST_FAIL_FILE": "f", "SHOAL_WIRE_EXAMPLES": "1",
               "SHOAL_WIRE_RANDOM": "1", "SHOAL_BENCH_DATA": "b", "SHOAL_CATALOG_BENCH_TAG": "t", "OTHER": "1"}
    assert unknown_variables(environ) == []
    assert unknown_variables({"SHOAL_DATABSE_URL": "u"}) == [
        "SHOAL_DATABSE_URL is no setting; did you mean SHOAL_DATABASE_URL?"]


def test_the_settings_command_warns_on_stderr_and_still_exits_0(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tag = uuid.uuid4().hex[:6].upper()
    monkeypatch.setenv(f"SHOAL_TENNANT{tag}", "x")
    result = shoal_cli("settings", "--json")
    assert f"warning: SHOAL_TENNANT{tag} is no setting" in result.stderr
    assert "warning" not in result.stdout


# -- 5: `shoal status` warnings on stderr ------------------------------------------------------------------


def test_status_prints_its_warnings_on_stderr(tenant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    head = _source_with_points("lagging", 3)
    with Shoal(notify=False) as client:
        client.create_index(IndexSpec("lagging.ix", "1", "lagging", "1", algorithm="flat", metric="euclidean"))
    monkeypatch.setenv("SHOAL_REDIS_URL", "redis://127.0.0.1:1/0")  # no broker: the lag will not shrink
    result = shoal_cli("status", "lagging.ix", "1")
    assert "lagging.ix" in result.stdout and f"{head}" in result.stdout
    assert "warning" not in result.stdout, result.stdout
    assert "warning: " in result.stderr, result.stderr
    as_json = shoal_cli("status", "lagging.ix", "1", "--json")
    assert "warning" not in as_json.stderr and '"problems"' in as_json.stdout
