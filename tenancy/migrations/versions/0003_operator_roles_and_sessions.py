"""Operator accounts for the console: tenant-admin operators, login lockout, admin sessions.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("admins") as batch:
        batch.add_column(sa.Column("tenant_id", sa.Uuid(), nullable=True))
        batch.add_column(
            sa.Column("failed_logins", sa.Integer(), nullable=False, server_default="0")
        )
        batch.add_column(sa.Column("locked_until", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(
            sa.Column("password_changed_at", sa.DateTime(timezone=True), nullable=True)
        )
        batch.create_foreign_key(
            op.f("fk_admins_tenant_id_tenants"),
            "tenants",
            ["tenant_id"],
            ["id"],
            ondelete="CASCADE",
        )
        batch.create_index(op.f("ix_admins_tenant_id"), ["tenant_id"])
        batch.drop_constraint(op.f("ck_admins_role"), type_="check")
        batch.create_check_constraint(op.f("ck_admins_role"), "role IN ('admin', 'tenant-admin')")
        batch.create_check_constraint(
            op.f("ck_admins_tenant_matches_role"),
            "(role = 'admin' AND tenant_id IS NULL) OR "
            "(role = 'tenant-admin' AND tenant_id IS NOT NULL)",
        )
        batch.create_check_constraint(
            op.f("ck_admins_failed_logins_not_negative"), "failed_logins >= 0"
        )
    op.create_table(
        "admin_sessions",
        sa.Column("jti", sa.String(length=64), nullable=False),
        sa.Column("admin_id", sa.Uuid(), nullable=False),
        sa.Column("issued_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["admin_id"],
            ["admins.id"],
            name=op.f("fk_admin_sessions_admin_id_admins"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("jti", name=op.f("pk_admin_sessions")),
    )
    op.create_index(op.f("ix_admin_sessions_admin_id"), "admin_sessions", ["admin_id"])
    op.create_index(op.f("ix_admin_sessions_expires_at"), "admin_sessions", ["expires_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_admin_sessions_expires_at"), table_name="admin_sessions")
    op.drop_index(op.f("ix_admin_sessions_admin_id"), table_name="admin_sessions")
    op.drop_table("admin_sessions")
    op.execute("DELETE FROM admins WHERE role <> 'admin'")
    with op.batch_alter_table("admins") as batch:
        batch.drop_constraint(op.f("ck_admins_failed_logins_not_negative"), type_="check")
        batch.drop_constraint(op.f("ck_admins_tenant_matches_role"), type_="check")
        batch.drop_constraint(op.f("ck_admins_role"), type_="check")
        batch.create_check_constraint(op.f("ck_admins_role"), "role = 'admin'")
        batch.drop_index(op.f("ix_admins_tenant_id"))
        batch.drop_constraint(op.f("fk_admins_tenant_id_tenants"), type_="foreignkey")
        batch.drop_column("password_changed_at")
        batch.drop_column("locked_until")
        batch.drop_column("failed_logins")
        batch.drop_column("tenant_id")
