"""Connecting to the catalog: URL resolution (configured or embedded), engines, and migrations."""

from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

if TYPE_CHECKING:
    from alembic.config import Config

from shoal.config.settings import Settings, check_database_url, mask_url
from shoal.errors import ConfigurationError

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


# One number for "shoal is migrating" (shoal/migrations/env.py): concurrent processes migrating one catalog queue on
# it.
MIGRATION_LOCK_KEY = 0x5A0A1

def catalog_unreachable(exc: BaseException | None) -> bool:
    """True when `exc`, or an error it was raised from, is the driver failing to reach or keep the catalog
    (refused, dropped, shut down, timed out, a pool that could not connect): an outage (503), never a query the
    catalog answered with an error."""
    for _ in range(8):  # a short cause chain; never a loop
        if exc is None:
            return False
        if isinstance(exc, (OperationalError, InterfaceError)) or (
            isinstance(exc, DBAPIError) and exc.connection_invalidated
        ):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def resolve_database_url(settings: Settings) -> str:
    """The configured catalog URL, or the embedded Postgres's (started if needed)."""
    if settings.database_url:
        # Settings check it when read; ones built by model_copy skip that check, so it is made here again.
        try:
            url = check_database_url(settings.database_url)
        except ValueError as exc:
            raise ConfigurationError(f"invalid settings: database_url: {exc}") from None
        # Plain postgresql:// URLs would pick psycopg2; Shoal speaks psycopg 3.
        if url.startswith("postgresql://") or url.startswith("postgres://"):
            url = "postgresql+psycopg://" + url.split("://", 1)[1]
        return url
    from shoal.servers.embedded import ensure_postgres

    return ensure_postgres(settings.data_dir)


def make_engine(url: str, *, pool_size: int = 5, max_overflow: int = 5) -> Engine:
    """An engine for the catalog, with pre-ping so a restarted server costs one retry, not an error. It holds
    at most `pool_size + max_overflow` connections, named `shoal/<pid>` in pg_stat_activity (so an operator
    sees which process holds which connections: named per connection, so a forked child's are named after it).
    Once `close_engine` closed it, it opens no connection again (ConfigurationError)."""
    engine = create_engine(url, pool_pre_ping=True, pool_size=pool_size, max_overflow=max_overflow)
    event.listen(engine, "do_connect", _connecting(weakref.ref(engine)))
    event.listen(engine, "connect", _utc_session)
    return engine


# Engines `close_engine` closed: they refuse to connect (weakly held: a closed engine dropped goes).
_CLOSED_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


def close_engine(engine: Engine) -> None:
    """Close the engine's pooled connections for good: any later use raises ConfigurationError instead of
    silently opening a new pool nobody would close."""
    _CLOSED_ENGINES.add(engine)
    engine.dispose()


def _connecting(engine_ref: weakref.ref[Engine]) -> Any:
    """The engine's do_connect hook: refuse when it was closed; name the connection after the process making
    it (the pid of now, not of when the engine was made: a forked child's connections are its own)."""

    def connect(_dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
        engine = engine_ref()
        if engine is not None and engine in _CLOSED_ENGINES:
            raise ConfigurationError("this Shoal is closed: its catalog connections were released (make a new "
                                     "Shoal)")
        cparams["application_name"] = application_name()

    return connect


def _utc_session(dbapi_connection: Any, _record: Any) -> None:
    """Every catalog session in UTC: psycopg hands timestamptz values over in the session's time zone, and a
    server or database set to another one (or PGTZ) made answers mix offsets. A SET, not a startup option, which
    poolers such as PgBouncer refuse; in autocommit, so no rollback of the first transaction undoes it."""
    autocommit = dbapi_connection.autocommit
    dbapi_connection.autocommit = True
    try:
        dbapi_connection.execute("SET TIME ZONE 'UTC'")
    finally:
        dbapi_connection.autocommit = autocommit


def application_name() -> str:
    """How this process's catalog connections are named in pg_stat_activity."""
    return f"shoal/{os.getpid()}"


def alembic_config(url: str) -> Config:
    """An Alembic config for the catalog at `url`, independent of the working directory."""
    from alembic.config import Config  # imported here: alembic costs start-up time of every CLI call

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


_migrated: set[str] = set()
_migrate_lock = threading.Lock()


def _fresh_migrate_lock() -> None:
    """In a forked child: a lock of its own (a parent thread migrating at the fork would hold the copy forever)."""
    global _migrate_lock
    _migrate_lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_migrate_lock)


def ensure_schema(engine: Engine, url: str, *, auto_migrate: bool) -> None:
    """Make sure the catalog has the schema this Shoal needs: with `auto_migrate`, migrate it (once per process and
    URL); without, check its revision and raise ConfigurationError saying to run `shoal migrate` if behind. A
    failure of the catalog itself is a ConfigurationError too, in one line naming its cause (`catalog_error`)."""
    with _migrate_lock:
        if url in _migrated:
            return
        try:
            current, head = check_known_revision(engine, url)
            if auto_migrate:
                migrate(url)
        except DBAPIError as exc:
            raise catalog_error(exc, url, "migration" if auto_migrate else "the schema check") from exc
        if not auto_migrate and current != head:
            found = f"schema revision {current}" if current else "no Shoal schema"
            raise ConfigurationError(
                f"the catalog has {found}; this Shoal needs revision {head}: run `shoal migrate` first"
            )
        _migrated.add(url)


def schema_revision(engine: Engine) -> str | None:
    """The catalog's Alembic revision (None when it was never migrated)."""
    with engine.connect() as conn:
        if not inspect(conn).has_table("alembic_version"):
            return None
        return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


def check_known_revision(engine: Engine, url: str) -> tuple[str | None, str | None]:
    """The catalog's revision and this Shoal's newest; ConfigurationError when the catalog's is one this Shoal
    does not know (a newer Shoal migrated it: Alembic would fail with a traceback, and nothing can downgrade)."""
    current, head = schema_revision(engine), head_revision(url)
    if current is not None and current != head and not _known_revision(url, current):
        raise ConfigurationError(
            f"the catalog is at schema revision {current}, which this Shoal does not know (its newest is {head}): "
            "a newer Shoal migrated it; run that version, or upgrade this one"
        )
    return current, head


def _known_revision(url: str, revision: str) -> bool:
    """True when `revision` is one of Shoal's migrations."""
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    try:
        return ScriptDirectory.from_config(alembic_config(url)).get_revision(revision) is not None
    except CommandError:
        return False


def head_revision(url: str) -> str | None:
    """The newest revision of Shoal's migrations."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


def catalog_error(exc: DBAPIError, url: str, action: str = "migration") -> ConfigurationError:
    """The one-line ConfigurationError to report a catalog call that failed by, naming the catalog (its password
    masked): a migration step's lock timeout as one, saying what to do; a table the migrations make found already
    there as a database that is not Shoal's; an OperationalError otherwise as a catalog that cannot be reached;
    any other (a role without the rights it needs, ...) as `action` failed, with the driver's reason."""
    from psycopg import errors

    catalog = mask_url(url)
    text = str(exc.orig or exc).strip()
    reason = text.splitlines()[0] if text else type(exc).__name__
    if isinstance(exc.orig, errors.LockNotAvailable):
        # Every step runs in one transaction (shoal/migrations/env.py): the whole migration was rolled back.
        return ConfigurationError(
            f"catalog {catalog}: a migration step waited more than 4 s for a lock that live traffic holds ({reason}); "
            "nothing was migrated: run `shoal migrate` when it is quieter"
        )
    if isinstance(exc.orig, errors.DuplicateTable):
        return ConfigurationError(
            f"catalog {catalog}: {action} failed: {reason}: this database holds tables Shoal did not make (point "
            "SHOAL_DATABASE_URL at a database of Shoal's own)"
        )
    if isinstance(exc, OperationalError):
        return ConfigurationError(f"cannot reach the catalog at {catalog}: {reason}")
    return ConfigurationError(f"catalog {catalog}: {action} failed: {reason}")


def migrate(url: str) -> None:
    """Bring the catalog at `url` to the newest schema; safe to call from many processes at once."""
    from alembic import command

    command.upgrade(alembic_config(url), "head")
