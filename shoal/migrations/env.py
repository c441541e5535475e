"""Alembic environment: runs migrations under an advisory lock with a lock timeout."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, text

from shoal.catalog.models import Base

# One number for "shoal is migrating"; concurrent shoal processes starting on one catalog queue here.
MIGRATION_LOCK_KEY = 0x5A0A1


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
    # Never queue behind live traffic for long: a blocked DDL statement blocks every query after it.
    connection.execute(text("SET lock_timeout = '4s'"))
    connection.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
    try:
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            compare_type=True,
            transaction_per_migration=True,
        )
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()
    finally:
        connection.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK_KEY})
        connection.commit()


if context.is_offline_mode():
    raise SystemExit("offline migrations are not supported; run against a database")
run_migrations_online()
