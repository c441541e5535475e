"""Index aliases: a tenant's name for one index (name, version), moved atomically by one UPDATE.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-22 07:25:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "index_aliases",
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("index_id", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_index_aliases_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["index_id"], ["indexes.id"], name=op.f("fk_index_aliases_index_id_indexes"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("tenant_id", "name", name=op.f("pk_index_aliases")),
    )
    op.create_index(op.f("ix_index_aliases_index_id"), "index_aliases", ["index_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_index_aliases_index_id"), table_name="index_aliases")
    op.drop_table("index_aliases")
