"""Running the real `prefixgate` console script against a test database."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


class Cli:
    """`prefixgate` with its own database, state directory and secrets."""

    def __init__(self, database_url: str, state_dir: Path) -> None:
        self.env = {
            **os.environ,
            "PREFIXGATE_DATABASE_URL": database_url,
            "PREFIXGATE_STATE_DIR": str(state_dir),
            "PREFIXGATE_KEY_HASH_SECRET": "cli-key-secret",
            "PREFIXGATE_AUDIT_SIGNING_KEY": "cli-signing-key",
        }
        self.executable = shutil.which("prefixgate") or f"{sys.prefix}/bin/prefixgate"

    def run(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.executable, *args], input=stdin, capture_output=True, text=True,
            env=self.env, timeout=120,
        )  # fmt: skip

    def ok(self, *args: str, stdin: str | None = None) -> str:
        completed = self.run(*args, stdin=stdin)
        assert completed.returncode == 0, completed.stderr
        return completed.stdout

    def json(self, *args: str) -> Any:
        return json.loads(self.ok(*args, "--json"))

    def error(self, *args: str, code: int = 2, stdin: str | None = None) -> str:
        """Run a command that must fail; returns its single error line."""
        completed = self.run(*args, stdin=stdin)
        assert completed.returncode == code, (completed.returncode, completed.stdout)
        lines = completed.stderr.strip().splitlines()
        assert len(lines) == 1, completed.stderr
        assert "Traceback" not in completed.stderr
        return lines[0]
