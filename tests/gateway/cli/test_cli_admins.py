"""`prefixgate admins ...`: operators from the command line, every change audited."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pyotp
from sqlalchemy import select

from tenancy.db import make_engine
from tenancy.models import AuditEvent
from tests.support.cli import Cli

PASSWORD = "a long enough password\n"


def test_operators_are_created_listed_disabled_and_reset_from_the_cli(
    postgres_url: str, tmp_path: Path
) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    cli.ok("tenants", "create", "acme")
    cli.ok("admins", "create", "root", stdin=PASSWORD)
    bound = json.loads(
        cli.ok("admins", "create", "acme-ops", "--role", "tenant-admin", "--tenant", "acme",
               "--json", stdin=PASSWORD)
    )  # fmt: skip
    assert (bound["role"], bound["tenant"]) == ("tenant-admin", "acme")
    assert "needs a tenant" in cli.error(
        "admins", "create", "lost", "--role", "tenant-admin", stdin=PASSWORD
    )
    assert "at least one enabled admin" in cli.error("admins", "disable", "root")
    cli.ok("admins", "disable", "acme-ops")
    listed = {row["username"]: row for row in cli.json("admins", "list")}
    assert listed["acme-ops"]["disabled"] is True
    assert listed["root"]["disabled"] is False
    cli.ok("admins", "set-password", "root", stdin="a brand new password\n")
    assert "no operator named" in cli.error("admins", "enable", "nobody")
    cli.ok("audit", "verify", "--database")
    engine = make_engine(postgres_url)
    with engine.connect() as connection:
        events = connection.execute(
            select(AuditEvent.action, AuditEvent.outcome).where(
                AuditEvent.action.like("operator.%")  # the admin API's names for the same changes
            )
        ).all()
    engine.dispose()
    assert sorted(events) == sorted([
        ("operator.create", "success"), ("operator.create", "success"),
        ("operator.create", "failure"),
        ("operator.disable", "failure"), ("operator.disable", "success"),
        ("operator.set_password", "success"), ("operator.enable", "failure"),
    ])  # fmt: skip


def test_a_second_factor_is_enrolled_and_reset_from_the_cli(
    postgres_url: str, tmp_path: Path
) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    cli.ok("admins", "create", "root", stdin=PASSWORD)
    # The code is typed after the secret is shown: answer as an authenticator app would.
    enrol = subprocess.Popen(
        [cli.executable, "admins", "enrol-totp", "root"], env=cli.env, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert enrol.stdout is not None and enrol.stdin is not None
    secret = ""
    while not secret:
        line = enrol.stdout.readline()
        assert line, enrol.stderr.read() if enrol.stderr else "no secret shown"
        if line.strip().startswith("secret:"):
            secret = line.split(":", 1)[1].strip()
    enrol.stdin.write(pyotp.TOTP(secret).now() + "\n")
    enrol.stdin.close()
    assert enrol.wait(timeout=60) == 0
    assert "second factor enrolled" in enrol.stdout.read()
    listed = {row["username"]: row for row in cli.json("admins", "list")}
    assert listed["root"]["second_factor"] is True

    assert "second factor removed" in cli.ok("admins", "reset-totp", "root")
    assert "had no second factor" in cli.ok("admins", "reset-totp", "root")
    listed = {row["username"]: row for row in cli.json("admins", "list")}
    assert listed["root"]["second_factor"] is False
    assert "no operator named" in cli.error("admins", "reset-totp", "nobody")
    # A wrong code confirms nothing: the operator stays without a second factor.
    cli.run("admins", "enrol-totp", "root", stdin="000000\n")
    listed = {row["username"]: row for row in cli.json("admins", "list")}
    assert listed["root"]["second_factor"] is False
    cli.ok("audit", "verify", "--database")
