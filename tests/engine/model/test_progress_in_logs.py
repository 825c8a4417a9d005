"""The first start's GGUF conversion, logged to a file: progress without terminal escapes,
and a directory that another user can serve from."""

from __future__ import annotations

import os
import stat
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
    # An image converts as root and serves as uid 10001: every file must be readable by others
    # (transformers wrote the weights 0600, and the image's worker could not load them).
    (converted,) = [path for path in (tmp_path / "cache").iterdir() if path.is_dir()]
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in converted.iterdir()}
    assert "model.safetensors" in modes
    assert {name: mode for name, mode in modes.items() if not mode & stat.S_IROTH} == {}
