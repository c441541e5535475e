"""Indexes, their shards (active pointer, freshness, lease) and immutable versions.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 03:18:07.066109
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "indexes",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("data_source_id", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("version", sa.String(length=100), nullable=False),
        sa.Column("algorithm", sa.String(length=40), nullable=False),
        sa.Column("metric", sa.String(length=40), nullable=False),
        sa.Column("params", postgresql.JSONB(astext_type=sa.Text()), server_default="{}", nullable=False),
        sa.Column("id_attributes", postgresql.JSON(astext_type=sa.Text()), nullable=False),
        sa.Column("split_attributes", postgresql.JSON(astext_type=sa.Text()), nullable=False),
        sa.Column("shard_attributes", postgresql.JSON(astext_type=sa.Text()), nullable=False),
        sa.Column("payload_attributes", postgresql.JSON(astext_type=sa.Text()), nullable=False),
        sa.Column("shard_count", sa.Integer(), nullable=False),
        sa.Column("generation", sa.Integer(), server_default="1", nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("shard_count BETWEEN 1 AND 1024", name=op.f("ck_indexes_shard_count_range")),
        sa.ForeignKeyConstraint(
            ["data_source_id"],
            ["data_sources.id"],
            name=op.f("fk_indexes_data_source_id_data_sources"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_indexes_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_indexes")),
        sa.UniqueConstraint("tenant_id", "name", "version", name="uq_indexes_tenant_name_version"),
    )
    op.create_index(op.f("ix_indexes_data_source_id"), "indexes", ["data_source_id"], unique=False)
    op.create_index(op.f("ix_indexes_tenant_id"), "indexes", ["tenant_id"], unique=False)
    op.create_table(
        "index_shards",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("index_id", sa.BigInteger(), nullable=False),
        sa.Column("shard_no", sa.Integer(), nullable=False),
        sa.Column("active_version_id", sa.BigInteger(), nullable=True),
        sa.Column("built_watermark", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("served_watermark", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("served_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lease_owner", sa.String(length=200), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["index_id"], ["indexes.id"], name=op.f("fk_index_shards_index_id_indexes"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_index_shards")),
        sa.UniqueConstraint("index_id", "shard_no", name="uq_index_shards_index_shard_no"),
    )
    op.create_table(
        "index_versions",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("shard_id", sa.BigInteger(), nullable=False),
        sa.Column("parent_id", sa.BigInteger(), nullable=True),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("watermark", sa.BigInteger(), nullable=False),
        sa.Column("manifest", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(
            ["shard_id"], ["index_shards.id"], name=op.f("fk_index_versions_shard_id_index_shards"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_index_versions")),
    )
    op.create_index(op.f("ix_index_versions_shard_id"), "index_versions", ["shard_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_index_versions_shard_id"), table_name="index_versions")
    op.drop_table("index_versions")
    op.drop_table("index_shards")
    op.drop_index(op.f("ix_indexes_tenant_id"), table_name="indexes")
    op.drop_index(op.f("ix_indexes_data_source_id"), table_name="indexes")
    op.drop_table("indexes")
