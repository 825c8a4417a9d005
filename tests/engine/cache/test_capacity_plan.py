"""The capacity planner and its `prefixgate plan` command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from engine.cache.capacity import plan_capacity
from engine.cache.kv_spec import KVSpec

EXAMPLE = [
    "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bf16",
    "--prefix-tokens", "4096", "--suffix-tokens", "2048", "--requests", "100",
]  # fmt: skip


def prefixgate(*args: str) -> subprocess.CompletedProcess[str]:
    executable = shutil.which("prefixgate") or f"{sys.prefix}/bin/prefixgate"
    return subprocess.run([executable, *args], capture_output=True, text=True, timeout=60)


def test_worked_example_needs_208896_fresh_tokens_and_one_512_mib_prefix() -> None:
    spec = KVSpec(32, 8, 128, torch.bfloat16, 16)
    result = plan_capacity(spec, 4096, 2048, 100)
    assert result.kv_bytes_per_token == 128 * 1024
    assert result.kv_bytes_per_prefix == 512 * 1024**2
    assert result.prefix_copies_unshared_bytes == 50 * 1024**3
    assert result.fresh_prefill_tokens_uncached == 614_400
    assert result.fresh_prefill_tokens_cached == 208_896
    assert result.avoided_prefill_tokens == 405_504
    assert round(result.avoided_fraction, 3) == 0.66
    assert result.unshared_bytes == 100 * 384 * 16 * 128 * 1024
    assert result.shared_bytes == (256 + 100 * 128) * 16 * 128 * 1024


def test_prefix_ending_mid_block_shares_only_whole_blocks() -> None:
    spec = KVSpec(1, 1, 1, torch.float32, 16)
    result = plan_capacity(spec, 100, 10, 3)
    assert result.shareable_prefix_tokens == 96
    assert result.fresh_prefill_tokens_cached == 100 + 3 * 14


def test_plan_json_has_the_documented_keys() -> None:
    completed = prefixgate("plan", *EXAMPLE, "--json")
    assert completed.returncode == 0, completed.stderr
    result = json.loads(completed.stdout)
    assert result["kv_bytes_per_prefix"] == 536_870_912
    assert result["unshared_bytes"] > result["shared_bytes"]
    assert result["fresh_prefill_tokens_uncached"] == 614_400
    assert result["fresh_prefill_tokens_cached"] == 208_896


def test_plan_summary_shows_the_prefix_size_and_both_prefill_totals() -> None:
    completed = prefixgate("plan", *EXAMPLE)
    assert completed.returncode == 0, completed.stderr
    assert "512.0 MiB" in completed.stdout
    assert "614,400" in completed.stdout and "208,896" in completed.stdout


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--layers", "0", "--layers must be positive"),
        ("--dtype", "int3", "unknown dtype 'int3'"),
        ("--requests", "-1", "--requests must not be negative"),
    ],
)
def test_plan_rejects_bad_input_with_one_line(flag: str, value: str, message: str) -> None:
    args = list(EXAMPLE)
    args[args.index(flag) + 1] = value
    completed = prefixgate("plan", *args)
    assert completed.returncode == 2
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prefixgate: error: ") and message in lines[0]
