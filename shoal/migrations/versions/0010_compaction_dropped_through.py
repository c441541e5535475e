"""How far the log's compactions dropped entries, apart from how far they reached.

`log_compactions.compacted_through` was both what the compaction sweep schedules by (how far runs reached) and
what time travel refuses seqs below. A run that dropped nothing (only merged small segments, or found nothing
to rewrite) moved it too, so time travel was refused over a log that was still whole; and a later run with a
lower bound (an index built from scratch holding the lowest watermark at 0) moved it back, so time travel
answered from a log whose superseded entries were gone. `dropped_through` is the highest bound of a run that
dropped entries, and only ever grows; time travel reads it. It is backfilled with `compacted_through`, the most
the runs before could have dropped below.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-27 05:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("log_compactions",
                  sa.Column("dropped_through", sa.BigInteger(), server_default="0", nullable=False))
    op.execute("UPDATE log_compactions SET dropped_through = compacted_through")


def downgrade() -> None:
    op.drop_column("log_compactions", "dropped_through")
