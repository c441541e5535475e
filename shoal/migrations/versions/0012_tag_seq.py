"""The seq a tag stands for, so a tag on shards built to different seqs answers one state the log had.

`index_tags.seq` is the highest watermark among the versions the tag pinned: a search naming the tag answers
the log state at that seq, each shard from its pinned version plus the log between that version's watermark and
the seq (as an as_of search does). Tags taken before this revision have none and keep the old behaviour: each
shard answers at its own pinned version's watermark. Adding a nullable column without a default changes only
the catalog (no table rewrite), so the table's lock is held for a moment (and the migration's lock timeout
bounds the wait for it).

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-27 14:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("index_tags", sa.Column("seq", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("index_tags", "seq")
