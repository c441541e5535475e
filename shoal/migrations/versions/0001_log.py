"""The data-source log: tenants, data sources with their head, log segments, producer batches.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.create_table(
        "data_sources",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.BigInteger(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("version", sa.String(length=100), nullable=False),
        sa.Column("vector_dimension", sa.Integer(), nullable=False),
        sa.Column("vectors_are_sparse", sa.Boolean(), nullable=False),
        sa.Column("attribute_types", postgresql.JSON(astext_type=sa.Text()), nullable=False),
        sa.Column("permanent_attributes", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("description", sa.Text(), server_default="", nullable=False),
        sa.Column("custom_metadata", postgresql.JSONB(astext_type=sa.Text()), server_default="{}", nullable=False),
        sa.Column("head_seq", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("head_committed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("vector_dimension BETWEEN 1 AND 10000", name=op.f("ck_data_sources_dimension_range")),
        sa.CheckConstraint("head_seq >= 0", name=op.f("ck_data_sources_head_non_negative")),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_data_sources_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_data_sources")),
        sa.UniqueConstraint("tenant_id", "name", "version", name="uq_data_sources_tenant_name_version"),
    )
    op.create_index(op.f("ix_data_sources_tenant_id"), "data_sources", ["tenant_id"], unique=False)
    op.create_table(
        "log_segments",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("data_source_id", sa.BigInteger(), nullable=False),
        sa.Column("first_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.Column("upsert_count", sa.BigInteger(), nullable=False),
        sa.Column("tombstone_count", sa.BigInteger(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("checksum", sa.String(length=80), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("committed_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("last_seq >= first_seq", name=op.f("ck_log_segments_seq_range")),
        sa.CheckConstraint(
            "upsert_count + tombstone_count = last_seq - first_seq + 1", name=op.f("ck_log_segments_entry_count")
        ),
        sa.ForeignKeyConstraint(
            ["data_source_id"],
            ["data_sources.id"],
            name=op.f("fk_log_segments_data_source_id_data_sources"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_log_segments")),
        sa.UniqueConstraint("data_source_id", "first_seq", name="uq_log_segments_source_first_seq"),
        sa.UniqueConstraint("path", name=op.f("uq_log_segments_path")),
    )
    op.create_table(
        "producer_batches",
        sa.Column("data_source_id", sa.BigInteger(), nullable=False),
        sa.Column("batch_id", sa.String(length=200), nullable=False),
        sa.Column("first_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.Column("segment_id", sa.UUID(), nullable=False),
        sa.Column("committed_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(
            ["data_source_id"],
            ["data_sources.id"],
            name=op.f("fk_producer_batches_data_source_id_data_sources"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["segment_id"],
            ["log_segments.id"],
            name=op.f("fk_producer_batches_segment_id_log_segments"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("data_source_id", "batch_id", name=op.f("pk_producer_batches")),
    )
    op.create_index(op.f("ix_producer_batches_segment_id"), "producer_batches", ["segment_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_producer_batches_segment_id"), table_name="producer_batches")
    op.drop_table("producer_batches")
    op.drop_table("log_segments")
    op.drop_index(op.f("ix_data_sources_tenant_id"), table_name="data_sources")
    op.drop_table("data_sources")
    op.drop_table("tenants")
