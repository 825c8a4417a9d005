"""The gateways serving a database, as each reports itself every few seconds.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "gateway_instances",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("hostname", sa.String(length=255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("limits_store", sa.String(length=64), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gateway_instances")),
    )
    op.create_index(
        op.f("ix_gateway_instances_seen_at"), "gateway_instances", ["seen_at"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_gateway_instances_seen_at"), table_name="gateway_instances")
    op.drop_table("gateway_instances")
