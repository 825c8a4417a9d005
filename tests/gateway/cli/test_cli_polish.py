"""`prefixgate --version`, `prefixgate settings` and `serve --help`, through the real console
script: the settings list is generated from `Settings.model_fields`, so it cannot go stale."""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import pytest

from gateway.settings import Settings
from tests.support.cli import Cli


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    return Cli(f"sqlite:///{tmp_path / 'prefixgate.db'}", tmp_path / "state")


def test_version_prints_the_installed_version_without_reading_settings(cli: Cli) -> None:
    cli.env["PREFIXGATE_DATABASE_URL"] = "garbage"  # --version must not load settings
    assert cli.ok("--version") == f"prefixgate {version('prefixgate')}\n"


def test_settings_json_lists_every_field_in_order_with_its_variable(cli: Cli) -> None:
    listed = cli_json(cli)
    assert [entry["name"] for entry in listed] == list(Settings.model_fields)
    for entry in listed:
        field = Settings.model_fields[str(entry["name"])]
        assert entry["env"] == f"PREFIXGATE_{str(entry['name']).upper()}"
        assert entry["description"] == " ".join((field.description or "").split())
        if field.default_factory is None:  # factories: the next test
            assert entry["default"] == field.default
    assert all(entry["description"] for entry in listed)  # every setting says what it does


def test_settings_defaults_are_those_a_fresh_process_would_use(cli: Cli, tmp_path: Path) -> None:
    cli.env["XDG_STATE_HOME"] = str(tmp_path / "xdg")
    cli.env.pop("PREFIXGATE_STATE_DIR")
    defaults = {entry["name"]: entry["default"] for entry in cli_json(cli)}
    state_dir = tmp_path / "xdg" / "prefixgate"
    assert defaults["state_dir"] == str(state_dir)
    assert defaults["database_url"] == f"sqlite:///{state_dir / 'prefixgate.db'}"
    assert defaults["trusted_proxies"] == []
    assert defaults["port"] == 8000
    assert defaults["model_dir"] is None


def test_settings_text_shows_each_variable_with_its_default(cli: Cli) -> None:
    # Descriptions are indented under their variable; variable lines start with the prefix,
    # then the value in effect and where it comes from.
    lines = cli.ok("settings").splitlines()
    by_variable = dict(line.split(maxsplit=1) for line in lines if line.startswith("PREFIXGATE_"))
    assert list(by_variable) == [f"PREFIXGATE_{name.upper()}" for name in Settings.model_fields]
    assert by_variable["PREFIXGATE_PORT"] == "8000  (default)"
    assert by_variable["PREFIXGATE_ENABLE_PREFIX_CACHING"] == "true  (default)"
    assert by_variable["PREFIXGATE_MODEL_DIR"] == "(unset)  (default)"
    assert by_variable["PREFIXGATE_TRUSTED_PROXIES"] == "(empty)  (default)"


def test_settings_list_works_while_the_configuration_is_invalid(cli: Cli) -> None:
    cli.env["PREFIXGATE_PORT"] = "http"  # what someone looking up the settings may have
    listed = cli.ok("settings")
    assert "PREFIXGATE_PORT" in listed
    assert "    refused: Input should be a valid integer" in listed  # and it says what is wrong
    assert "setting port:" in cli.error("tenants", "list")  # others refuse it


def test_serve_help_says_settings_are_variables_and_points_to_their_list(cli: Cli) -> None:
    help_text = " ".join(cli.ok("serve", "--help").split())
    assert "Every setting is a PREFIXGATE_* environment variable" in help_text
    assert "`prefixgate settings` lists them all with the values in effect" in help_text


def cli_json(cli: Cli) -> list[dict[str, object]]:
    listed: list[dict[str, object]] = json.loads(cli.ok("settings", "--json"))
    return listed


@pytest.mark.parametrize(
    ("host", "base"),
    [
        ("0.0.0.0", "http://127.0.0.1:8000"),  # where it listens is not where a client goes
        ("::", "http://[::1]:8000"),
        ("127.0.0.1", "http://127.0.0.1:8000"),
        ("fd00::7", "http://[fd00::7]:8000"),
        ("gateway.internal", "http://gateway.internal:8000"),
    ],
)
def test_the_demo_banner_gives_an_address_a_client_can_use(host: str, base: str) -> None:
    from types import SimpleNamespace

    from gateway.cli.serve_command import _client_base

    assert _client_base(SimpleNamespace(host=host, port=8000)) == base
