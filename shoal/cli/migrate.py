"""`shoal migrate`: bring the catalog's schema to the one this Shoal needs (Alembic, lock timeouts in each step)."""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError

from shoal.catalog.db import (
    catalog_error,
    check_known_revision,
    head_revision,
    make_engine,
    migrate,
    resolve_database_url,
    schema_revision,
)
from shoal.cli.common import load_settings, out
from shoal.config.settings import mask_url


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
    except DBAPIError as exc:
        # Any failure of the catalog (away, a lock timeout, a role without rights, tables of another application
        # ...) is a deployment's to fix: one line naming the catalog and the cause, not a traceback.
        raise catalog_error(exc, url) from None
    finally:
        engine.dispose()
    if before == after:
        out.print(f"catalog {mask_url(url)}: schema already at revision {after} (newest: {head_revision(url)})")
    else:
        out.print(f"catalog {mask_url(url)}: migrated from {before or 'an empty database'} to revision {after}")
