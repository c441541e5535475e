"""Soft-deleted data sources (datasets): when they went to the trash and when they are purged.

`data_sources.deleted_at` / `purge_after` and `indexes.deleted_at` mark rows in the trash; the names of data
sources and indexes are unique only among live rows (partial unique indexes), so a name is free for reuse
while its previous owner waits in the trash. `trash_files` is the purge's logged list: the rows of a purged
data source go in one transaction that records the files they referenced, and the files are deleted after
it, so a crash never leaves a row pointing at a missing file and a rerun finishes the list.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 07:15:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

LIVE = sa.text("deleted_at IS NULL")


def upgrade() -> None:
    op.add_column("data_sources", sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("data_sources", sa.Column("purge_after", sa.DateTime(timezone=True), nullable=True))
    op.drop_constraint("uq_data_sources_tenant_name_version", "data_sources", type_="unique")
    op.create_index(
        "uq_data_sources_tenant_name_version", "data_sources", ["tenant_id", "name", "version"],
        unique=True, postgresql_where=LIVE,
    )
    op.create_index(
        "ix_data_sources_purge_after", "data_sources", ["purge_after"], unique=False,
        postgresql_where=sa.text("deleted_at IS NOT NULL"),
    )

    op.add_column("indexes", sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))
    op.drop_constraint("uq_indexes_tenant_name_version", "indexes", type_="unique")
    op.create_index(
        "uq_indexes_tenant_name_version", "indexes", ["tenant_id", "name", "version"],
        unique=True, postgresql_where=LIVE,
    )

    op.create_table(
        "trash_files",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("tenant", sa.String(length=100), nullable=False),
        sa.Column("data_source_id", sa.BigInteger(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("is_dir", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("queued_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_trash_files")),
    )


def downgrade() -> None:
    trashed = op.get_bind().execute(
        sa.text("SELECT count(*) FROM data_sources WHERE deleted_at IS NOT NULL")
    ).scalar_one()
    pending = op.get_bind().execute(sa.text("SELECT count(*) FROM trash_files")).scalar_one()
    if trashed or pending:
        raise RuntimeError(
            f"{trashed} data sources are in the trash and {pending} purged files are not deleted yet: "
            "empty the trash first (`shoal trash purge --now` in every tenant), then downgrade"
        )
    op.drop_table("trash_files")
    op.drop_index("uq_indexes_tenant_name_version", table_name="indexes", postgresql_where=LIVE)
    op.create_unique_constraint("uq_indexes_tenant_name_version", "indexes", ["tenant_id", "name", "version"])
    op.drop_column("indexes", "deleted_at")
    op.drop_index("ix_data_sources_purge_after", table_name="data_sources")
    op.drop_index("uq_data_sources_tenant_name_version", table_name="data_sources", postgresql_where=LIVE)
    op.create_unique_constraint(
        "uq_data_sources_tenant_name_version", "data_sources", ["tenant_id", "name", "version"]
    )
    op.drop_column("data_sources", "purge_after")
    op.drop_column("data_sources", "deleted_at")
