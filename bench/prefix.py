"""Prefix-cache benchmark: what a shared prefix saves in prefill, TTFT and memory.

    python -m bench.prefix --workload sysprompt [--model DIR] [--requests 100] [--json]
        [--out F] [--plot F] [--baseline hf] [--device auto|cpu|cuda] [--dtype ...]
    python -m bench.prefix --workload gsp [--groups 8 --prompts-per-group 8 ...]
    python -m bench.prefix --workload unique     # 0% hits: caching on vs off

sysprompt: a 4,096-token shared prefix + 2,048 unique tokens per request, one warm-up request
that computes the prefix first. gsp: SGLang's generated-shared-prefix shape (groups of prompts
sharing a system prompt, each with its own question). The default model is a tiny seeded Llama
(hidden 256, 4 layers) so a run takes minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.common import emit, machine, plot_bars
from bench.hf_baseline import run_hf
from engine.cache.scope import Public, Segment, Tenant, User
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.loader import LoadedModel, load_model
from engine.precision import DEVICE_SETTINGS, DTYPE_SETTINGS, resolve_device, resolve_dtype
from engine.request import GenerationRequest, Usage
from engine.sampling.sampler import SamplingParams

TINY_VOCAB = 32_000


@dataclass(frozen=True)
class Workload:
    """The measured requests, warm-ups that fill the cache, and TTFT probes of the same shape
    (probes have their own unique tokens, so they leave nothing the measured requests reuse)."""

    name: str
    requests: list[GenerationRequest]
    warmups: list[GenerationRequest]
    probes: list[GenerationRequest]


def tiny_llama(max_len: int) -> LoadedModel:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
    )
    return LoadedModel(
        LlamaForCausalLM(config).eval(), None, "tiny-llama", "bench-tiny", (), max_len
    )


def sysprompt(args: argparse.Namespace, vocab: int) -> Workload:
    rng = random.Random(0)
    prefix = [rng.randrange(vocab) for _ in range(args.prefix_tokens)]
    sampling = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    requests = []
    for index in range(args.requests + args.ttft_samples):
        tenant = f"tenant-{index % 10}"
        suffix = [rng.randrange(vocab) for _ in range(args.suffix_tokens)]
        tokens = prefix + suffix
        segments = [Segment(0, len(prefix), Public("bench"))]
        segments.append(Segment(len(prefix), len(tokens), User(tenant, f"user-{index}")))
        requests.append(
            GenerationRequest(
                f"req-{index}", tenant, tokens, sampling, segments, User(tenant, f"user-{index}")
            )
        )
    warmup = GenerationRequest(
        "warmup", "warmup", prefix, SamplingParams(max_tokens=1, temperature=0.0),
        [Segment(0, len(prefix), Public("bench"))], User("warmup", "w"),
    )  # fmt: skip
    measured = requests[: args.requests]
    return Workload("sysprompt", measured, [warmup], requests[args.requests :])


def gsp(args: argparse.Namespace, vocab: int) -> Workload:
    """Groups of prompts sharing a system prompt; each group a tenant, tenant-wide sharing."""
    rng = random.Random(1)
    sampling = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    requests: list[GenerationRequest] = []
    warmups: list[GenerationRequest] = []
    probes: list[GenerationRequest] = []
    for group in range(args.groups):
        tenant = f"tenant-{group}"
        system = [rng.randrange(vocab) for _ in range(args.system_tokens)]
        warmups.append(
            GenerationRequest(f"warm-{group}", tenant, system, SamplingParams(1, 0.0),
                              tail_scope=Tenant(tenant))
        )  # fmt: skip
        for index in range(args.prompts_per_group + 1):
            question = [rng.randrange(vocab) for _ in range(args.question_tokens)]
            request = GenerationRequest(f"g{group}-q{index}", tenant, system + question, sampling,
                                        tail_scope=Tenant(tenant))  # fmt: skip
            (probes if index == args.prompts_per_group else requests).append(request)
    rng.shuffle(requests)
    return Workload("gsp", requests, warmups, probes[: args.ttft_samples])


def unique(args: argparse.Namespace, vocab: int) -> Workload:
    """No two prompts share a block: measures what caching costs when it never hits."""
    rng = random.Random(2)
    sampling = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    length = args.prefix_tokens + args.suffix_tokens
    requests = [
        GenerationRequest(f"u{index}", f"tenant-{index % 10}",
                          [rng.randrange(vocab) for _ in range(length)], sampling,
                          tail_scope=User(f"tenant-{index % 10}", "u"))
        for index in range(args.requests)
    ]  # fmt: skip
    return Workload("unique", requests, [], [])


@dataclass
class RunResult:
    seconds: float
    usages: list[Usage]
    ttfts: list[float]
    peak_active_blocks: int

    @property
    def output_tokens(self) -> int:
        return sum(usage.completion_tokens for usage in self.usages)

    @property
    def fresh_prefill_tokens(self) -> int:
        return sum(usage.prompt_tokens - usage.cached_tokens for usage in self.usages)


def run_concurrently(engine: Engine, requests: list[GenerationRequest]) -> RunResult:
    """Submit everything at once, drive the engine until all finish."""
    usages: dict[str, Usage] = {}
    first: dict[str, float] = {}
    submitted = time.perf_counter()

    def sink_for(request_id: str) -> Any:
        def sink(item: Any) -> None:
            if isinstance(item, Exception):
                raise item
            first.setdefault(request_id, time.perf_counter())
            if item.usage is not None:
                usages[request_id] = item.usage

        return sink

    for request in requests:
        engine.submit(request, sink_for(request.request_id))
    while engine.step():
        pass
    seconds = time.perf_counter() - submitted
    ttfts = [first[r.request_id] - submitted for r in requests]
    ordered = [usages[r.request_id] for r in requests]
    return RunResult(seconds, ordered, ttfts, engine.cache.peak_active_blocks)


def ttft_alone(engine: Engine, requests: list[GenerationRequest]) -> list[float]:
    """TTFT of each request served on its own (no queueing in the number)."""
    return [run_concurrently(engine, [request]).ttfts[0] for request in requests]


def make_engine(loaded: LoadedModel, args: argparse.Namespace, caching: bool) -> Engine:
    config = EngineConfig(
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        enable_prefix_caching=caching,
        queue_timeout_s=3600,
    )
    return Engine(loaded, config)


def relabel(
    requests: list[GenerationRequest], tag: str, max_tokens: int | None = None
) -> list[GenerationRequest]:
    """The same prompts under new ids (and optionally a longer generation)."""
    relabelled = []
    for r in requests:
        sampling = r.sampling
        if max_tokens is not None:
            sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        relabelled.append(
            GenerationRequest(f"{r.request_id}-{tag}", r.tenant_id, r.prompt_token_ids, sampling,
                              r.segments, r.tail_scope)
        )  # fmt: skip
    return relabelled


def peak_blocks(
    loaded: LoadedModel, args: argparse.Namespace, workload: Workload, caching: bool
) -> int:
    """Peak blocks in use with `max_num_seqs` requests resident at once, on a fresh engine.

    The requests generate long enough that every one of them has finished its prefill while
    the first is still decoding, so both runs compare the same concurrency.
    """
    engine = make_engine(loaded, args, caching)
    if caching:
        run_concurrently(engine, relabel(workload.warmups, "peak-warmup"))
    batch = args.max_num_seqs
    steps_to_fill = sum(len(r.prompt_token_ids) for r in workload.requests[:batch])
    max_tokens = steps_to_fill // args.max_batched_tokens + batch + 2
    requests = relabel(workload.requests[:batch], "peak", max_tokens=max_tokens)
    return run_concurrently(engine, requests).peak_active_blocks


def run(args: argparse.Namespace) -> dict[str, Any]:
    build = {"sysprompt": sysprompt, "gsp": gsp, "unique": unique}[args.workload]
    longest = max(
        args.prefix_tokens + args.suffix_tokens, args.system_tokens + args.question_tokens
    )
    max_len = 2 * longest + args.output_tokens + 1024  # room for the peak probes
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.model:
        loaded = load_model(args.model, dtype=dtype, device=device)
    else:
        loaded = tiny_llama(max_len)
        loaded.model.to(device=device, dtype=dtype)  # type: ignore[call-arg]
    workload = build(args, loaded.vocab_size)
    result: dict[str, Any] = {
        "benchmark": "prefix",
        "workload": workload.name,
        "model": loaded.name,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "requests": len(workload.requests),
        "output_tokens_per_request": args.output_tokens,
    }

    shared = make_engine(loaded, args, caching=True)
    unshared = make_engine(loaded, args, caching=False)
    if workload.name == "unique":
        # Alternate on/off rounds after a warm-up and keep each side's best: this machine's
        # speed drifts by more than the 1% being measured.
        run_concurrently(unshared, relabel(workload.requests[:2], "warm-up"))
        on_rates, off_rates, cached = [], [], 0
        for round_index in range(args.rounds):
            caching_on, caching_off = (make_engine(loaded, args, c) for c in (True, False))
            on = run_concurrently(caching_on, relabel(workload.requests, f"on-{round_index}"))
            off = run_concurrently(caching_off, relabel(workload.requests, f"off-{round_index}"))
            on_rates.append(on.output_tokens / on.seconds)
            off_rates.append(off.output_tokens / off.seconds)
            cached += sum(u.cached_tokens for u in on.usages)
        result.update(
            rounds=args.rounds,
            output_tokens_per_s=max(on_rates),
            output_tokens_per_s_caching_off=max(off_rates),
            cached_tokens=cached,
        )
        result["throughput_ratio_on_vs_off"] = (
            result["output_tokens_per_s"] / result["output_tokens_per_s_caching_off"]
        )
    else:
        cold = ttft_alone(unshared, relabel(workload.probes, "cold"))
        warm_up = run_concurrently(shared, workload.warmups)
        warm = ttft_alone(shared, workload.probes)
        main = run_concurrently(shared, workload.requests)
        result.update(
            fresh_prefill_tokens=warm_up.fresh_prefill_tokens + main.fresh_prefill_tokens,
            fresh_prefill_tokens_uncached=sum(len(r.prompt_token_ids) for r in workload.requests),
            cached_tokens=sum(usage.cached_tokens for usage in main.usages),
            ttft_cold_median_s=statistics.median(cold),
            ttft_warm_median_s=statistics.median(warm),
            output_tokens_per_s=main.output_tokens / main.seconds,
            total_seconds=main.seconds,
            peak_concurrent_requests=min(args.max_num_seqs, len(workload.requests)),
            peak_blocks_shared=peak_blocks(loaded, args, workload, caching=True),
            peak_blocks_unshared=peak_blocks(loaded, args, workload, caching=False),
        )
        result["warm_cold_ttft_ratio"] = result["ttft_warm_median_s"] / result["ttft_cold_median_s"]
    if args.baseline == "hf":
        hf = run_hf(loaded.model, workload.requests, args.hf_batch_size)
        result["hf_output_tokens_per_s"] = hf.output_tokens / hf.seconds
        result["hf_seconds"] = hf.seconds
        result["engine_vs_hf_throughput"] = (
            result["output_tokens_per_s"] / result["hf_output_tokens_per_s"]
        )
    result["machine"] = machine()
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=["sysprompt", "gsp", "unique"], default="sysprompt")
    parser.add_argument("--model", type=Path, help="a local model directory (default: tiny Llama)")
    parser.add_argument("--device", choices=DEVICE_SETTINGS, default="cpu")
    parser.add_argument("--dtype", choices=DTYPE_SETTINGS, default="float32")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--suffix-tokens", type=int, default=2048)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prompts-per-group", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--question-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-blocks", type=int, default=8192)
    parser.add_argument("--ttft-samples", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="on/off rounds for --workload unique")
    parser.add_argument("--baseline", choices=["hf"], help="also run transformers generate")
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="also write the JSON result to this file")
    parser.add_argument("--plot", help="draw TTFT and throughput to this PNG file")
    args = parser.parse_args(argv)
    if args.workload == "gsp":
        args.requests = args.groups * args.prompts_per_group
    if (
        min(args.requests, args.output_tokens, args.max_num_seqs, args.ttft_samples, args.rounds)
        < 1
    ):
        parser.error(
            "--requests, --output-tokens, --max-num-seqs, --ttft-samples, --rounds must be >= 1"
        )
    torch.set_grad_enabled(False)
    result = run(args)
    if args.plot:
        _plot(args.plot, result)
    emit(result, args.json, args.out)
    if not args.json:
        _print_summary(result)
    return result


def _plot(path: str, result: dict[str, Any]) -> None:
    if "ttft_cold_median_s" in result:
        labels = ["TTFT cold (s)", "TTFT warm (s)"]
        values = [result["ttft_cold_median_s"], result["ttft_warm_median_s"]]
    else:
        labels = ["tok/s caching on", "tok/s caching off"]
        values = [result["output_tokens_per_s"], result["output_tokens_per_s_caching_off"]]
    if "hf_output_tokens_per_s" in result:
        labels += ["engine tok/s", "transformers tok/s"]
        values += [result["output_tokens_per_s"], result["hf_output_tokens_per_s"]]
    plot_bars(path, f"bench.prefix {result['workload']}", labels, values, "value")


def _print_summary(result: dict[str, Any]) -> None:
    for key, value in result.items():
        if key == "machine":
            continue
        if isinstance(value, float):
            value = f"{value:,.4g}"
        elif isinstance(value, int):
            value = f"{value:,}"
        print(f"{key:<34} {value}")


if __name__ == "__main__":
    main()
