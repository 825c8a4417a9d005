"""A scheduling weight per tenant: against other tenants with work, its share of the engine's
service is in proportion to it (1.0 for every tenant that exists before the upgrade).

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(
            sa.Column("scheduling_weight", sa.Float(), nullable=False, server_default="1.0")
        )
        batch.create_check_constraint(
            op.f("ck_tenants_scheduling_weight_range"),
            "scheduling_weight >= 0.01 AND scheduling_weight <= 100.0",
        )


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_constraint(op.f("ck_tenants_scheduling_weight_range"), type_="check")
        batch.drop_column("scheduling_weight")
