"""What an operator meets first: `prefixgate settings` shows the value each setting has here and
where it comes from (never a secret), `serve --help` and `worker --help` show the defaults in
effect, and bad input is one line. All through the real console script."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gateway.settings import default_state_dir
from tests.support.cli import Cli

DB_PASSWORD = "db-pa55word-never-shown"
JWT_SECRET = "jwt-secret-never-shown"
DOTENV_SECRET = "worker-secret-from-dotenv-never-shown"


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    return Cli(f"sqlite:///{tmp_path / 'prefixgate.db'}", tmp_path / "state")


def run_in(cli: Cli, directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The console script run from `directory`, where it reads `directory/.env`."""
    return subprocess.run(
        [cli.executable, *args], capture_output=True, text=True, env=cli.env, cwd=directory,
        timeout=120,
    )  # fmt: skip


def listed(completed: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    assert completed.returncode == 0, completed.stderr
    entries: list[dict[str, Any]] = json.loads(completed.stdout)
    return {entry["name"]: entry for entry in entries}


def text_lines(completed: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """Each variable's line of `prefixgate settings`, after the variable's name."""
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    return dict(line.split(maxsplit=1) for line in lines if line.startswith("PREFIXGATE_"))


def test_settings_show_the_value_in_effect_and_the_variable_it_came_from(
    cli: Cli, tmp_path: Path
) -> None:
    state_dir = tmp_path / "state"  # Cli exports PREFIXGATE_STATE_DIR
    cli.env["PREFIXGATE_MAX_NUM_SEQS"] = "7"
    by_variable = text_lines(cli.run("settings"))
    default = default_state_dir()
    assert by_variable["PREFIXGATE_STATE_DIR"] == (
        f"{state_dir}  (from PREFIXGATE_STATE_DIR; default: {default})"
    )
    assert (
        by_variable["PREFIXGATE_MAX_NUM_SEQS"] == "7  (from PREFIXGATE_MAX_NUM_SEQS; default: 64)"
    )
    assert by_variable["PREFIXGATE_BLOCK_SIZE"] == "16  (default)"

    settings = listed(cli.run("settings", "--json"))
    assert settings["state_dir"] | {"description": ""} == {
        "name": "state_dir", "env": "PREFIXGATE_STATE_DIR", "value": str(state_dir),
        "source": "PREFIXGATE_STATE_DIR", "default": str(default), "secret": False,
        "error": None, "description": "",
    }  # fmt: skip
    assert (settings["max_num_seqs"]["value"], settings["max_num_seqs"]["default"]) == (7, 64)
    assert (settings["block_size"]["value"], settings["block_size"]["source"]) == (16, "default")


def test_a_default_that_follows_another_setting_follows_its_value_in_effect(
    cli: Cli, tmp_path: Path
) -> None:
    del cli.env["PREFIXGATE_DATABASE_URL"]  # the default: SQLite in the state directory
    database = listed(cli.run("settings", "--json"))["database_url"]
    expected = f"sqlite:///{tmp_path / 'state' / 'prefixgate.db'}"
    assert (database["value"], database["source"], database["default"]) == (
        expected,
        "default",
        expected,
    )


def test_dotenv_values_name_their_file_and_the_environment_wins_over_them(
    cli: Cli, tmp_path: Path
) -> None:
    (tmp_path / ".env").write_text("PREFIXGATE_HOST=0.0.0.0\nPREFIXGATE_PORT=9100\n")
    cli.env["PREFIXGATE_PORT"] = "9200"
    settings = listed(run_in(cli, tmp_path, "settings", "--json"))
    assert (settings["host"]["value"], settings["host"]["source"]) == (
        "0.0.0.0",
        str(tmp_path / ".env"),
    )
    assert (settings["port"]["value"], settings["port"]["source"]) == (9200, "PREFIXGATE_PORT")
    by_variable = text_lines(run_in(cli, tmp_path, "settings"))
    assert by_variable["PREFIXGATE_HOST"] == (
        f"0.0.0.0  (from {tmp_path / '.env'}; default: 127.0.0.1)"
    )


def test_secrets_show_only_whether_and_where_they_are_set(cli: Cli, tmp_path: Path) -> None:
    cli.env["PREFIXGATE_JWT_SECRET"] = JWT_SECRET
    cli.env["PREFIXGATE_DATABASE_URL"] = f"postgresql+psycopg://app:{DB_PASSWORD}@db:5432/pg"
    cli.env["PREFIXGATE_REDIS_URL"] = f"redis://:{DB_PASSWORD}@redis:6379/0"
    (tmp_path / ".env").write_text(f"PREFIXGATE_WORKER_SECRET={DOTENV_SECRET}\n")
    text = run_in(cli, tmp_path, "settings")
    as_json = run_in(cli, tmp_path, "settings", "--json")
    for completed in (text, as_json):
        output = completed.stdout + completed.stderr
        for secret in (JWT_SECRET, DB_PASSWORD, DOTENV_SECRET, "cli-key-secret"):
            assert secret not in output

    settings = listed(as_json)
    assert settings["jwt_secret"] | {"description": ""} == {
        "name": "jwt_secret", "env": "PREFIXGATE_JWT_SECRET", "value": "(set, hidden)",
        "source": "PREFIXGATE_JWT_SECRET", "default": None, "secret": True, "error": None,
        "description": "",
    }  # fmt: skip
    assert settings["worker_secret"]["source"] == str(tmp_path / ".env")
    assert (settings["metrics_token"]["value"], settings["metrics_token"]["source"]) == (
        None,
        "default",
    )
    assert settings["database_url"]["value"] == "postgresql+psycopg://app:***@db:5432/pg"
    assert settings["redis_url"]["value"] == "redis://:***@redis:6379/0"
    by_variable = text_lines(text)
    assert by_variable["PREFIXGATE_JWT_SECRET"] == (
        "(set, hidden)  (from PREFIXGATE_JWT_SECRET; default: (unset))"
    )
    assert by_variable["PREFIXGATE_METRICS_TOKEN"] == "(unset)  (default)"


@pytest.mark.parametrize(
    ("setting", "value", "shown_as"),
    [
        # Passwords the clients take with `/`, `#` or `?` in them (urlsplit would cut them).
        (
            "DATABASE_URL",
            "postgresql+psycopg://app:s3cr/et@db/pg",
            "postgresql+psycopg://app:***@db/pg",
        ),
        (
            "DATABASE_URL",
            "postgresql+psycopg://app:p#w?x@db/pg",
            "postgresql+psycopg://app:***@db/pg",
        ),
        ("REDIS_URL", "redis://h:6379/0?password=topsecret", "redis://h:6379/0?password=***"),
        ("REDIS_URL", "redis://tokenonly@h:6379/0", "redis://***@h:6379/0"),
    ],
)
def test_a_password_in_a_url_is_hidden_whatever_it_holds(
    cli: Cli, tmp_path: Path, setting: str, value: str, shown_as: str
) -> None:
    cli.env[f"PREFIXGATE_{setting}"] = value
    completed = run_in(cli, tmp_path, "settings", "--json")
    assert listed(completed)[setting.lower()]["value"] == shown_as
    for secret in ("s3cr/et", "p#w?x", "topsecret", "tokenonly"):
        assert secret not in completed.stdout + completed.stderr


def test_serve_help_hides_a_workers_password(cli: Cli, tmp_path: Path) -> None:
    cli.env["PREFIXGATE_WORKERS"] = "https://u:p#w@h1:1,https://h2:2"
    serve = help_of(run_in(cli, tmp_path, "serve", "--help"))
    assert "p#w" not in serve
    assert squeezed("https://u:***@h1:1,https://h2:2, from PREFIXGATE_WORKERS") in serve


def test_a_refused_value_is_shown_with_its_reason_and_a_refused_secret_stays_hidden(
    cli: Cli,
) -> None:
    cli.env["PREFIXGATE_PORT"] = "http"
    cli.env["PREFIXGATE_WORKER_SECRET"] = "short-secret"  # under 16 characters
    cli.env["PREFIXGATE_MAX_NUM_SEQS"] = "7"  # valid: still shown as validated
    completed = cli.run("settings", "--json")
    assert "short-secret" not in completed.stdout + completed.stderr
    settings = listed(completed)
    assert (settings["port"]["value"], settings["port"]["error"]) == (
        "http",
        "Input should be a valid integer, unable to parse string as an integer",
    )
    assert settings["worker_secret"]["value"] == "(set, hidden)"
    assert settings["worker_secret"]["error"] == "the worker secret must be at least 16 characters"
    assert (settings["max_num_seqs"]["value"], settings["max_num_seqs"]["error"]) == (7, None)


def test_a_rule_across_settings_is_one_warning_line_and_the_values_still_show(
    cli: Cli, tmp_path: Path
) -> None:
    cli.env["PREFIXGATE_WORKER_TLS_CERT"] = str(tmp_path / "tls.crt")  # without its key and CA
    completed = cli.run("settings", "--json")
    assert completed.returncode == 0
    assert completed.stderr.splitlines() == [
        "prefixgate: warning: settings: worker TLS needs a certificate, its key and the CA "
        "together: set PREFIXGATE_WORKER_TLS_CA and PREFIXGATE_WORKER_TLS_KEY"
    ]
    assert listed(completed)["worker_tls_cert"]["value"] == str(tmp_path / "tls.crt")


def test_serve_and_worker_help_show_the_defaults_in_effect(cli: Cli, tmp_path: Path) -> None:
    serve = help_of(run_in(cli, tmp_path, "serve", "--help"))
    assert squeezed("Interface to listen on.  [default: 127.0.0.1]") in serve
    assert squeezed("Port to listen on.  [default: 8000]") in serve
    worker = help_of(run_in(cli, tmp_path, "worker", "--help"))
    assert squeezed("Interface to listen on.  [default: 127.0.0.1]") in worker
    assert (
        squeezed("PREFIXGATE_PORT is the gateway's and does not apply).  [default: 8001]") in worker
    )

    (tmp_path / ".env").write_text("PREFIXGATE_HOST=0.0.0.0\n")
    cli.env["PREFIXGATE_PORT"] = "9200"
    cli.env["PREFIXGATE_MODEL_DIR"] = str(tmp_path / "model")
    serve = help_of(run_in(cli, tmp_path, "serve", "--help"))
    assert squeezed(f"Interface to listen on.  [default: 0.0.0.0, from {tmp_path}/.env]") in serve
    assert squeezed("Port to listen on.  [default: 9200, from PREFIXGATE_PORT]") in serve
    assert squeezed(f"[default: {tmp_path}/model, from PREFIXGATE_MODEL_DIR]") in serve
    worker = help_of(run_in(cli, tmp_path, "worker", "--help"))
    assert squeezed(f"Interface to listen on.  [default: 0.0.0.0, from {tmp_path}/.env]") in worker
    assert squeezed("does not apply).  [default: 8001]") in worker  # the worker's own port


def test_first_help_pages_answer_without_settings_or_a_database(cli: Cli) -> None:
    cli.env["PREFIXGATE_DATABASE_URL"] = "garbage"  # help needs neither
    root = help_of(cli.run("--help"))
    # Each command's line whole, not cut off with "...".
    assert (
        squeezed("settings  List every setting with its value in effect, source and default.")
        in root
    )
    assert squeezed("demo  Chat as three users of two tenants through the prefix cache.") in root
    settings = help_of(cli.run("settings", "--help"))
    assert squeezed("the value in effect here and where it comes from") in settings
    assert squeezed("--json  Print one JSON array.") in settings


def test_a_dotenv_that_is_not_text_is_one_line_and_help_still_answers(
    cli: Cli, tmp_path: Path
) -> None:
    (tmp_path / ".env").write_bytes(b"PREFIXGATE_HOST=\xff\xfe\n")
    for args in (["settings"], ["tenants", "list"], ["serve"]):
        completed = run_in(cli, tmp_path, *args)
        assert completed.returncode == 2, args
        assert completed.stderr.splitlines() == [
            "prefixgate: error: cannot read .env in the working directory: not UTF-8 text at "
            "byte 16"
        ], args
    assert squeezed("--host <str>  Interface to listen on.") in help_of(
        run_in(cli, tmp_path, "serve", "--help")
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["settings", "--bogus"], "No such option: --bogus (see `prefixgate settings --help`)"),
        (["settings", "extra"], "Got unexpected extra argument(s) (extra)"),
        (["serve", "--port", "abc"], "Invalid value for '--port'"),
        (["serve", "--port", "99999"], "setting port: Input should be less than or equal to"),
        (["serve", "--host"], "Option '--host' requires an argument"),
        (["worker", "--port", "-1"], "setting port: Input should be greater than or equal to 0"),
        (["demo", "--model", "/nonexistent"], "/nonexistent is not a model directory"),
        (["--bogus"], "No such option: --bogus (see `prefixgate --help`)"),
    ],
)
def test_bad_input_to_first_commands_is_one_line(cli: Cli, args: list[str], message: str) -> None:
    cli.env["PREFIXGATE_WORKER_SECRET"] = "w" * 16  # so that `worker` reaches its port
    cli.env["PREFIXGATE_WORKER_SIGNING_KEY"] = "k" * 32
    line = cli.error(*args)
    assert line.startswith("prefixgate: error: ") and message in line, line


def help_of(completed: subprocess.CompletedProcess[str]) -> str:
    """A help page without its whitespace: wrapping breaks long paths anywhere."""
    assert completed.returncode == 0, completed.stderr
    return squeezed(completed.stdout)


def squeezed(text: str) -> str:
    return "".join(text.split())


MASTER_KEY = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8"  # bytes 0..31, URL-safe base64


def test_the_master_key_is_masked_and_the_tier_settings_show_their_defaults(
    cli: Cli, tmp_path: Path
) -> None:
    cli.env["PREFIXGATE_MASTER_KEY"] = MASTER_KEY
    cli.env["PREFIXGATE_REDIS_URL"] = f"redis://:{DB_PASSWORD}@redis:6379/0"
    cli.env["PREFIXGATE_KV_TIER"] = "redis"  # its Redis: the gateway's, by default
    text, as_json = cli.run("settings"), cli.run("settings", "--json")
    for completed in (text, as_json):
        output = completed.stdout + completed.stderr
        assert MASTER_KEY not in output and DB_PASSWORD not in output
        assert "warning" not in completed.stderr  # the redis tier has a Redis
    settings = listed(as_json)
    assert (settings["master_key"]["value"], settings["master_key"]["secret"]) == (
        "(set, hidden)",
        True,
    )
    assert settings["kv_tier"]["value"] == "redis"
    assert settings["kv_tier_capacity_bytes"]["default"] == 4 << 30
    assert settings["kv_tier_dir"]["value"] is None  # <state_dir>/kv-tier, said its help
    assert settings["public_tier_quota_bytes"]["value"] is None
    assert "kv-tier" in settings["kv_tier_dir"]["description"]
    assert text_lines(text)["PREFIXGATE_MASTER_KEY"] == (
        "(set, hidden)  (from PREFIXGATE_MASTER_KEY; default: (unset))"
    )

    cli.env["PREFIXGATE_MASTER_KEY"] = MASTER_KEY[:-2]  # too short: refused, still hidden
    del cli.env["PREFIXGATE_REDIS_URL"]  # the redis tier without a Redis: refused
    completed = cli.run("settings", "--json")
    assert MASTER_KEY[:-2] not in completed.stdout + completed.stderr
    refused = listed(completed)["master_key"]
    assert refused["value"] == "(set, hidden)" and "URL-safe base64" in refused["error"]
    assert completed.stderr.splitlines() == [
        "prefixgate: warning: settings: kv_tier redis needs a Redis: set "
        "PREFIXGATE_KV_TIER_REDIS_URL or PREFIXGATE_REDIS_URL"
    ]


def test_tier_settings_follow_the_state_directory_and_the_gateways_redis() -> None:
    from gateway.settings import Settings

    settings = Settings(state_dir=Path("/srv/pg"), redis_url="redis://r:6379/0")
    assert settings.tier_dir == Path("/srv/pg/kv-tier")
    assert settings.tier_redis_url == "redis://r:6379/0"
    assert settings.uses_master_key is False
    own = Settings(kv_tier="redis", kv_tier_redis_url="rediss://t:6380/1", kv_tier_dir="/d")
    assert (own.tier_redis_url, own.tier_dir, own.uses_master_key) == (
        "rediss://t:6380/1", Path("/d"), True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="expected redis://"):
        Settings(kv_tier_redis_url="http://t:6380")
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        Settings(kv_tier_capacity_bytes=0)
