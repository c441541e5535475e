"""The `shoal` command line prints stored text as it is: names, descriptions, metadata, attribute values, paths,
key labels and dead-letter reasons holding "[...]" (rich markup) or ":...:" (emoji codes) crashed tables with a
MarkupError or were silently changed. `consume --dead` removes the dead letters only once they were printed, `key
create` prints the secret whatever its label, and `search --json` writes datetimes in ISO 8601 like every --json.

The module runs on its own data directory (embedded Postgres and Valkey, stopped at the end) unless the session
names a catalog with SHOAL_TEST_DATABASE_URL; every test works in its own tenant.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
from conftest import module_cli_env, wait_for
from typer.testing import CliRunner, Result

from shoal.auth import authenticate
from shoal.catalog.db import make_engine, resolve_database_url
from shoal.cli import app
from shoal.config.settings import Settings
from shoal.intake import codec
from shoal.intake.consumer import IntakeConsumer
from shoal.intake.publisher import Publisher
from shoal.servers.broker import broker_url

runner = CliRunner()
VECTOR = {"isSparse": False, "coordinates": [1.0, 0.0]}


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """SHOAL_* variables for this module: a fresh data dir and storage; servers stopped at teardown."""
    with module_cli_env(tmp_path_factory, "cli-output") as data_dir:
        yield data_dir


@pytest.fixture
def tenant(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh tenant, set as SHOAL_TENANT for in-process and child-process calls."""
    name = "out" + uuid.uuid4().hex[:12]
    monkeypatch.setenv("SHOAL_TENANT", name)
    return name


def shoal_cli(*args: str, code: int = 0, env: dict[str, str] | None = None) -> Result:
    """Run `shoal ARGS` in process; assert the exit code and that no traceback was printed."""
    result = runner.invoke(app, list(args), env=env)
    assert result.exit_code == code, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    assert "Traceback" not in result.output
    return result


def table_value(output: str, key: str) -> str:
    """The second column of a printed table's row whose first column is `key`, its folded lines joined."""
    parts: list[str] = []
    inside = False
    for line in output.splitlines():
        cells = [c.strip() for c in line.split("\u2502")[1:-1]]
        if len(cells) < 2:
            continue  # a border or the title
        if cells[0]:
            inside = cells[0] == key
        if inside:
            parts.append(cells[1])
    return "".join(parts)


def dead_count(settings: Settings) -> int:
    """Messages in the dead-letter queue of the settings' intake exchange and group."""
    client = redis.Redis.from_url(broker_url(settings))
    try:
        return int(client.llen(f"{settings.intake_exchange}.{settings.intake_group}.dead"))
    finally:
        client.close()


def dead_letter_two_messages(name: str) -> Settings:
    """Publish two messages a consumer refuses (one whose reason quotes an attribute named "x[/]") and run a
    consumer until both are in the dead-letter queue."""
    settings = Settings()
    with Publisher(settings) as p:
        p.publish_raw(name, "1", json.dumps([{"attributes": [{"key": "id", "value": {"string": "one"}}],
                                              "vector": VECTOR}]).encode(), codec.JSON, message_id="bad-type")
        p.publish_raw(name, "1", json.dumps([{"attributes": [{"key": "id", "value": {"int64": 1}},
                                                             {"key": "x[/]", "value": {"int64": 1}}],
                                              "vector": VECTOR}]).encode(), codec.JSON, message_id="bad-attr")
    consumer = IntakeConsumer(settings)
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: dead_count(settings) == 2, 60, "both messages dead-lettered")
    finally:
        consumer.stop.set()
        thread.join(30)
    return settings


def test_consume_dead_lists_the_letters_literally_and_removes_them_only_once_printed(tenant: str) -> None:
    """`consume --dead` acked (removed) every dead letter, then printed the table: a reason quoting an attribute
    named "x[/]" raised rich's MarkupError, and a closed pipe a BrokenPipeError, with every letter lost."""
    shoal_cli("source", "create", "dl", "1", "--dim", "2", "--attr", "id:int64", "--permanent", "id")
    settings = dead_letter_two_messages("dl")
    # Its stdout a pipe nobody reads (`shoal consume --dead | head`, head gone): printing fails, nothing is lost.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        child = subprocess.run([sys.executable, "-m", "shoal.cli", "consume", "--dead"], stdout=write_end,
                               stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert child.returncode != 0, child.stderr
    assert dead_count(settings) == 2, child.stderr
    listed = shoal_cli("consume", "--dead")
    assert "(2, now removed)" in listed.stdout
    assert "bad-type" in listed.stdout and "bad-attr" in listed.stdout
    assert "x[/]" in listed.stdout
    assert dead_count(settings) == 0  # removed once shown
    assert "(0, now removed)" in shoal_cli("consume", "--dead").stdout


def test_key_create_prints_the_secret_whatever_the_label(tenant: str) -> None:
    """A label holding rich markup: `key create` stored the key and crashed before printing its secret (which
    nothing can show again), `key list` crashed, and "[bold]ops" was printed as "(ops)"."""
    shoal_cli("tenant", "create", tenant)
    created = shoal_cli("key", "create", "--tenant", tenant, "--role", "write", "--name", "deploy [/] bot")
    key = created.stdout.strip()
    engine = make_engine(resolve_database_url(Settings()))
    try:
        principal = authenticate(engine, f"ApiKey {key}")
    finally:
        engine.dispose()
    assert principal.tenant_name == tenant  # the printed secret is the key, and it works
    assert "(deploy [/] bot)." in created.stderr
    bold = shoal_cli("key", "create", "--tenant", tenant, "--role", "read", "--name", "[bold]ops")
    assert bold.stdout.strip().startswith("shoal_")
    assert "([bold]ops)." in bold.stderr
    listed = shoal_cli("key", "list", "--tenant", tenant).stdout
    assert "deploy [/] bot" in listed and "[bold]ops" in listed


DESCRIPTION = "see [red]this[/red] :warning: [bold]that"
VALUES = ["[red]alert[/red]", "x[/]y"]


def markup_source(tmp_path: Path, *, points: bool = True) -> Result | None:
    """Data source mk/1 with a description and metadata holding markup; with `points`, string attribute values
    holding markup imported from a file named data[v2].parquet (the import's result returned)."""
    shoal_cli("source", "create", "mk", "1", "--dim", "2", "--attr", "id:int64,s:string", "--permanent", "id",
              "--description", DESCRIPTION, "--metadata", '{"owner": "[/]"}')
    if not points:
        return None
    path = tmp_path / "data[v2].parquet"
    pq.write_table(pa.table({"id": [1, 2], "s": VALUES, "vector": [[1.0, 0.0], [0.0, 1.0]]}), path)
    return shoal_cli("import", "mk", "1", str(path))


def test_source_get_prints_description_and_metadata_as_they_are(tenant: str, tmp_path: Path) -> None:
    """Metadata {"owner": "[/]"} crashed `source get` (MarkupError); `see [red]this[/red]` was printed as
    `see this` and ":warning:" as an emoji."""
    markup_source(tmp_path, points=False)
    got = shoal_cli("source", "get", "mk", "1").stdout
    assert table_value(got, "description") == DESCRIPTION
    assert table_value(got, "metadata") == '{"owner": "[/]"}'


def test_import_names_the_file_as_it_is(tenant: str, tmp_path: Path) -> None:
    """`import data[v2].parquet` reported importing from data.parquet."""
    imported = markup_source(tmp_path)
    assert imported is not None
    assert "from data[v2].parquet into mk/1" in imported.stdout


def test_log_show_prints_attribute_values_as_they_are(tenant: str, tmp_path: Path) -> None:
    """A string attribute "x[/]y" crashed `log --show` (MarkupError); "[red]alert[/red]" was printed as "alert"."""
    markup_source(tmp_path)
    logged = shoal_cli("log", "mk", "1", "--show", "2").stdout
    assert all(v in logged for v in VALUES), logged


def test_search_table_prints_attribute_values_as_they_are(tenant: str, tmp_path: Path) -> None:
    """A string attribute "x[/]y" crashed the `search` table (MarkupError)."""
    markup_source(tmp_path)
    shoal_cli("index", "create", "mk.flat", "1", "--source", "mk", "--source-version", "1")
    found = shoal_cli("search", "mk.flat", "1", "-q", "1,0", "--consistency", "strong").stdout
    assert all(v in found for v in VALUES), found


def test_settings_table_prints_a_data_dir_as_it_is(tenant: str, tmp_path: Path) -> None:
    """A data dir holding "[/]" crashed the `shoal settings` table (MarkupError)."""
    odd_dir = tmp_path / "x[/]y"
    shown = shoal_cli("settings", env={"SHOAL_DATA_DIR": str(odd_dir)}).stdout
    assert table_value(shown, "data_dir") == str(odd_dir)


def test_search_json_writes_datetimes_in_iso_8601(tenant: str, tmp_path: Path) -> None:
    """`search --json` wrote datetime attributes as str() ("2024-01-02 03:04:05+00:00") where every other --json
    output writes ISO 8601 ("2024-01-02T03:04:05+00:00")."""
    shoal_cli("source", "create", "when", "1", "--dim", "2", "--attr", "id:int64,d:datetime", "--permanent", "id")
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": [1], "d": [dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.UTC)],
                             "vector": [[1.0, 0.0]]}), path)
    shoal_cli("import", "when", "1", str(path))
    shoal_cli("index", "create", "when.flat", "1", "--source", "when", "--source-version", "1")
    found = json.loads(shoal_cli("search", "when.flat", "1", "-q", "1,0", "--consistency", "strong", "--json").stdout)
    [hit] = found[0]["hits"]
    assert hit["attributes"]["d"] == "2024-01-02T03:04:05+00:00"
    assert dt.datetime.fromisoformat(hit["attributes"]["d"]) == dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.UTC)


def test_rollback_names_the_metric_and_no_empty_parameter_list(tenant: str, tmp_path: Path) -> None:
    """`shoal rollback` printed `(flat, )`: an empty parameter list, and no metric, though a reindex may have
    changed only the metric."""
    shoal_cli("source", "create", "rb", "1", "--dim", "2", "--attr", "id:int64", "--permanent", "id")
    shoal_cli("index", "create", "rb.flat", "1", "--source", "rb", "--source-version", "1", "--metric", "cosine")
    shoal_cli("reindex", "rb.flat", "1", "--metric", "dot_product", "--wait")
    out = shoal_cli("rollback", "rb.flat", "1").output
    assert "again (flat, cosine)" in out, out


# A tenant's text that drives a terminal: colour, a window title (OSC ... BEL), erase the line, DEL, a C1 CSI
# and a right-to-left override. What an operator must see instead: each control as a visible escape.
CONTROLS = "X\x1b[31mRED\x1b[0m\x1b]0;TITLE\x07\x1b[2K\x7f\x9b\u202eZ"
SHOWN = "X\\x1b[31mRED\\x1b[0m\\x1b]0;TITLE\\x07\\x1b[2K\\x7f\\x9b\\u202eZ"
RAW = [chr(c) for c in (*range(0x20), *range(0x7F, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A))
       if chr(c) not in "\t\n"]


def assert_visible(output: str) -> None:
    """`output` holds no raw control character (ESC, C1, bidi override) and shows CONTROLS escaped."""
    raw = sorted({f"U+{ord(c):04X}" for c in output if c in RAW})
    assert not raw, f"raw control characters {raw} in:\n{output!r}"
    assert SHOWN in output, output


def test_cli_shows_control_characters_of_stored_text_as_escapes(tenant: str, tmp_path: Path) -> None:
    """A description and a string attribute holding ESC sequences reached the operator's terminal raw through
    `source get`, `log --show` and `search` (recolouring, erasing lines, setting the window title); --json keeps
    the text exactly."""
    shoal_cli("source", "create", "esc", "1", "--dim", "2", "--attr", "id:int64,s:string", "--permanent", "id",
              "--description", CONTROLS)
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": [1], "s": [CONTROLS], "vector": [[1.0, 0.0]]}), path)
    shoal_cli("import", "esc", "1", str(path))
    shoal_cli("index", "create", "esc.flat", "1", "--source", "esc", "--source-version", "1")
    got = shoal_cli("source", "get", "esc", "1").stdout
    assert_visible(got)
    assert table_value(got, "description") == SHOWN
    assert_visible(shoal_cli("log", "esc", "1", "--show", "1").stdout)
    assert_visible(shoal_cli("search", "esc.flat", "1", "-q", "1,0", "--consistency", "strong").stdout)
    assert json.loads(shoal_cli("source", "get", "esc", "1", "--json").stdout)["description"] == CONTROLS
    found = json.loads(shoal_cli("search", "esc.flat", "1", "-q", "1,0", "--consistency", "strong", "--json").stdout)
    assert found[0]["hits"][0]["attributes"]["s"] == CONTROLS
