"""deploy/ names settings, commands and options of the code: each one must exist, so that a
renamed setting or flag breaks this test instead of a deployment."""

from __future__ import annotations

import re
import subprocess
import sys

from gateway.settings import Settings
from tests.deploy.tools import DEPLOY, REPO

# Read by code outside the settings class (engine/model/loader.py, engine/kernels/cpu/build.py).
READ_DIRECTLY = {"PREFIXGATE_MODEL_CACHE", "PREFIXGATE_KERNEL_CACHE"}
# deploy/'s own: Compose interpolation and the image's health check script.
DEPLOY_ONLY = {
    "PREFIXGATE_IMAGE", "PREFIXGATE_CUDA_IMAGE", "PREFIXGATE_PUBLISH_PORT",
    "PREFIXGATE_PUBLISH_PORT_2", "PREFIXGATE_HEALTHCHECK_URL",
}  # fmt: skip


def deploy_texts() -> dict[str, str]:
    return {
        str(path.relative_to(REPO)): path.read_text()
        for path in DEPLOY.rglob("*")
        if path.is_file()
        and path.suffix in ("", ".yaml", ".py", ".md", ".example", ".cpu", ".cuda")
    }


def test_every_prefixgate_variable_is_a_setting_or_read_by_the_code() -> None:
    settings = {f"PREFIXGATE_{name.upper()}" for name in Settings.model_fields}
    for name in READ_DIRECTLY:  # still read where this test says
        assert any(name in path.read_text() for path in (REPO / "engine").rglob("*.py")), name
    named = {
        (variable, path)
        for path, text in deploy_texts().items()
        for variable in re.findall(r"PREFIXGATE_[A-Z0-9_]+", text)
    }
    assert named, "deploy/ names no setting at all?"
    unknown = sorted(
        (variable, path)
        for variable, path in named
        if variable not in settings | READ_DIRECTLY | DEPLOY_ONLY
    )
    assert not unknown, f"deploy/ names variables no code reads: {unknown}"


def test_the_commands_and_options_deploy_runs_exist() -> None:
    def help_of(*command: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", "from gateway.cli import main; main()", *command, "--help"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    worker, serve = help_of("worker"), help_of("serve")
    for option in ("--host", "--port", "--model"):
        assert option in worker
    assert "--workers" in serve
    assert "upgrade" in help_of("db")
    texts = "\n".join(deploy_texts().values())
    for used in re.findall(r"\[worker,([^\]]*)\]", texts):  # args: [worker, --host, ...]
        for option in re.findall(r"--[a-z-]+", used):
            assert option in worker, f"prefixgate worker has no {option}"
    # `prefixgate certs init|issue ...` in compose's certs service and the README
    certs = {command: help_of("certs", command) for command in ("init", "issue")}
    used = re.findall(r"prefixgate certs (init|issue)([^\n`|]*)", texts)
    assert {command for command, _ in used} == set(certs)
    for command, rest in used:
        for option in re.findall(r"(?<![\w-])--[a-z-]+", rest):
            assert option in certs[command], f"prefixgate certs {command} has no {option}"


def test_no_shipped_configuration_chooses_plain_http_to_workers() -> None:
    """PREFIXGATE_WORKER_PLAINTEXT is for one machine or a test: no compose file, manifest,
    env example or image sets it."""
    for path, text in deploy_texts().items():
        if not path.endswith(".md"):
            assert "PREFIXGATE_WORKER_PLAINTEXT" not in text, path
