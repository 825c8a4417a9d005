"""Data keys for the second KV tier, wrapped by the master key (`seal_keys`), and each tenant's
tier quota and reservation in bytes.

The two tenant columns are NULL for every tenant that exists before the upgrade: the default
(the quota: the pool quota's bytes, which the engine resolves; the reservation: none). Data
keys are made on first use, so none exists before the upgrade; a downgrade drops them all,
which makes whatever a tier still holds unreadable (a cache: it costs recomputation, never
data).

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "seal_keys",
        sa.Column("subject", sa.String(length=64), nullable=False),
        sa.Column("key_id", sa.String(length=64), nullable=False),
        sa.Column("wrapped", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("subject", name=op.f("pk_seal_keys")),
        sa.UniqueConstraint("key_id", name=op.f("uq_seal_keys_key_id")),
    )
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("tier_quota_bytes", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("tier_reservation_bytes", sa.BigInteger(), nullable=True))
        batch.create_check_constraint(
            op.f("ck_tenants_tier_quota_not_negative"),
            "(tier_quota_bytes IS NULL OR tier_quota_bytes >= 0) AND "
            "(tier_reservation_bytes IS NULL OR tier_reservation_bytes >= 0)",
        )
        batch.create_check_constraint(
            op.f("ck_tenants_tier_reservation_within_quota"),
            "tier_quota_bytes IS NULL OR tier_reservation_bytes IS NULL OR "
            "tier_reservation_bytes <= tier_quota_bytes",
        )


def downgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.drop_constraint(op.f("ck_tenants_tier_reservation_within_quota"), type_="check")
        batch.drop_constraint(op.f("ck_tenants_tier_quota_not_negative"), type_="check")
        batch.drop_column("tier_reservation_bytes")
        batch.drop_column("tier_quota_bytes")
    op.drop_table("seal_keys")
