"""`bench.peers`: its window arithmetic, and one tiny run through the engine, the API and
transformers (vLLM needs its own interpreter and is not run here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.peers import Trace, aggregate_decode, decode_rate, main


def test_aggregate_decode_counts_only_tokens_after_every_stream_has_its_first() -> None:
    early = Trace(times=[1.0, 2.0, 3.0, 4.0, 5.0], completion_tokens=5)
    late = Trace(times=[3.0, 4.0, 5.0], completion_tokens=3)
    # From t=3 (the late stream's first token) to t=5: 2 + 2 tokens in 2 seconds.
    assert aggregate_decode([early, late]) == pytest.approx(2.0)
    assert decode_rate(early) == pytest.approx(1.0)


def test_aggregate_decode_weighs_text_chunks_that_carry_several_tokens() -> None:
    # Over HTTP: 5 tokens in 3 chunks, so each chunk after the first stands for 2 tokens.
    chunked = Trace(times=[0.0, 1.0, 2.0], completion_tokens=5, token_ids=None)
    assert aggregate_decode([chunked]) == pytest.approx(2.0)


def test_tiny_run_reports_every_metric_and_warm_requests_hit_the_cache(
    tiny_chat_dir: Path, tmp_path: Path
) -> None:
    result = main(
        ["--model", str(tiny_chat_dir), "--engines", "engine,api,transformers",
         "--dtype", "float32", "--prefix-tokens", "32", "--unique-tokens", "16",
         "--output-tokens", "3", "--concurrency", "2", "--samples", "1",
         "--out", str(tmp_path / "peers.json")]
    )  # fmt: skip
    engines = result["engines"]
    assert set(engines) == {"prefixgate_engine", "prefixgate_api", "transformers"}
    for name, engine in engines.items():
        assert engine["dtype"] == "float32", name
        assert engine["cold_ttft_s"] > 0 and engine["warm_ttft_s"] > 0, name
        assert engine["at_once_tok_s"] > 0 and engine["decode_tok_s"] > 0, name
        assert set(engine["aggregate_decode_tok_s"]) == {1, 2}, name
        assert 0 <= engine["agreement"] <= 1, name
    # Every shared-prefix request after the first reuses the whole 32-token prefix.
    assert engines["prefixgate_engine"]["warm_cached_tokens"] == (32, 32)
    assert engines["prefixgate_api"]["warm_cached_tokens"] == (32, 32)
    checks = result["targets"]["prefixgate_api"]
    assert set(checks) == {"decode_2_vs_1_stream"}  # no vLLM: only the scaling target
    assert (tmp_path / "peers.json").exists()


def test_a_peer_that_fails_is_reported_and_the_others_are_kept(
    tiny_chat_dir: Path, tmp_path: Path
) -> None:
    # /bin/false stands in for a vLLM interpreter whose worker dies: both vLLM runs fail, the
    # engine's result stays, and the file says the run completed with what failed.
    out = tmp_path / "peers.json"
    result = main(
        ["--model", str(tiny_chat_dir), "--engines", "engine,vllm", "--vllm-python", "/bin/false",
         "--dtype", "float32", "--prefix-tokens", "32", "--unique-tokens", "16",
         "--output-tokens", "3", "--concurrency", "2", "--samples", "1", "--out", str(out)]
    )  # fmt: skip
    assert set(result["engines"]) == {"prefixgate_engine"}
    assert set(result["failed"]) == {"vllm_caching_off", "vllm_caching_on"}
    assert all("CalledProcessError" in error for error in result["failed"].values())
    written = json.loads(out.read_text())
    assert written["complete"] is True
    assert written["failed"] == result["failed"]
