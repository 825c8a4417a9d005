"""The hashing benchmark prints one JSON object (benches with a model: tests/gateway/cli)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_hashing_bench_prints_one_json_object() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "bench.hashing", "--tokens", "1600", "--repeats", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(completed.stdout)
    assert result["tokens"] == 1600 and result["ns_per_token"] > 0
