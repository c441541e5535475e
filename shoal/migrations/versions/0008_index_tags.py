"""Index tags: pinned index versions for time travel (kept by version pruning, searchable by name).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-22 07:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "index_tags",
        sa.Column("index_id", sa.BigInteger(), nullable=False),
        sa.Column("tag", sa.String(length=100), nullable=False),
        sa.Column("versions", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(
            ["index_id"], ["indexes.id"], name=op.f("fk_index_tags_index_id_indexes"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("index_id", "tag", name=op.f("pk_index_tags")),
    )


def downgrade() -> None:
    op.drop_table("index_tags")
