"""GC's reads of `garbage_files` through indexes of their own rows: the queue (`deleted_at IS NULL`, by
`delete_after`) and the deletion log (`deleted_at IS NOT NULL`, by `deleted_at`).

The table holds both, and the log is most of it: a row per deleted file, kept 30 days (about 790 rows a minute
under a modest load of 150 points/s into 12 datasets). The one index, on `delete_after`, served neither read, so
every GC run scanned the whole table for its due files, the pending count and the log's pruning (183-195 ms each
at 2 million rows, growing with the log). Building the indexes holds off writes to the table (files queued by
compactions, prunes and drops) for as long as the build takes: 2.8 s at 2 million rows (measured here).

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-28 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_garbage_files_queued", "garbage_files", ["delete_after", "id"],
                    postgresql_where=sa.text("deleted_at IS NULL"))
    op.create_index("ix_garbage_files_deleted_at", "garbage_files", ["deleted_at"],
                    postgresql_where=sa.text("deleted_at IS NOT NULL"))
    op.drop_index("ix_garbage_files_delete_after", table_name="garbage_files")


def downgrade() -> None:
    op.create_index("ix_garbage_files_delete_after", "garbage_files", ["delete_after"])
    op.drop_index("ix_garbage_files_deleted_at", table_name="garbage_files")
    op.drop_index("ix_garbage_files_queued", table_name="garbage_files")
