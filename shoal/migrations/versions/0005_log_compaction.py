"""Log compaction, retention and garbage collection: bookkeeping of compacted segments and of files to delete.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22 07:15:00
"""

from __future__ import annotations

import sqlalchemy as sa  # noqa: F401 - used once the schema changes land
from alembic import op  # noqa: F401

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
