"""Deployment state: secret fingerprints, the recorded KV pool, the tenancy change counter.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "secret_fingerprints",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_secret_fingerprints")),
    )
    deployment = op.create_table(
        "deployment",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("pool_blocks", sa.Integer(), nullable=True),
        sa.Column("pool_recorded_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint("id = 1", name=op.f("ck_deployment_single_row")),
        sa.CheckConstraint(
            "pool_blocks IS NULL OR pool_blocks > 0", name=op.f("ck_deployment_pool_positive")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_deployment")),
    )
    # One row each, from the start: writers update it and never have to race to create it.
    op.bulk_insert(deployment, [{"id": 1, "pool_blocks": None, "pool_recorded_at": None}])
    tenancy_changes = op.create_table(
        "tenancy_changes",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("id = 1", name=op.f("ck_tenancy_changes_single_row")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenancy_changes")),
    )
    op.bulk_insert(tenancy_changes, [{"id": 1, "seq": 0}])


def downgrade() -> None:
    op.drop_table("tenancy_changes")
    op.drop_table("deployment")
    op.drop_table("secret_fingerprints")
