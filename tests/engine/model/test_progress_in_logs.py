"""The first start's GGUF conversion, logged to a file: progress without terminal escapes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CONVERT = "from engine.model.loader import embedded_model_dir; embedded_model_dir()"


@pytest.mark.slow
def test_conversion_logged_to_a_file_leaves_no_escape_codes(tmp_path: Path) -> None:
    env = {**os.environ, "PREFIXGATE_MODEL_CACHE": str(tmp_path / "cache")}
    completed = subprocess.run(
        [sys.executable, "-c", CONVERT], env=env, capture_output=True, text=True, timeout=600
    )
    assert completed.returncode == 0, completed.stderr
    assert "\x1b" not in completed.stderr  # before the fix: 27 x ESC[A from nested bars
    assert "Converting embedded SmolLM2 (once" in completed.stderr  # the log still says why
