"""`prefixgate demo`, `prefixgate generate` and `bench.prefix`, run for real."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.cache.budget import PUBLIC_OWNER
from engine.model.loader import LoadedModel
from gateway.cli.engine_demo import SYSTEM_PROMPT, render, run_demo


def prefixgate(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    executable = shutil.which("prefixgate") or f"{sys.prefix}/bin/prefixgate"
    return subprocess.run([executable, *args], capture_output=True, text=True, timeout=timeout)


def bench(*args: str) -> dict[str, object]:
    completed = subprocess.run(
        [sys.executable, "-m", "bench.prefix", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    result: dict[str, object] = json.loads(completed.stdout)
    return result


def test_demo_reuses_own_turns_and_only_the_public_prompt_across_users(
    smollm2: LoadedModel,
) -> None:
    turns, stats = run_demo(smollm2)
    alice_first, alice_second, bob, carol = turns
    assert "Paris" in alice_first.answer
    assert alice_first.cached_tokens == 0
    # Alice's second turn reuses her whole first turn (in whole blocks); Bob and Carol only
    # the public system prompt, never Alice's question.
    assert alice_second.cached_tokens >= alice_first.prompt_tokens - 16
    assert 0 < bob.cached_tokens < alice_first.prompt_tokens - 16
    assert carol.cached_tokens == bob.cached_tokens
    assert stats.blocks_zeroed > 0
    # The public budget counts the prompt tokens in its blocks, and those read from cache:
    # every turn but Alice's first read all of the public system prompt's whole blocks.
    public = stats.owners[PUBLIC_OWNER].counters
    assert public.prompt_tokens > 0 and public.prompt_tokens % (4 * 16) == 0
    assert public.cached_tokens * 4 == public.prompt_tokens * 3


def test_demo_reports_the_public_prompts_reuse_by_the_blocks_read(
    smollm2_dir: Path, smollm2_tokenizer: Any
) -> None:
    # Three requests after Alice's first read the public system prompt's blocks: 75%, not the
    # 0% of public counters that counted nothing (every count went to the tenant that asked).
    system_message = {"role": "system", "content": SYSTEM_PROMPT}
    system = render(smollm2_tokenizer, [system_message], False)
    public = len(system) // 16 * 16
    completed = subprocess.run(
        [shutil.which("prefixgate") or f"{sys.prefix}/bin/prefixgate", "demo"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "300"},
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    assert (
        f"the public budget: {public // 16} cached blocks, reuse 75% ({3 * public} of "
        f"{4 * public} prompt tokens in public blocks)"
    ) in lines
    # Each tenant's reuse counts all its prompts, the public blocks it read included.
    tenants = [line for line in lines if line.startswith("tenant ")]
    assert len(tenants) == 2
    assert re.fullmatch(
        r"tenant 'acme': \d+ cached blocks, reuse \d+% \(\d+ of \d+ prompt tokens\)", tenants[0]
    ), tenants[0]
    question = {"role": "user", "content": "What is the capital of France?"}
    carol = len(render(smollm2_tokenizer, [system_message, question], True))
    assert re.fullmatch(
        rf"tenant 'globex': \d+ cached blocks, reuse {public / carol:.0%} \({public} of "
        rf"{carol} prompt tokens\)",
        tenants[1],
    ), tenants[1]


def test_generate_streams_an_answer_and_keeps_the_engines_notes_in_the_log(
    smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFIXGATE_STATE_DIR", str(tmp_path / "state"))
    completed = prefixgate("generate", "--prompt", "What is the capital of France?")
    assert completed.returncode == 0, completed.stderr
    # The answer alone on stdout, the usage line alone on stderr: no progress bar, and none of
    # the engine's notes (its calibration, threads it gives up on a busy machine).
    assert len(completed.stdout.splitlines()) == 1 and "Paris" in completed.stdout
    assert re.fullmatch(r"\[\d+ prompt tokens, \d+ generated, finish: \w+\]\n", completed.stderr), (
        completed.stderr
    )
    log = tmp_path / "state" / "prefixgate.log"
    assert "engine: step cost calibrated" in log.read_text()
    assert log.stat().st_mode & 0o777 == 0o600


def test_generate_rejects_a_bad_model_directory_in_one_line(tmp_path: Path) -> None:
    completed = prefixgate("generate", "--prompt", "hi", "--model", str(tmp_path))
    assert completed.returncode == 2
    assert completed.stderr.strip().splitlines() == [
        f"prefixgate: error: {tmp_path} is not a model directory (no config.json)"
    ]


def test_sysprompt_bench_accounts_fresh_prefill_exactly() -> None:
    result = bench(
        "--workload", "sysprompt", "--requests", "4", "--prefix-tokens", "128",
        "--suffix-tokens", "64", "--output-tokens", "2", "--max-num-seqs", "2",
    )  # fmt: skip
    assert result["fresh_prefill_tokens"] == 128 + 4 * 64
    assert result["cached_tokens"] == 4 * 128
    for key in ("ttft_cold_median_s", "ttft_warm_median_s", "warm_cold_ttft_ratio",
                "output_tokens_per_s", "peak_blocks_shared", "peak_blocks_unshared"):  # fmt: skip
        assert isinstance(result[key], int | float) and result[key] > 0, key
    assert result["peak_blocks_shared"] < result["peak_blocks_unshared"]  # type: ignore[operator]


@pytest.mark.parametrize("workload", ["gsp", "unique"])
def test_gsp_and_unique_workloads_count_cached_tokens_beside_the_hf_baseline(
    workload: str,
) -> None:
    result = bench(
        "--workload", workload, "--groups", "2", "--prompts-per-group", "2",
        "--system-tokens", "64", "--question-tokens", "16", "--requests", "3",
        "--prefix-tokens", "32", "--suffix-tokens", "16", "--output-tokens", "2",
        "--baseline", "hf",
    )  # fmt: skip
    assert result["hf_output_tokens_per_s"] > 0  # type: ignore[operator]
    if workload == "gsp":
        assert result["requests"] == 4 and result["cached_tokens"] == 4 * 64
    else:
        assert result["cached_tokens"] == 0
