"""Every way to hand the CLI bad input or a bad environment: one line, a non-zero exit, no
traceback (`Cli.error` checks all three), through the real console script on PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.cli import Cli

LONG = "x" * 201
NO_DRIVER = "postgresql+psycopg2://postgres@127.0.0.1/postgres"
NOBODY_LISTENS = "postgresql+psycopg://postgres@127.0.0.1:1/postgres"

# (case, environment overrides, arguments, exit code, what the line says)
CASES: list[tuple[str, dict[str, str], list[str], int, str]] = [
    ("garbage database url", {"PREFIXGATE_DATABASE_URL": "garbage"}, ["tenants", "list"], 2,
     "setting database_url: not a database URL"),
    ("unsupported database", {"PREFIXGATE_DATABASE_URL": "mysql://x"}, ["tenants", "list"], 2,
     "setting database_url: mysql is not supported"),
    ("driver not installed", {"PREFIXGATE_DATABASE_URL": NO_DRIVER}, ["db", "upgrade"], 2,
     "database driver 'postgresql+psycopg2' is not installed"),
    ("database unreachable", {"PREFIXGATE_DATABASE_URL": NOBODY_LISTENS}, ["tenants", "list"],
     2, "cannot reach the database"),
    ("bad setting for serve", {"PREFIXGATE_PORT": "http"}, ["serve"], 2, "setting port:"),
    ("step target not a number", {"PREFIXGATE_STEP_TARGET_MS": "nan"}, ["serve"], 2,
     "setting step_target_ms: Input should be a finite number"),
    ("step target under a millisecond", {"PREFIXGATE_STEP_TARGET_MS": "0.0001"}, ["serve"], 2,
     "setting step_target_ms: Input should be greater than or equal to 1"),
    ("201-character display name", {}, ["tenants", "create", "big", "--name", LONG], 2,
     "display_name must be at most 200 characters (got 201)"),
    ("201-character key name", {}, ["keys", "create", "--tenant", "acme", "--name", LONG], 2,
     "name must be at most 200 characters (got 201)"),
    ("expiry past the calendar", {}, ["keys", "create", "--tenant", "acme", "--expires",
     "99999999999d"], 2, "--expires: 99999999999d is too long"),
    ("grace past the calendar", {}, ["keys", "rotate", "--tenant", "acme", "x", "--grace",
     "9999999999h"], 2, "--grace: 9999999999h is too long"),
    ("negative quota", {}, ["tenants", "set-quota", "acme", "--quota", "-5"], 2,
     "cache quota must not be negative"),
    ("quota not an integer", {}, ["tenants", "set-quota", "acme", "--quota", "lots"], 2,
     "Invalid value for '--quota'"),
    ("quota beyond the column", {}, ["tenants", "set-quota", "acme", "--quota", "99999999999"],
     2, "cache_quota_blocks must be between"),
    ("negative rate limit", {}, ["tenants", "create", "neg", "--rpm", "-1"], 2,
     "requests per minute must not be negative"),
    ("weight out of range", {}, ["tenants", "set-weight", "acme", "100.5"], 2,
     "scheduling weight must be between 0.01 and 100 (got 100.5)"),
    ("weight just out of range, shown exactly", {}, ["tenants", "set-weight", "acme",
     "100.0001"], 2, "scheduling weight must be between 0.01 and 100 (got 100.0001)"),
    ("negative weight", {}, ["tenants", "set-weight", "acme", "-1"], 2,
     "scheduling weight must be between 0.01 and 100 (got -1)"),
    ("negative infinite weight", {}, ["tenants", "set-weight", "acme", "-inf"], 2,
     "Invalid value for 'weight': expected a decimal number from 0.01 to 100 (got '-inf')"),
    ("weight not finite", {}, ["tenants", "create", "inf", "--scheduling-weight", "inf"], 2,
     "expected a decimal number from 0.01 to 100 (got 'inf')"),
    ("weight NaN", {}, ["tenants", "set-weight", "acme", "nan"], 2,
     "expected a decimal number from 0.01 to 100 (got 'nan')"),
    ("weight with an underscore", {}, ["tenants", "set-weight", "acme", "1_0"], 2,
     "expected a decimal number from 0.01 to 100 (got '1_0')"),
    ("weight with a space", {}, ["tenants", "set-weight", "acme", "2 "], 2,
     "expected a decimal number from 0.01 to 100 (got '2 ')"),
    ("weight not a number", {}, ["tenants", "set-weight", "acme", "heavy"], 2,
     "Invalid value for 'weight'"),
    ("unknown command", {}, ["tenant", "list"], 2, "No such command 'tenant'"),
    ("missing argument", {}, ["tenants", "create"], 2, "Missing argument"),
]  # fmt: skip

TRITON_OUTSIDE_INTERPRETER = {"PREFIXGATE_ATTENTION_BACKEND": "triton", "TRITON_INTERPRET": "0"}
if not torch.cuda.is_available():  # where there is a GPU, these settings are fine
    CASES += [
        ("serve on cuda without a GPU", {"PREFIXGATE_DEVICE": "cuda"}, ["serve"], 2,
         "device cuda: no CUDA GPU is visible"),
        ("serve with triton on a CPU", TRITON_OUTSIDE_INTERPRETER, ["serve"], 2,
         "attention backend 'triton' is unavailable: the Triton kernels need a CUDA device"),
        ("generate on cuda without a GPU", {"PREFIXGATE_DEVICE": "cuda"},
         ["generate", "--prompt", "hi"], 2, "device cuda: no CUDA GPU is visible"),
        ("generate with triton on a CPU", TRITON_OUTSIDE_INTERPRETER,
         ["generate", "--prompt", "hi"], 2, "attention backend 'triton' is unavailable"),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def acme_database(migrated_template: str) -> Iterator[str]:
    """One PostgreSQL database with tenant `acme`, shared: every case here changes nothing."""
    from tests.support.postgres import create_database, database_url, drop_database

    name = create_database(template=migrated_template)
    yield database_url(name)
    drop_database(name)


@pytest.fixture(scope="module")
def seeded(acme_database: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    state = tmp_path_factory.mktemp("cli-errors") / "state"
    Cli(acme_database, state).ok("tenants", "create", "acme")
    return state


@pytest.mark.parametrize(("case", "env", "args", "code", "message"), CASES,
                         ids=[case[0] for case in CASES])  # fmt: skip
def test_bad_input_or_environment_is_one_line_without_a_traceback(
    case: str,
    env: dict[str, str],
    args: list[str],
    code: int,
    message: str,
    acme_database: str,
    seeded: Path,
) -> None:
    cli = Cli(acme_database, seeded)
    cli.env.update(env)
    line = cli.error(*args, code=code)
    assert line.startswith("prefixgate: error: ") and message in line, line


def test_anything_unexpected_is_one_line_and_exit_1(acme_database: str, tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the state directory should be")
    cli = Cli(acme_database, blocked)
    del cli.env["PREFIXGATE_KEY_HASH_SECRET"]  # so the CLI must generate a secret there
    line = cli.error("tenants", "list", code=1)
    assert line.startswith("prefixgate: error: unexpected ") and str(blocked) in line
