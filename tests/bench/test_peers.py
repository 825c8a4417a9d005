"""`bench.peers`: its window arithmetic, and one tiny run through the engine, the API and
transformers (vLLM needs its own interpreter and is not run here)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import peer_turns
from bench.decode_step import StepWork, model_shapes, step_work
from bench.machine_speed import Speed
from bench.peer_runners import CpuThreads, EngineRun, Phase, Runner, Trace, Workload
from bench.peer_turns import interleave
from bench.peers import (
    EngineResult,
    aggregate_decode,
    decode_rate,
    main,
    ratios_to,
    scaling_floor,
    targets,
)
from engine.model.openmp import ThreadGovernor


def test_aggregate_decode_counts_only_tokens_after_every_stream_has_its_first() -> None:
    early = Trace(times=[1.0, 2.0, 3.0, 4.0, 5.0], completion_tokens=5)
    late = Trace(times=[3.0, 4.0, 5.0], completion_tokens=3)
    # From t=3 (the late stream's first token) to t=5: 2 + 2 tokens in 2 seconds.
    assert aggregate_decode([early, late]) == pytest.approx(2.0)
    assert decode_rate(early) == pytest.approx(1.0)


def test_aggregate_decode_ends_when_the_first_stream_ends() -> None:
    # Prefilled two steps apart: the early stream ends at t=6, so only [3, 6] has both
    # decoding, one token a second each. The late stream's tokens reach it a millisecond after
    # the early one's (one step's tokens arrive one stream after another): each stream is
    # timed by its own arrivals, so the step that ends the window counts whole for both.
    early = Trace(times=[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], completion_tokens=6)
    late = Trace(times=[3.001, 4.001, 5.001, 6.001, 7.001, 8.001], completion_tokens=6)
    assert aggregate_decode([early, late]) == pytest.approx(2.0)
    assert aggregate_decode([Trace(times=[1.0, 2.0], completion_tokens=2), late]) is None


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
        # The first request after start, beside the later ones.
        first = engine["first_request"]
        assert first["ttft_s"] > 0 and first["decode_tok_s"] > 0, name
        assert first["ttft_vs_cold"] == pytest.approx(first["ttft_s"] / engine["cold_ttft_s"])
        assert first["decode_vs_warm"] == pytest.approx(
            first["decode_tok_s"] / engine["decode_tok_s"]
        )
    # Every shared-prefix request after the first reuses the whole 32-token prefix.
    assert engines["prefixgate_engine"]["warm_cached_tokens"] == (32, 32)
    assert engines["prefixgate_api"]["warm_cached_tokens"] == (32, 32)
    checks = result["targets"]["prefixgate_api"]
    assert set(checks) == {"decode_2_vs_1_stream"}  # no vLLM: only the scaling target
    # Beside it, what steps at their floor would give at the rates probed before its phases.
    scaling = checks["decode_2_vs_1_stream"]
    # Recomputed from the run's own probes (it can exceed 2: where the warm phases' probes read
    # slower than the 2-stream phases', one stream's floor is the longer).
    model = model_shapes(tiny_chat_dir, torch.float32)
    work = {n: step_work(model, 32, 16, n) for n in (1, 2)}
    probes = {
        name: Speed(**rates) for name, rates in result["machine_speed"]["before_phase"].items()
    }
    assert scaling["floor"] == pytest.approx(scaling_floor(work, probes, 2))
    ratio = scaling["ratio"]  # None where the window held no step of every stream
    expected = None if ratio is None else pytest.approx(ratio / scaling["floor"])
    assert scaling["of_floor"] == expected
    # The machine was probed before every phase, in the engines' dtype.
    speed = result["machine_speed"]
    phases = ["first", "cold-0", "prime", "warm-0", "streams-2-0"]
    assert list(speed["before_phase"]) == phases
    assert speed["matmul"] == "1536x576x3072 float32"
    for rate in ("matmul_tflops", "memory_gb_s", "read_gb_s"):
        low, middle, high = speed[rate]
        assert 0 < low <= middle <= high, rate
    assert (tmp_path / "peers.json").exists()
    # Where the engine governs its threads, both PrefixGate rows say in which phases it
    # computed with fewer (the API's read from its /metrics).
    governed = engine_governs_threads()
    for name in ("prefixgate_engine", "prefixgate_api"):
        narrowed = engines[name]["notes"].get("narrowed_phases")
        assert (narrowed is not None) == governed, name
        assert set(narrowed or []) <= set(phases), name


def engine_governs_threads() -> bool:
    """Whether an engine here has a ThreadGovernor."""
    return ThreadGovernor.for_device(torch.device("cpu")) is not None


def test_a_peer_that_fails_is_reported_and_the_others_are_kept(
    tiny_chat_dir: Path, tmp_path: Path
) -> None:
    # /bin/false stands in for a vLLM interpreter whose worker dies: both vLLM runs fail, the
    # engine's result stays, and the file says what failed.
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
    assert written["failed"] == result["failed"]
    assert set(written["engines"]) == {"prefixgate_engine"}


class Logged(Runner):
    """A runner that notes each phase it runs in a log shared with the other runners."""

    def __init__(
        self, name: str, log: list[str], fails_at: str | None = None, close_fails: bool = False
    ) -> None:
        workload = Workload(Path("."), [], PHASES, 2, 1, 1)
        super().__init__(workload, "float32")
        self.name, self.log, self.fails_at, self.close_fails = name, log, fails_at, close_fails

    def start(self) -> None:
        self.log.append(f"{self.name} start")

    def run_phase(self, phase: Phase) -> list[Trace]:
        if phase.name == self.fails_at:
            raise RuntimeError("stream broke")
        self.log.append(f"{self.name} {phase.name}")
        return [Trace([0.1, 0.2], 2, [1, 2])]

    def close(self) -> None:
        self.log.append(f"{self.name} close")
        if self.close_fails:
            raise OSError("pipe already gone")

    def result(self) -> EngineRun:
        return EngineRun(self.name, "float32", self.traces)


PHASES = [Phase(name, "cold", [[1]]) for name in ("a", "b", "c")]


@pytest.fixture
def no_settling(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduling tests need no idle CPUs between turns."""
    monkeypatch.setattr("bench.peer_turns.settle", lambda: (peer_turns.SETTLE_WINDOW_S, True))


@pytest.mark.usefixtures("no_settling")
def test_each_phase_is_probed_then_runs_on_every_engine_in_rotated_order() -> None:
    log: list[str] = []
    engines = [Logged(name, log) for name in ("ref", "x", "y")]

    def probe(phase: Phase) -> None:
        log.append(f"probe {phase.name}")

    runs, failed = interleave(engines[0].workload, engines[0], engines[1:], before_phase=probe)
    assert log == [
        "ref start", "x start", "y start",
        "probe a", "ref a", "x a", "y a",
        "probe b", "x b", "y b", "ref b",
        "probe c", "y c", "ref c", "x c",
        "ref close", "x close", "y close",
    ]  # fmt: skip
    assert [run.name for run in runs] == ["ref", "x", "y"] and failed == {}
    assert list(runs[1].traces) == ["a", "b", "c"]


@pytest.mark.usefixtures("no_settling")
def test_a_peer_failing_midway_is_closed_and_dropped_and_the_others_finish() -> None:
    log: list[str] = []
    reference, broken, steady = Logged("ref", log), Logged("x", log, "b"), Logged("y", log)
    runs, failed = interleave(reference.workload, reference, [broken, steady])
    assert failed == {"x": "RuntimeError: stream broke"}
    assert [run.name for run in runs] == ["ref", "y"]
    assert "x close" in log and "x c" not in log
    assert list(runs[1].traces) == ["a", "b", "c"]


@pytest.mark.usefixtures("no_settling")
def test_the_reference_failing_fails_the_bench_and_every_engine_is_closed() -> None:
    log: list[str] = []
    reference = Logged("ref", log, "b", close_fails=True)
    others = [Logged("x", log, close_fails=True), Logged("y", log)]
    with pytest.raises(RuntimeError, match="stream broke"):  # not the close's OSError
        interleave(reference.workload, reference, others)
    assert log[-3:] == ["ref close", "x close", "y close"]


class Governed(Logged):
    """A runner whose engine reports its threads: all 2 of them until phase b narrows to 1,
    and 2 again after phase c."""

    def __init__(self, log: list[str]) -> None:
        super().__init__("governed", log)
        self.now = CpuThreads(2, 0)

    def cpu_threads(self) -> CpuThreads | None:
        return self.now

    def run_phase(self, phase: Phase) -> list[Trace]:
        if phase.name == "b":
            self.now = CpuThreads(1, 1)
        elif phase.name == "c":
            self.now = CpuThreads(2, 1)
        return super().run_phase(phase)


@pytest.mark.usefixtures("no_settling")
def test_the_phases_an_engine_ran_on_fewer_threads_are_in_its_notes() -> None:
    log: list[str] = []
    governed, peer = Governed(log), Logged("peer", log)
    runs, _ = interleave(governed.workload, governed, [peer])
    # b narrowed during its run; c started narrowed (and ended widened); a ran on all.
    assert runs[0].notes["narrowed_phases"] == ["b", "c"]
    assert "narrowed_phases" not in runs[1].notes  # an engine that does not say


def sampled(cold: list[float]) -> EngineResult:
    median = statistics.median(cold)
    samples = {"cold_ttft_s": cold, "warm_ttft_s": [1.0], "decode_tok_s": [1.0],
               "at_once_tok_s": [1.0]}  # fmt: skip
    return EngineResult("float32", median, 1.0, 1.0, 1.0, {1: 1.0}, 1.0, (None, None), {}, samples)


def test_targets_judge_the_ratio_of_medians_and_report_the_paired_samples_range() -> None:
    # PrefixGate is faster in two of three pairs; its median is 0.9 of vLLM's.
    mine, vllm = sampled([0.9, 1.2, 0.8]), sampled([1.0, 1.0, 1.0])
    checks = ratios_to(mine, vllm)
    assert checks["cold_ttft"]["ratio"] == pytest.approx(0.9)
    assert checks["cold_ttft"]["paired_range"] == pytest.approx([0.8, 1.2])
    assert checks["cold_ttft"]["met"] is True
    assert ratios_to(vllm, mine)["cold_ttft"]["met"] is False


def test_the_scaling_target_is_reported_beside_what_steps_at_their_floor_would_give() -> None:
    # 80 tok/s alone, 480 at 16 streams: 6x, short of 8x, and 75% of a floor that allows 8x.
    engine = EngineResult("bfloat16", 1.0, 0.5, 80.0, 1.0, {1: 80.0, 16: 480.0}, 1.0,
                          (None, None), {}, {})  # fmt: skip
    check = targets({"prefixgate_engine": engine}, 16, floor=8.0)["prefixgate_engine"]
    scaling = check["decode_16_vs_1_stream"]
    assert scaling["ratio"] == pytest.approx(6.0) and scaling["met"] is False
    assert scaling["floor"] == 8.0 and scaling["of_floor"] == pytest.approx(0.75)
    unknown = targets({"prefixgate_engine": engine}, 16)["prefixgate_engine"]
    assert unknown["decode_16_vs_1_stream"]["of_floor"] is None
    assert scaling["narrowed_phases"] == []


def test_the_scaling_floor_takes_each_side_at_the_rates_probed_before_its_phases() -> None:
    # One stream: 300 MB read, little arithmetic (memory-bound); 16: 6 GFLOP (compute-bound).
    work = {1: StepWork(flops=0.4e9, nbytes=300e6), 16: StepWork(flops=6e9, nbytes=400e6)}
    slow_reads, fast_reads = Speed(0.4, 55.0, 30.0), Speed(0.4, 110.0, 60.0)
    speeds = {"cold-0": slow_reads, "warm-0": fast_reads, "warm-1": fast_reads,
              "streams-4-0": fast_reads, "streams-16-0": slow_reads}  # fmt: skip
    # One stream's step 300e6 / 60e9 = 5 ms, sixteen's 6e9 / 0.4e12 = 15 ms: 16 x 5 / 15.
    assert scaling_floor(work, speeds, 16) == pytest.approx(16 * 5 / 15)
    # At slow reads throughout, one stream's step would be 10 ms: the floor twice as high.
    slow = {name: slow_reads for name in speeds}
    assert scaling_floor(work, slow, 16) == pytest.approx(16 * 10 / 15)
    # Without a probe of a kind, the run's median rates stand in.
    assert scaling_floor(work, {"cold-0": slow_reads}, 16) == pytest.approx(16 * 10 / 15)


def test_the_scaling_target_names_its_phases_that_ran_on_fewer_threads() -> None:
    narrowed = {"narrowed_phases": ["cold-0", "warm-1", "streams-4-0", "streams-16-2"]}
    engine = EngineResult("bfloat16", 1.0, 0.5, 60.0, 1.0, {1: 60.0, 16: 500.0}, 1.0,
                          (None, None), narrowed, {})  # fmt: skip
    check = targets({"prefixgate_engine": engine}, 16)["prefixgate_engine"]
    # Only the phases the ratio is taken from: the warm ones and those of 16 streams.
    assert check["decode_16_vs_1_stream"]["narrowed_phases"] == ["warm-1", "streams-16-2"]


# A stand-in for a vLLM interpreter (vLLM itself is not installed here): it speaks
# bench/vllm_runner.py's protocol, answering each phase with tokens 0.01 s apart. It exits with
# status 3 instead of answering the phase named STAND_IN_DIES_AT, or right after answering the
# one named STAND_IN_EXITS_AFTER (so that it is gone before its next turn).
STAND_IN = """#!{python}
import json, os, sys
workload = json.load(open(sys.argv[2]))
prompts = {{phase["name"]: phase["prompts"] for phase in workload["phases"]}}
print(json.dumps({{"dtype": "float32", "vllm": "stand-in", "startup_s": 0.0}}), flush=True)
for line in sys.stdin:
    name = line.strip()
    if name == os.environ.get("STAND_IN_DIES_AT"):
        sys.exit(3)
    n = workload["output_tokens"]
    trace = {{"times": [0.01 * (i + 1) for i in range(n)], "token_ids": list(range(n)),
             "cached_tokens": 0}}
    print(json.dumps({{"traces": [trace for _ in prompts[name]]}}), flush=True)
    if name == os.environ.get("STAND_IN_EXITS_AFTER"):
        sys.exit(3)
"""


def stand_in_vllm(tmp_path: Path) -> str:
    path = tmp_path / "vllm-python"
    path.write_text(STAND_IN.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def tiny_vllm_run(tiny_chat_dir: Path, python: str) -> dict[str, Any]:
    return main(
        ["--model", str(tiny_chat_dir), "--engines", "engine,vllm", "--vllm-python", python,
         "--dtype", "float32", "--prefix-tokens", "32", "--unique-tokens", "16",
         "--output-tokens", "3", "--concurrency", "2", "--samples", "2"]
    )  # fmt: skip


def test_a_vllm_peer_answers_phase_by_phase_and_each_target_has_its_paired_range(
    tiny_chat_dir: Path, tmp_path: Path
) -> None:
    result = tiny_vllm_run(tiny_chat_dir, stand_in_vllm(tmp_path))
    assert result["failed"] == {}
    vllm = result["engines"]["vllm_caching_on"]
    assert vllm["cold_ttft_s"] == pytest.approx(0.01)  # its first token, in every cold phase
    assert len(vllm["samples"]["cold_ttft_s"]) == 2 and len(vllm["samples"]["at_once_tok_s"]) == 2
    assert vllm["notes"]["vllm"] == "stand-in"
    checks = result["targets"]["prefixgate_engine"]
    ratios = {"cold_ttft", "warm_ttft", "single_stream_decode", "at_once_throughput"}
    assert set(checks) == ratios | {"decode_2_vs_1_stream"}
    for name in ratios:
        low, high = checks[name]["paired_range"]
        assert 0 < low <= high, name


@pytest.mark.parametrize(
    "how", [("STAND_IN_DIES_AT", "warm-1"), ("STAND_IN_EXITS_AFTER", "cold-0")]
)
def test_a_vllm_peer_that_dies_midway_is_reported_and_the_engine_finishes(
    tiny_chat_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: tuple[str, str]
) -> None:
    monkeypatch.setenv(*how)  # dies in its own turn, or between its turns
    result = tiny_vllm_run(tiny_chat_dir, stand_in_vllm(tmp_path))
    assert set(result["engines"]) == {"prefixgate_engine"}
    assert set(result["failed"]) == {"vllm_caching_off", "vllm_caching_on"}
    assert all("exit status 3" in error for error in result["failed"].values())
    assert result["engines"]["prefixgate_engine"]["samples"]["warm_ttft_s"]  # all phases ran
