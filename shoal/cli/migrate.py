"""`shoal migrate`: bring the catalog's schema to the one this Shoal needs (Alembic, lock timeouts in each step)."""

from __future__ import annotations

from sqlalchemy.exc import OperationalError

from shoal.catalog.db import (
    check_known_revision,
    head_revision,
    make_engine,
    migrate,
    resolve_database_url,
    schema_revision,
)
from shoal.cli.common import first_line, load_settings, out
from shoal.config.settings import mask_url
from shoal.errors import ConfigurationError


def migrate_command() -> None:
    """Migrate the catalog (SHOAL_DATABASE_URL, or the embedded Postgres) to the newest schema.

    Run it once per deployment and release, before starting the other roles: with SHOAL_DATABASE_URL set, API,
    workers and consumers refuse to start on an older schema instead of migrating it themselves. Safe to run
    again (it does nothing when the schema is current) and from several processes at once.
    """
    settings = load_settings()
    url = resolve_database_url(settings)
    engine = make_engine(url, pool_size=1, max_overflow=0)
    try:
        before = check_known_revision(engine, url)[0]
        migrate(url)
        after = schema_revision(engine)
    except OperationalError as exc:
        if type(getattr(exc, "orig", None)).__name__ == "LockNotAvailable":
            raise ConfigurationError(
                f"catalog {mask_url(url)}: a migration step waited more than 4 s for a lock that live traffic holds "
                f"({first_line(exc)}); nothing of that step was applied: run `shoal migrate` again when it is quieter"
            ) from None
        raise ConfigurationError(f"cannot reach the catalog at {mask_url(url)}: {first_line(exc)}") from None
    finally:
        engine.dispose()
    if before == after:
        out.print(f"catalog {mask_url(url)}: schema already at revision {after} (newest: {head_revision(url)})")
    else:
        out.print(f"catalog {mask_url(url)}: migrated from {before or 'an empty database'} to revision {after}")
