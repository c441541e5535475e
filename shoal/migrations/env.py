"""Alembic environment: runs migrations under an advisory lock with a lock timeout."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, text

from shoal.catalog.db import MIGRATION_LOCK_KEY
from shoal.catalog.models import Base


def _url() -> str:
    url = context.config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from shoal.catalog.db import resolve_database_url
    from shoal.config.settings import Settings

    return resolve_database_url(Settings())


def run_migrations_online() -> None:
    connectable = context.config.attributes.get("connection")
    if connectable is None:
        engine = create_engine(_url())
        with engine.connect() as connection:
            _run(connection)
        engine.dispose()
    else:
        _run(connectable)


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    # Queue behind another migrating process for as long as it takes (lock_timeout applies to advisory locks
    # too: with the DDL's timeout set first, a second process failed while the first ran a long step) ...
    connection.execute(text("SET lock_timeout = 0"))
    connection.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
    connection.commit()
    try:
        # ... but never queue behind live traffic for long: a blocked DDL statement blocks every query after it.
        connection.execute(text("SET lock_timeout = '4s'"))
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            compare_type=True,
            transaction_per_migration=True,
        )
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()
    except BaseException:
        # The failed step's transaction is aborted: end it, so the unlock below runs (and the step's own error,
        # not "current transaction is aborted", is what the caller sees).
        connection.rollback()
        raise
    finally:
        connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK_KEY})
        connection.commit()


if context.is_offline_mode():
    raise SystemExit("offline migrations are not supported; run against a database")
run_migrations_online()
