"""`keys create --expires` and `keys list` tell the truth about when a key stops working:
through the real console script, on PostgreSQL and on the embedded SQLite default."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tenancy import api_keys
from tenancy.api_keys import AuthFailure, VerifiedKey
from tenancy.store import Store
from tests.support.cli import Cli


@pytest.mark.parametrize("expires", ["0d", "0h", "0s", "000m"])
def test_a_key_lifetime_of_zero_is_refused_not_made_eternal(
    expires: str, postgres_url: str, tmp_path: Path
) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    cli.ok("tenants", "create", "acme")
    line = cli.error("keys", "create", "--tenant", "acme", "--expires", expires)
    assert f"--expires: a key's lifetime must be longer than zero, got {expires!r}" in line
    assert cli.json("keys", "list", "--tenant", "acme") == []


def test_a_negative_key_lifetime_is_refused(postgres_url: str, tmp_path: Path) -> None:
    cli = Cli(postgres_url, tmp_path / "state")
    cli.ok("tenants", "create", "acme")
    assert "--expires: expected a duration" in cli.error(
        "keys", "create", "--tenant", "acme", "--expires=-1d"
    )
    assert cli.json("keys", "list", "--tenant", "acme") == []


def test_keys_list_shows_the_state_authentication_acts_on(database: str, tmp_path: Path) -> None:
    cli = Cli(database, tmp_path / "state")
    cli.ok("tenants", "create", "acme")

    def keys(*args: str) -> dict[str, str]:
        created: dict[str, str] = cli.json("keys", *args, "--tenant", "acme")
        return created

    plain = keys("create", "--name", "plain")
    revoked = keys("create", "--name", "revoked")
    cli.ok("keys", "revoke", "--tenant", "acme", revoked["key_id"])
    cut_over = keys("create", "--name", "cut-over")
    successor = keys("rotate", cut_over["key_id"], "--grace", "0s")  # no grace at all
    rotating = keys("create", "--name", "rotating")
    keys("rotate", rotating["key_id"], "--grace", "1h")
    short_lived = keys("create", "--name", "short-lived", "--expires", "1s")
    time.sleep(1.2)

    listed = {row["key_id"]: row["state"] for row in cli.json("keys", "list", "--tenant", "acme")}
    expected = {
        plain["key_id"]: "active",
        revoked["key_id"]: "revoked",
        cut_over["key_id"]: "expired",
        successor["key_id"]: "active",
        rotating["key_id"]: "rotating",
        short_lived["key_id"]: "expired",
    }
    assert {key_id: listed[key_id] for key_id in expected} == expected
    lines = cli.ok("keys", "list", "--tenant", "acme").splitlines()
    assert {line.split()[0]: line.split()[2] for line in lines} == listed

    # What the listing says is what a request presenting the key meets.
    store = Store.open(database, tmp_path / "spool", "cli-key-secret", "s", 100)
    with store.transaction() as session:
        for key in (plain, revoked, cut_over, successor, rotating, short_lived):
            outcome = api_keys.authenticate(session, key["key"], store.key_secret)
            state = expected[key["key_id"]]
            if state in ("active", "rotating"):
                assert isinstance(outcome, VerifiedKey), (state, outcome)
            else:
                assert outcome is AuthFailure(state), (state, outcome)
    store.close()
