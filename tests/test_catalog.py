"""The catalog's schema is made by Alembic alone, and the models cannot drift from the migrations."""

from __future__ import annotations

import subprocess
import sys

import pytest
from alembic import command
from sqlalchemy import create_engine, inspect

from shoal.catalog.db import alembic_config, migrate


def test_alembic_check_finds_no_drift(fresh_db: str) -> None:
    migrate(fresh_db)
    command.check(alembic_config(fresh_db))  # raises if the models need a migration the versions lack


def test_migrations_go_down_and_up_again(fresh_db: str) -> None:
    migrate(fresh_db)
    command.downgrade(alembic_config(fresh_db), "base")
    engine = create_engine(fresh_db)
    assert set(inspect(engine).get_table_names()) == {"alembic_version"}
    migrate(fresh_db)
    assert {"tenants", "data_sources", "log_segments", "producer_batches"} <= set(inspect(engine).get_table_names())
    engine.dispose()


def test_concurrent_processes_migrate_once(fresh_db: str) -> None:
    code = "import sys; from shoal.catalog.db import migrate; migrate(sys.argv[1])"
    procs = [subprocess.Popen([sys.executable, "-c", code, fresh_db], stderr=subprocess.PIPE) for _ in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
    command.check(alembic_config(fresh_db))


def test_an_unreachable_catalog_is_a_clear_configuration_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from shoal import Shoal
    from shoal.config.settings import Settings
    from shoal.errors import ConfigurationError

    settings = Settings(database_url="postgresql://shoal:s3cret@127.0.0.1:1/shoal", data_dir=tmp_path)
    with pytest.raises(ConfigurationError, match=r"cannot reach the catalog at .*shoal:\*\*\*@127.0.0.1:1") as err:
        Shoal(settings)
    assert "s3cret" not in str(err.value)


def test_a_configured_catalog_is_migrated_by_shoal_migrate_only(
    fresh_db: str, tmp_path  # type: ignore[no-untyped-def]
) -> None:
    """With SHOAL_DATABASE_URL, processes refuse an unmigrated catalog and say what to run; `shoal migrate` does
    it (and says so), and then they start."""
    from shoal import Shoal
    from shoal.config.settings import Settings
    from shoal.errors import ConfigurationError

    settings = Settings(data_dir=tmp_path, database_url=fresh_db, redis_url="redis://127.0.0.1:1/0",
                        storage_uri=str(tmp_path / "storage"))
    with pytest.raises(ConfigurationError, match="run `shoal migrate`"):
        Shoal(settings)
    engine = create_engine(fresh_db)
    assert "tenants" not in inspect(engine).get_table_names()  # refusing wrote nothing
    env = settings.child_env() | {"COLUMNS": "200"}
    cli = [sys.executable, "-m", "shoal.cli", "migrate"]
    first = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert first.returncode == 0, first.stderr
    assert "migrated from an empty database to revision" in first.stdout
    again = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 0 and "already at revision" in again.stdout
    with Shoal(settings) as shoal:
        assert shoal.list_data_sources() == []
    engine.dispose()


def test_a_second_migration_waits_for_the_first_however_long_it_takes(fresh_db: str) -> None:
    """`shoal migrate` from several processes at once queues on the advisory lock: a second one waited at most
    4 s (the DDL's lock timeout applied to the advisory lock too) and failed while the first ran a long step."""
    import psycopg

    from shoal.catalog.db import MIGRATION_LOCK_KEY

    plain = fresh_db.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))  # a first migration, running long
        code = "import sys; from shoal.catalog.db import migrate; migrate(sys.argv[1])"
        second = subprocess.Popen([sys.executable, "-c", code, fresh_db], stderr=subprocess.PIPE)
        # The second is waiting on the lock (not failed) well past the 4 s lock timeout of the steps.
        with psycopg.connect(plain, autocommit=True) as watch:
            def waiting() -> bool:
                return bool(watch.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted").fetchone()[0])

            import time
            deadline = time.monotonic() + 60
            while not waiting():
                assert second.poll() is None and time.monotonic() < deadline, second.stderr
                time.sleep(0.1)
            try:
                second.wait(timeout=6)  # longer than the steps' lock timeout: it must still be waiting
            except subprocess.TimeoutExpired:
                pass
            assert second.returncode is None, second.communicate()[1].decode()
        holder.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
    _, err = second.communicate(timeout=120)
    assert second.returncode == 0, err.decode()
    command.check(alembic_config(fresh_db))


def test_a_catalog_of_a_newer_shoal_is_refused_in_one_line(fresh_db: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A catalog migrated by a newer Shoal (a revision this one does not know) is refused naming both revisions,
    by the embedded default's auto-migration and by `shoal migrate` alike (Alembic's traceback before)."""
    from sqlalchemy import text

    from shoal.catalog.db import ensure_schema, head_revision
    from shoal.config.settings import Settings
    from shoal.errors import ConfigurationError

    migrate(fresh_db)
    engine = create_engine(fresh_db)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    with pytest.raises(ConfigurationError, match=f"revision 9999, which this Shoal does not know \\(its newest is "
                                                 f"{head_revision(fresh_db)}\\)"):
        ensure_schema(engine, fresh_db + "&x=1" if "?" in fresh_db else fresh_db + "?x=1", auto_migrate=True)
    engine.dispose()
    settings = Settings(data_dir=tmp_path, database_url=fresh_db, redis_url="redis://127.0.0.1:1/0",
                        storage_uri=str(tmp_path / "storage"))
    done = subprocess.run([sys.executable, "-m", "shoal.cli", "migrate"], env=settings.child_env(),
                          capture_output=True, text=True, timeout=120, check=False)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 1 and len(lines) == 1 and "revision 9999" in lines[0], lines
