"""One deletion path: index files referenced from a table, and the trash purge's list folded into the GC queue.

`index_files` names every file an index version references (one row per version and path, deleted with the
version by cascade), so GC's reference check is a join instead of a scan of manifests. It is backfilled here
from the existing manifests, with the same rule as `shoal.index.segment.segment_files` (written out in SQL, so
this migration keeps meaning what it meant when the code moves on): per segment entry its `rows.parquet`, one
engine file per split, and its deletion file when it has one.

`trash_files` goes: the purge now deletes rows and queues their files into `garbage_files` in one transaction.
Pending file entries move into the queue, due at once (their rows are gone for good); folder entries (index
segment folders, a purged source's trash folder) are not moved: GC's scan of the index and trash folders finds
their files unreferenced and queues them.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

BACKFILL = """
INSERT INTO index_files (version_id, path)
SELECT DISTINCT v.id, f.path
FROM index_versions AS v
CROSS JOIN LATERAL jsonb_array_elements(COALESCE(v.manifest -> 'segments', '[]'::jsonb)) AS seg(entry)
CROSS JOIN LATERAL (
    SELECT (seg.entry ->> 'dir') || '/rows.parquet'
    UNION ALL
    -- the keys file, which later entries carry (a downgrade below this revision and an upgrade again backfill
    -- them: left out, GC deleted the keys files of live versions and every later build of the shard failed)
    SELECT (seg.entry ->> 'dir') || '/keys.parquet' WHERE COALESCE(seg.entry ->> 'keys_checksum', '') <> ''
    UNION ALL
    SELECT (seg.entry ->> 'dir') || '/' || (split.value ->> 'file')
    FROM jsonb_array_elements(COALESCE(seg.entry -> 'splits', '[]'::jsonb)) AS split(value)
    UNION ALL
    SELECT seg.entry -> 'deleted' ->> 'path' WHERE jsonb_typeof(seg.entry -> 'deleted') = 'object'
) AS f(path)
WHERE f.path IS NOT NULL
"""

MOVE_TRASH_FILES = """
INSERT INTO garbage_files (path, reason, delete_after)
SELECT DISTINCT path, 'trash-purged', now() FROM trash_files WHERE NOT is_dir
ON CONFLICT (path) DO NOTHING
"""


def upgrade() -> None:
    op.create_table(
        "index_files",
        sa.Column("version_id", sa.BigInteger(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["version_id"], ["index_versions.id"], name=op.f("fk_index_files_version_id_index_versions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("version_id", "path", name=op.f("pk_index_files")),
    )
    op.execute(BACKFILL)
    # Built after the backfill: one sort instead of an index update per row.
    op.create_index(op.f("ix_index_files_path"), "index_files", ["path"], unique=False)
    op.execute(MOVE_TRASH_FILES)
    op.drop_table("trash_files")


def downgrade() -> None:
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
    # Files queued by drops and purges stay in `garbage_files`; the older GC still deletes them, but it checks
    # index references by manifest again, and it does not scan index folders.
    op.drop_index(op.f("ix_index_files_path"), table_name="index_files")
    op.drop_table("index_files")
