"""Connecting to the catalog: URL resolution (configured or embedded), engines, and migrations."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Engine, create_engine

if TYPE_CHECKING:
    from alembic.config import Config

from shoal.config.settings import Settings

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def resolve_database_url(settings: Settings) -> str:
    """The configured catalog URL, or the embedded Postgres's (started if needed)."""
    if settings.database_url:
        url = settings.database_url
        # Plain postgresql:// URLs would pick psycopg2; Shoal speaks psycopg 3.
        if url.startswith("postgresql://") or url.startswith("postgres://"):
            url = "postgresql+psycopg://" + url.split("://", 1)[1]
        return url
    from shoal.config.embedded import ensure_postgres

    return ensure_postgres(settings.data_dir)


def make_engine(url: str) -> Engine:
    """An engine for the catalog, with pre-ping so a restarted server costs one retry, not an error."""
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


def alembic_config(url: str) -> Config:
    """An Alembic config for the catalog at `url`, independent of the working directory."""
    from alembic.config import Config  # imported here: alembic costs start-up time of every CLI call

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def migrate(url: str) -> None:
    """Bring the catalog at `url` to the newest schema; safe to call from many processes at once."""
    from alembic import command

    command.upgrade(alembic_config(url), "head")
