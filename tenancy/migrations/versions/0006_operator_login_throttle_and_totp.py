"""Operator login throttled per (name, source) instead of a lock on the account, and an
optional TOTP second factor per operator.

The account lock goes (`failed_logins`, `locked_until`): anybody could trigger it. Failed
logins are counted per (name as typed, source address) in `admin_login_failures`, keyed by a
digest. A downgrade brings the lock's columns back empty (no account locked).

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("admins") as batch:
        batch.drop_constraint(op.f("ck_admins_failed_logins_not_negative"), type_="check")
        batch.drop_column("locked_until")
        batch.drop_column("failed_logins")
        batch.add_column(sa.Column("totp_secret", sa.String(length=255), nullable=True))
        batch.add_column(sa.Column("totp_pending_secret", sa.String(length=255), nullable=True))
        batch.add_column(sa.Column("totp_last_step", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("totp_enabled_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "admin_login_failures",
        sa.Column("pair", sa.String(length=64), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("last_failed_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "failures >= 0", name=op.f("ck_admin_login_failures_failures_not_negative")
        ),
        sa.PrimaryKeyConstraint("pair", name=op.f("pk_admin_login_failures")),
    )
    op.create_index(
        op.f("ix_admin_login_failures_last_failed_at"), "admin_login_failures", ["last_failed_at"]
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_admin_login_failures_last_failed_at"), table_name="admin_login_failures")
    op.drop_table("admin_login_failures")
    with op.batch_alter_table("admins") as batch:
        batch.drop_column("totp_enabled_at")
        batch.drop_column("totp_last_step")
        batch.drop_column("totp_pending_secret")
        batch.drop_column("totp_secret")
        batch.add_column(
            sa.Column("failed_logins", sa.Integer(), nullable=False, server_default="0")
        )
        batch.add_column(sa.Column("locked_until", sa.DateTime(timezone=True), nullable=True))
        batch.create_check_constraint(
            op.f("ck_admins_failed_logins_not_negative"), "failed_logins >= 0"
        )
