"""Reindex jobs: a new generation of an index built aside, checked against exact search, swapped in.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-22 07:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "reindex_jobs",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("index_name", sa.String(length=100), nullable=False),
        sa.Column("index_version", sa.String(length=100), nullable=False),
        sa.Column("from_index_id", sa.BigInteger(), nullable=True),
        sa.Column("to_index_id", sa.BigInteger(), nullable=True),
        sa.Column("state", sa.String(length=12), nullable=False),
        sa.Column("progress", sa.Float(), server_default="0", nullable=False),
        sa.Column("eta_s", sa.Float(), nullable=True),
        sa.Column("recall", sa.Float(), nullable=True),
        sa.Column("gate", sa.Float(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("definition", postgresql.JSONB(astext_type=sa.Text()), server_default="{}", nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "state IN ('building', 'swapped', 'failed', 'cancelled', 'rolled_back')",
            name=op.f("ck_reindex_jobs_reindex_state"),
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_reindex_jobs_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["from_index_id"], ["indexes.id"], name=op.f("fk_reindex_jobs_from_index_id_indexes"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["to_index_id"], ["indexes.id"], name=op.f("fk_reindex_jobs_to_index_id_indexes"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reindex_jobs")),
    )
    op.create_index(op.f("ix_reindex_jobs_tenant_id"), "reindex_jobs", ["tenant_id"], unique=False)
    op.create_index(op.f("ix_reindex_jobs_from_index_id"), "reindex_jobs", ["from_index_id"], unique=False)
    op.create_index(op.f("ix_reindex_jobs_to_index_id"), "reindex_jobs", ["to_index_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_reindex_jobs_to_index_id"), table_name="reindex_jobs")
    op.drop_index(op.f("ix_reindex_jobs_from_index_id"), table_name="reindex_jobs")
    op.drop_index(op.f("ix_reindex_jobs_tenant_id"), table_name="reindex_jobs")
    op.drop_table("reindex_jobs")
