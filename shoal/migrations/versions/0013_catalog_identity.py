"""The catalog's identity: one row holding a random uuid, made once, so a storage can name the catalog it is of.

Every process that opens the storage checks the marker object at its root (`shoal-catalog.json`, see
shoal.storage.identity) against this id, and writes it when absent; garbage collection deletes nothing unless
the marker names this catalog. So a process pointed at another deployment's storage is refused at start,
instead of taking every file there for unreferenced. The uuid is made here, in Python, so every catalog migrated
by this revision gets its own, and kept by a dump and restore of the catalog. A downgrade past this revision
forgets it: upgraded again, the catalog has a new id and its storage's marker must be removed by hand (the
README says how). Creating a new table takes no lock any live query holds.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-28 10:00:00
"""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table(
        "catalog_identity",
        sa.Column("one", sa.Boolean(), server_default=sa.text("true"), nullable=False),
        sa.Column("id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("one", name=op.f("ck_catalog_identity_one_row")),
        sa.PrimaryKeyConstraint("one", name=op.f("pk_catalog_identity")),
    )
    op.bulk_insert(table, [{"one": True, "id": uuid.uuid4()}])


def downgrade() -> None:
    op.drop_table("catalog_identity")
