"""Soft-deleted data sources (datasets): when they went to the trash and when they are purged.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 07:15:00
"""

from __future__ import annotations

import sqlalchemy as sa  # noqa: F401 - used once the schema changes land
from alembic import op  # noqa: F401

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
