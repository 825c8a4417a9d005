"""Decode steps alone, in this process: a step's time at 1 and at N streams, and its shares.

    python -m bench.decode_step [--model DIR | --tiny] [--prefix-tokens 1024]
        [--unique-tokens 512] [--streams 16] [--steps 30] [--rounds 3] [--json] [--out F]

bench.peers' last target, aggregate decode at 16 streams >= 8x one stream, is a ratio of step
times: it holds when a 16-stream step takes at most twice a one-stream step. bench.peers
measures it end to end, over 16 tokens a request with prefills around them; this times the
decode steps alone (bench.peers' workload: a shared prefix cached once under one tenant, then
each stream's own tokens), rounds of one stream and of N alternating so that the machine's
drift lands on both, and reports the median step of each and `scaling` = N x one stream's
step / N streams' step (the target: >= 8 at 16).

Then it profiles `--steps` steps of each with torch's profiler and splits a step's time into
attention (`prefixgate::paged_attention`, or the torch backend's ops), linear layers (the
projections and the LM head: `prefixgate::matrix_linear`, torch's and oneDNN's products) and
the rest (norms, RoPE, KV writes, sampling, the scheduler and Python), each op by its self
time: the shares the issue asks for wherever the target is not met. The profiler adds its own
overhead to the rest (about a millisecond a step for the embedded model).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile

from bench.common import emit, machine, plot_bars
from bench.prefix import tiny_llama
from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_spec import dtype_name
from engine.model_loader import LoadedModel, embedded_model_dir, load_model
from engine.precision import resolve_dtype
from engine.request import GenerationDelta, GenerationRequest
from engine.sampler import SamplingParams
from engine.scope import Tenant

TENANT = "bench"
LINEAR_OPS = ("::mm", "::addmm", "::bmm", "::matmul")


def share_of(name: str) -> str:
    """Which part of a step an op's self time belongs to."""
    if "attention" in name:
        return "attention"
    if "linear" in name or name.endswith(LINEAR_OPS):
        return "linear"
    return "rest"


class Streams:
    """Rounds of n decoding streams over one cached prefix, on one engine."""

    def __init__(self, loaded: LoadedModel, args: argparse.Namespace) -> None:
        self.args = args
        vocab = int(loaded.model.config.vocab_size)
        self.rng = random.Random(0)
        self.prefix = [self.rng.randrange(100, vocab) for _ in range(args.prefix_tokens)]
        tokens = (args.prefix_tokens + args.unique_tokens + args.steps + 8) * args.streams
        config = EngineConfig(num_blocks=tokens // 16 + 64, max_num_seqs=max(64, args.streams))
        self.engine = Engine(loaded, config)
        self.count = 0
        self.run(1, lambda: None)  # the prefix cached, code paths and allocators warm

    def run(self, streams: int, steps: Callable[[], Any]) -> Any:
        """Submit `streams` requests on the prefix, step until each has its first token, call
        `steps` (which steps the engine through the decode steps measured), then drain."""
        started: set[str] = set()
        sampling = SamplingParams(max_tokens=self.args.steps + 4, temperature=0.0, ignore_eos=True)
        for _ in range(streams):
            self.count += 1
            request_id = f"r{self.count}"
            own = [self.rng.randrange(100, 1000) for _ in range(self.args.unique_tokens)]
            request = GenerationRequest(
                request_id, TENANT, self.prefix + own, sampling, tail_scope=Tenant(TENANT)
            )

            def sink(item: GenerationDelta | Exception, request_id: str = request_id) -> None:
                if isinstance(item, Exception):
                    raise item
                started.add(request_id)

            self.engine.submit(request, sink)
        while len(started) < streams:
            self.engine.step()
        measured = steps()
        while self.engine.step():
            pass
        return measured

    def step_times(self, streams: int) -> list[float]:
        """Milliseconds of each of `--steps` decode steps of `streams` streams."""

        def timed() -> list[float]:
            times = []
            for _ in range(self.args.steps):
                begun = time.perf_counter()
                self.engine.step()
                times.append((time.perf_counter() - begun) * 1000)
            return times

        result: list[float] = self.run(streams, timed)
        return result

    def shares(self, streams: int) -> dict[str, float]:
        """A profiled decode step of `streams` streams: milliseconds of attention, linear
        layers and the rest (the step's wall time less the other two)."""

        def profiled() -> dict[str, float]:
            with profile(activities=[ProfilerActivity.CPU]) as trace:
                begun = time.perf_counter()
                for _ in range(self.args.steps):
                    self.engine.step()
                wall = (time.perf_counter() - begun) * 1000 / self.args.steps
            parts = {"attention": 0.0, "linear": 0.0}
            for event in trace.key_averages():
                part = share_of(event.key)
                if part in parts:
                    parts[part] += event.self_cpu_time_total / 1000 / self.args.steps
            return {**parts, "rest": wall - sum(parts.values()), "step": wall}

        result: dict[str, float] = self.run(streams, profiled)
        return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory (default: the embedded SmolLM2)")
    parser.add_argument("--tiny", action="store_true", help="a seeded tiny Llama instead")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--unique-tokens", type=int, default=512)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30, help="decode steps measured a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="also write the JSON result to this file")
    parser.add_argument("--plot", help="draw each stream count's step shares to this PNG")
    args = parser.parse_args(argv)
    if args.tiny:
        loaded = tiny_llama(args.prefix_tokens + args.unique_tokens + args.steps + 64)
    else:
        loaded = load_model(args.model or embedded_model_dir(), dtype=resolve_dtype(args.dtype))
    streams = Streams(loaded, args)
    counts = (1, args.streams)
    medians: dict[int, list[float]] = {count: [] for count in counts}
    for _ in range(args.rounds):
        for count in counts:
            medians[count].append(statistics.median(streams.step_times(count)))
    step_ms = {count: statistics.median(medians[count]) for count in counts}
    result = {
        "bench": "decode_step",
        "model": loaded.name,
        "dtype": dtype_name(loaded.model.dtype),
        "attention_backend": streams.engine.describe()["attention_backend"],
        "linear_kernel": streams.engine.describe()["linear_kernel"],
        "prefix_tokens": args.prefix_tokens,
        "unique_tokens": args.unique_tokens,
        "streams": args.streams,
        "step_ms": {str(count): step_ms[count] for count in counts},
        "step_ms_per_round": {str(count): medians[count] for count in counts},
        "scaling": args.streams * step_ms[1] / step_ms[args.streams],
        "shares_ms": {str(count): streams.shares(count) for count in counts},
        "machine": machine(),
    }
    if not args.json:
        for count in counts:
            shares = result["shares_ms"][str(count)]
            print(
                f"{count:3d} streams: step {step_ms[count]:.2f} ms (profiled "
                f"{shares['step']:.2f}: attention {shares['attention']:.2f}, linear "
                f"{shares['linear']:.2f}, rest {shares['rest']:.2f})"
            )
        print(f"{args.streams} streams decode {result['scaling']:.2f}x one stream (target 8x)")
    if args.plot:
        parts = ("attention", "linear", "rest")
        labels = [f"{count}: {part}" for count in counts for part in parts]
        values = [result["shares_ms"][str(count)][part] for count in counts for part in parts]
        plot_bars(args.plot, "decode step, ms", labels, values, "ms")
    emit(result, args.json, args.out)
    return result


if __name__ == "__main__":
    main()
