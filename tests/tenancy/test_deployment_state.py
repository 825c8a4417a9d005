"""State belongs to the deployment, not the working directory; other secrets are refused."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from gateway.settings import Settings
from tenancy import api_keys
from tenancy.api_keys import VerifiedKey
from tenancy.deployment import SecretMismatch, fingerprint
from tenancy.models import SecretFingerprint
from tenancy.store import Store
from tests.support.cli import Cli


class CliIn(Cli):
    """`prefixgate` run from `directory` with exactly `env` (no test database or state)."""

    def __init__(self, directory: Path, env: dict[str, str]) -> None:
        super().__init__("unused", directory)
        self.env, self.directory = env, directory

    def run(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.executable, *args], input=stdin, capture_output=True, text=True,
            env=self.env, cwd=self.directory, timeout=120,
        )  # fmt: skip


def deployment_env(tmp_path: Path) -> dict[str, str]:
    """The environment of an operator who configured nothing but has an XDG state home."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXGATE_")}
    return {**env, "XDG_STATE_HOME": str(tmp_path / "xdg"), "HOME": str(tmp_path / "home")}


def test_the_cli_uses_the_same_state_from_any_working_directory(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    env = deployment_env(tmp_path)
    CliIn(one, env).ok("db", "upgrade")
    CliIn(one, env).ok("tenants", "create", "acme")
    elsewhere = CliIn(two, env)
    created = elsewhere.json("keys", "create", "--tenant", "acme")
    assert [t["slug"] for t in elsewhere.json("tenants", "list")] == ["acme"]
    assert elsewhere.ok("audit", "verify", "--database").startswith("ok:")
    assert list(one.iterdir()) == [] and list(two.iterdir()) == []  # nothing in the CWD
    state = tmp_path / "xdg" / "prefixgate"
    assert state.stat().st_mode & 0o777 == 0o700
    assert (state / "secrets.json").stat().st_mode & 0o777 == 0o600
    secrets = json.loads((state / "secrets.json").read_text())
    store = Store.open(
        f"sqlite:///{state / 'prefixgate.db'}", tmp_path / "spool",
        secrets["key_hash_secret"], secrets["audit_signing_key"],
    )  # fmt: skip
    with store.transaction() as session:  # the key works with the deployment's secret
        principal = api_keys.authenticate(session, created["key"], store.key_secret)
        assert isinstance(principal, VerifiedKey) and principal.tenant_slug == "acme"
    store.close()


def test_the_state_dir_follows_xdg_then_home_never_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [name for name in os.environ if name.startswith("PREFIXGATE_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    settings = Settings()
    assert settings.state_dir == tmp_path / "xdg" / "prefixgate"
    assert settings.database_url == f"sqlite:///{tmp_path / 'xdg' / 'prefixgate' / 'prefixgate.db'}"
    monkeypatch.setenv("XDG_STATE_HOME", "relative/is/invalid")  # the XDG spec: ignore it
    home_state = tmp_path / "home" / ".local" / "state" / "prefixgate"
    assert Settings().state_dir == home_state
    monkeypatch.setenv("PREFIXGATE_STATE_DIR", str(tmp_path / "elsewhere"))
    assert Settings().database_url == f"sqlite:///{tmp_path / 'elsewhere' / 'prefixgate.db'}"


def fingerprints(url: str, tmp_path: Path) -> dict[str, str]:
    store = Store.open(url, tmp_path / "peek.spool", "unused", "unused")
    with store.transaction() as session:
        rows = session.execute(select(SecretFingerprint.name, SecretFingerprint.fingerprint))
        recorded = {name: value for name, value in rows}
    store.close()
    return recorded


def test_other_secrets_are_refused_naming_the_secret_and_the_fix(
    database: str, tmp_path: Path
) -> None:
    deployment = Cli(database, tmp_path / "state")
    deployment.ok("tenants", "create", "acme")  # first use records the fingerprints
    recorded = fingerprints(database, tmp_path)
    assert recorded == {
        "key_hash_secret": fingerprint("cli-key-secret"),
        "audit_signing_key": fingerprint("cli-signing-key"),
    }
    assert not any("cli-" in value for value in recorded.values())  # never the secret itself

    other_key = Cli(database, tmp_path / "state")
    other_key.env["PREFIXGATE_KEY_HASH_SECRET"] = "another-key-secret"
    line = other_key.error("keys", "create", "--tenant", "acme")
    assert line.startswith("prefixgate: error: key_hash_secret is not the one this database")
    assert "set PREFIXGATE_KEY_HASH_SECRET" in line and "PREFIXGATE_STATE_DIR" in line

    other_signing = Cli(database, tmp_path / "state")
    other_signing.env["PREFIXGATE_AUDIT_SIGNING_KEY"] = "another-signing-key"
    line = other_signing.error("audit", "verify", "--database")
    assert "audit_signing_key is not the one" in line and "key_hash_secret" not in line

    generated = Cli(database, tmp_path / "another-state")  # secrets generated elsewhere
    del generated.env["PREFIXGATE_KEY_HASH_SECRET"], generated.env["PREFIXGATE_AUDIT_SIGNING_KEY"]
    line = generated.error("tenants", "list")
    assert "are not the ones" in line and str(tmp_path / "another-state" / "secrets.json") in line

    assert fingerprints(database, tmp_path) == recorded  # refused processes recorded nothing
    assert [t["slug"] for t in deployment.json("keys", "list", "--tenant", "acme")] == []


def test_open_store_raises_a_typed_mismatch_for_the_server(sqlite_url: str, tmp_path: Path) -> None:
    common: dict[str, Any] = {"database_url": sqlite_url, "state_dir": tmp_path / "state"}
    Settings(**common, key_hash_secret="first", audit_signing_key="signing").open_store().close()
    with pytest.raises(SecretMismatch) as raised:
        Settings(**common, key_hash_secret="second", audit_signing_key="signing").open_store()
    assert raised.value.names == ["key_hash_secret"]


def test_serve_refuses_other_secrets_in_one_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'prefixgate.db'}"
    deployment = Cli(url, tmp_path / "state")
    deployment.ok("db", "upgrade")
    deployment.ok("tenants", "create", "acme")
    intruder = Cli(url, tmp_path / "state")
    intruder.env["PREFIXGATE_KEY_HASH_SECRET"] = "another-key-secret"
    line = intruder.error("serve", "--port", "0")
    assert "key_hash_secret is not the one this database was set up with" in line


MASTER_KEY = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8"  # bytes 0..31, URL-safe base64


def test_the_master_key_is_held_to_the_database_where_data_keys_are_used(
    sqlite_url: str, tmp_path: Path
) -> None:
    common: dict[str, Any] = {
        "database_url": sqlite_url, "key_hash_secret": "k", "audit_signing_key": "s",
    }  # fmt: skip
    # The tier off and no master key given: a process in another state directory (a CLI run
    # elsewhere) records no master key, so it cannot lock the deployment's gateways out.
    Settings(**common, state_dir=tmp_path / "elsewhere").open_store().close()
    assert "master_key" not in fingerprints(sqlite_url, tmp_path)
    # The tier on: the generated key of the state directory is recorded on first use...
    tier_on = Settings(**common, state_dir=tmp_path / "state", kv_tier="disk")
    tier_on.open_store().close()
    generated = json.loads((tmp_path / "state" / "secrets.json").read_text())["master_key"]
    assert fingerprints(sqlite_url, tmp_path)["master_key"] == fingerprint(generated)
    assert tier_on.master_key_bytes() == base64.urlsafe_b64decode(generated + "=")
    # ...and a process with another one is refused, naming it and the fix.
    with pytest.raises(SecretMismatch) as raised:
        Settings(**common, state_dir=tmp_path / "elsewhere", kv_tier="disk").open_store()
    assert raised.value.names == ["master_key"]
    assert "set PREFIXGATE_MASTER_KEY" in str(raised.value)
    with pytest.raises(SecretMismatch):  # given, even with the tier off, it is checked
        Settings(**common, state_dir=tmp_path / "state", master_key=MASTER_KEY).open_store()
    given = Settings(**common, state_dir=tmp_path / "elsewhere", master_key=generated + "=")
    given.open_store().close()  # the same key, padded: the same fingerprint


@pytest.mark.parametrize(
    "bad", ["too-short", MASTER_KEY + "A", MASTER_KEY[:-1] + "!", "AAEC" * 11, " " * 43]
)
def test_a_bad_master_key_is_refused_in_one_line_that_never_shows_it(
    bad: str, tmp_path: Path
) -> None:
    cli = Cli(f"sqlite:///{tmp_path / 'prefixgate.db'}", tmp_path / "state")
    cli.env["PREFIXGATE_MASTER_KEY"] = bad
    line = cli.error("tenants", "list")
    assert line.startswith("prefixgate: error: setting master_key: the master key must be 32")
    assert "URL-safe base64" in line and (bad.strip() == "" or bad not in line)
