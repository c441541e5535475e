"""Long-running roles check the catalog before they start, and every catalog failure at start is one line.

README: with SHOAL_DATABASE_URL, "API, workers and consumers then check the schema at start and refuse an older
one with a message saying to run `shoal migrate`". Each test runs the real `shoal` command in a child process on a
real catalog at another revision (one behind this Shoal's, or one of a newer Shoal), or a real lock timeout.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from alembic import command
from alembic.script import ScriptDirectory
from conftest import free_port
from sqlalchemy import create_engine, inspect, make_url, text

from shoal import Shoal
from shoal.catalog.db import alembic_config, head_revision, migrate, schema_revision
from shoal.config.settings import Settings, mask_url
from shoal.errors import ConfigurationError
from shoal.servers.embedded import ensure_postgres, stop_embedded

# What each refusal says, by the catalog's revision.
REFUSALS = {
    "older": "this Shoal needs revision {head}: run `shoal migrate` first",
    "newer": "which this Shoal does not know (its newest is {head})",
}


def previous_revision(url: str) -> str:
    """The revision before this Shoal's newest: the catalog a deployment of the previous release left."""
    down = ScriptDirectory.from_config(alembic_config(url)).get_revision(head_revision(url)).down_revision
    assert isinstance(down, str), down
    return down


def plain(url: str) -> str:
    """`url` for psycopg itself."""
    return url.replace("postgresql+psycopg://", "postgresql://")


@pytest.fixture(params=sorted(REFUSALS))
def other_catalog(request: pytest.FixtureRequest, fresh_db: str) -> tuple[str, str]:
    """A catalog one migration behind this Shoal ("older"), or migrated by a newer Shoal ("newer"), and the
    message a process refusing it must show."""
    if request.param == "older":
        command.upgrade(alembic_config(fresh_db), previous_revision(fresh_db))
    else:
        migrate(fresh_db)
        with psycopg.connect(plain(fresh_db), autocommit=True) as conn:
            conn.execute("UPDATE alembic_version SET version_num = '9999'")
    return fresh_db, REFUSALS[request.param].format(head=head_revision(fresh_db))


def run_shoal(env: dict[str, str], cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`shoal ARGS` in a child process (a session of its own, all of it killed should it outlive `timeout`); a
    command still running then has not refused at start, which fails the test."""
    proc = subprocess.Popen([sys.executable, "-m", "shoal.cli", *args], env=env | {"COLUMNS": "200"}, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"`shoal {' '.join(args)}` still running after {timeout} s (not refused at start):\n{out}{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def refused_in_one_line(done: subprocess.CompletedProcess[str], *expected: str) -> str:
    """Assert `done` exited with status 1 printing one line, an error naming every one of `expected`; return it."""
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 1 and len(lines) == 1, (done.returncode, lines)
    assert lines[0].startswith("error: "), lines
    for part in expected:
        assert part in lines[0], lines
    return lines[0]


def test_shoal_consume_refuses_a_catalog_of_another_revision_at_start(
    other_catalog: tuple[str, str], intake_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    """`shoal consume` on a real broker refuses at start (it ran, requeueing every message once a second)."""
    url, refusal = other_catalog
    settings = intake_settings(database_url=url)
    done = run_shoal(settings.child_env(), tmp_path, "consume", timeout=30)
    refused_in_one_line(done, refusal)
    assert "consuming queue" not in done.stdout


@pytest.mark.parametrize("workers", [1, 2])
def test_shoal_api_refuses_a_catalog_of_another_revision_before_serving(
    other_catalog: tuple[str, str], workers: int, tmp_path: Path
) -> None:
    """`shoal api` refuses in one line before it serves (uvicorn's traceback before; with --workers, the worker
    processes were restarted until the supervisor gave up, a traceback each)."""
    url, refusal = other_catalog
    settings = Settings(data_dir=tmp_path / "data", database_url=url, storage_uri=str(tmp_path / "storage"),
                        redis_url="redis://127.0.0.1:1/0")
    done = run_shoal(settings.child_env(), tmp_path, "api", "--port", str(free_port()), "--workers", str(workers))
    refused_in_one_line(done, refusal)
    assert "Traceback" not in done.stderr and "Shoal API on" not in done.stdout


def test_a_lock_timeout_of_the_embedded_defaults_migration_is_reported_as_one(tmp_path: Path) -> None:
    """The embedded default migrates at start; a migration step that waits past its lock timeout behind live
    traffic (here a transaction holding alembic_version, which every migration updates last) is named as such, by
    `Shoal()` and `shoal worker` alike, with what to do (it was "cannot reach the catalog"). Nothing is migrated,
    and once the traffic is gone `shoal migrate` does it."""
    # Not under pytest's temp root: the embedded Postgres runs as another user (see conftest.pg_url).
    data_dir = Path(tempfile.mkdtemp(prefix="shoal-test-lock-"))
    try:
        url = ensure_postgres(data_dir)
        before = previous_revision(url)
        command.upgrade(alembic_config(url), before)  # what the previous release left
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")} | {"SHOAL_DATA_DIR": str(data_dir)}
        lock = "waited more than 4 s for a lock that live traffic holds"
        with psycopg.connect(plain(url)) as live:
            live.execute("LOCK TABLE alembic_version IN EXCLUSIVE MODE")  # readers pass, the migration's update waits
            with pytest.raises(ConfigurationError, match=lock) as refused:
                Shoal(Settings(data_dir=data_dir, database_url=None, tenant="probe"), notify=False)
            assert "cannot reach" not in str(refused.value) and "run `shoal migrate`" in str(refused.value)
            line = refused_in_one_line(run_shoal(env, tmp_path, "worker", "--no-beat"), lock, "run `shoal migrate`")
            assert "cannot reach" not in line
            live.rollback()
        engine = create_engine(url)
        assert schema_revision(engine) == before  # "nothing was migrated"
        engine.dispose()
        done = run_shoal(env, tmp_path, "migrate")
        assert done.returncode == 0 and f"migrated from {before} to revision {head_revision(url)}" in done.stdout, done
    finally:
        stop_embedded(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture
def restricted_url(fresh_db: str) -> Iterator[str]:
    """The URL of `fresh_db` for a new role (with a password) that may connect but not create anything in it."""
    role, password = "r" + uuid.uuid4().hex[:10], "pw" + uuid.uuid4().hex[:10]
    with psycopg.connect(plain(fresh_db), autocommit=True) as admin:
        try:
            admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
        except psycopg.errors.InsufficientPrivilege:
            pytest.skip("the test server's user may not create roles")
        admin.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    yield make_url(fresh_db).set(username=role, password=password).render_as_string(hide_password=False)
    with psycopg.connect(plain(fresh_db), autocommit=True) as admin:
        admin.execute(f"DROP ROLE {role}")


def test_shoal_migrate_reports_a_role_without_rights_in_one_line(restricted_url: str, tmp_path: Path) -> None:
    """A catalog role without CREATE: one line naming the catalog (password masked) and the reason, not a
    328-line traceback."""
    settings = Settings(data_dir=tmp_path, database_url=restricted_url, storage_uri=str(tmp_path / "storage"))
    line = refused_in_one_line(run_shoal(settings.child_env(), tmp_path, "migrate"), "permission denied")
    assert f"catalog {mask_url(restricted_url)}: " in line and str(make_url(restricted_url).password) not in line


def test_shoal_migrate_refuses_a_database_holding_tables_of_another_application(fresh_db: str, tmp_path: Path) -> None:
    """SHOAL_DATABASE_URL pointing at an application's database that has a table named as one of Shoal's: one line
    saying so, and the database is left as it was."""
    with psycopg.connect(plain(fresh_db), autocommit=True) as conn:
        conn.execute("CREATE TABLE tenants (id serial PRIMARY KEY)")
    settings = Settings(data_dir=tmp_path, database_url=fresh_db, storage_uri=str(tmp_path / "storage"))
    refused_in_one_line(run_shoal(settings.child_env(), tmp_path, "migrate"), 'relation "tenants" already exists',
                        "this database holds tables Shoal did not make")
    engine = create_engine(fresh_db)
    assert inspect(engine).get_table_names() == ["tenants"]
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM tenants")).scalar() == 0
    engine.dispose()
