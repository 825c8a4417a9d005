"""The engine demo behind `make run` and the hashing benchmark's JSON."""

from __future__ import annotations

import json
import subprocess
import sys

from engine.demo import run_demo


def test_demo_shares_the_public_prompt_but_not_private_turns() -> None:
    steps, stats = run_demo()
    by_name = {step.description: step.cached_tokens for step in steps}
    assert by_name["acme/alice: first turn (cold)"] == 0
    assert by_name["acme/alice: second turn"] == 800  # her own first turn, whole blocks
    assert by_name["acme/bob: alice's words, another user"] == 512  # the public prompt only
    assert by_name["globex/carol: same system prompt"] == 512
    assert stats.owners["globex"].cached_blocks == 0  # purged
    assert stats.blocks_zeroed > 0


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
