"""Log compaction, retention and garbage collection: bookkeeping of compacted segments and of files to delete.

- `log_segments.entry_count` allows fewer entries than seqs: a compacted segment still covers the seq range
  of the segments it replaced (so segments keep tiling 1..head), but holds only the entries that survived.
- `log_compactions`: per data source, how far the last compaction reached and what it did.
- `garbage_files`: files no catalog row references, queued for deletion after a grace period; the row stays
  with `deleted_at` set once the file is gone (the deletion log).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22 07:15:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

DENSE = "upsert_count + tombstone_count = last_seq - first_seq + 1"
SPARSE = "upsert_count + tombstone_count <= last_seq - first_seq + 1"


def upgrade() -> None:
    op.drop_constraint(op.f("ck_log_segments_entry_count"), "log_segments", type_="check")
    op.create_check_constraint(op.f("ck_log_segments_entry_count"), "log_segments", SPARSE)

    op.create_table(
        "log_compactions",
        sa.Column("data_source_id", sa.BigInteger(), nullable=False),
        sa.Column("compacted_through", sa.BigInteger(), nullable=False),
        sa.Column("compacted_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("runs", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("segments_before", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("segments_after", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("entries_dropped", sa.BigInteger(), server_default="0", nullable=False),
        sa.ForeignKeyConstraint(
            ["data_source_id"],
            ["data_sources.id"],
            name=op.f("fk_log_compactions_data_source_id_data_sources"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("data_source_id", name=op.f("pk_log_compactions")),
    )

    op.create_table(
        "garbage_files",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("reason", sa.String(length=40), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("delete_after", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_garbage_files")),
        sa.UniqueConstraint("path", name=op.f("uq_garbage_files_path")),
    )
    op.create_index(op.f("ix_garbage_files_delete_after"), "garbage_files", ["delete_after"], unique=False)


def downgrade() -> None:
    compacted = op.get_bind().execute(
        sa.text(f"SELECT count(*) FROM log_segments WHERE NOT ({DENSE})")
    ).scalar_one()
    if compacted:
        raise RuntimeError(
            f"{compacted} log segments were compacted (they hold fewer entries than seqs), which the older "
            "schema cannot express: downgrading would need the logs rewritten"
        )
    op.drop_index(op.f("ix_garbage_files_delete_after"), table_name="garbage_files")
    op.drop_table("garbage_files")
    op.drop_table("log_compactions")
    op.drop_constraint(op.f("ck_log_segments_entry_count"), "log_segments", type_="check")
    op.create_check_constraint(op.f("ck_log_segments_entry_count"), "log_segments", DENSE)
