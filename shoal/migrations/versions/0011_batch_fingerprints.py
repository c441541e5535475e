"""A fingerprint of each producer batch, so a batch id reused with another batch is refused.

`producer_batches.fingerprint` is the sha256 of the batch's validated content (shoal.log.writer.batch_fingerprint).
A batch id that committed before answers a repeat with its token and writes nothing; with the fingerprint, a
different batch under the same id is refused instead of being answered as a repeat (its points were silently
lost). Rows committed before this revision have none and keep the old behaviour: any batch under their id is
taken for a repeat. Adding a nullable column without a default changes only the catalog (no table rewrite), so
the table's lock is held for a moment (and the migration's lock timeout bounds the wait for it).

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-27 11:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("producer_batches", sa.Column("fingerprint", sa.String(length=80), nullable=True))


def downgrade() -> None:
    op.drop_column("producer_batches", "fingerprint")
