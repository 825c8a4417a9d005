"""Decode steps alone, in this process: a step's time at 1 and at N streams, and its shares.

    python -m bench.decode_step [--model DIR | --tiny] [--dtype auto|bfloat16|float32]
        [--prefix-tokens 1024] [--unique-tokens 512] [--streams 16] [--steps 30] [--rounds 3]
        [--json] [--out F] [--plot F.png]

bench.peers' last target, aggregate decode at 16 streams >= 8x one stream, is a ratio of step
times: it holds when a 16-stream step takes at most twice a one-stream step. bench.peers
measures it end to end, over 16 tokens a request with prefills around them; this times the
decode steps alone (bench.peers' workload: a shared prefix cached once under one tenant, then
each stream's own tokens), rounds of one stream and of N alternating so that the machine's
drift lands on both, and reports the median step of each and `scaling` = N x one stream's
step / N streams' step (the target: >= 8 at 16). Every measured step is checked to be a
decode step of all N streams.

Then it profiles `--steps` steps of each with torch's profiler and splits a step's time into
attention (`prefixgate::paged_attention`), linear layers (the projections and the LM head:
`prefixgate::matrix_linear`, torch's and oneDNN's products) and the rest (norms, RoPE, KV
writes, sampling, the scheduler and Python), each op by its self time: what bounds the
16-stream scaling where it falls short. The split is exact for the `cpu` attention backend;
under `torch`, its gathers count as the rest and its matrix products as linear layers. The
profiler's own overhead lands in the rest (the profiled step is that much longer than the
timed one).

Last, the floor: the least time a step could take at the rates `bench.machine_speed` probes on
this machine (before and after the rounds, their medians), from what a step must do at least:
multiply every weight matrix a step reads whole by each stream's token and attend over each
stream's context (2 FLOP a multiply-add), and read those weights and the K/V once (the shared
prefix's once for all streams). A step takes at least the longer of its arithmetic at the
probe's product rate and its bytes at the probe's read rate, so `floor.scaling` = N x one
stream's floor / N streams' floor is the scaling that steps with no other work would reach: one
stream is bound by reading the weights, many by their arithmetic (or their K/V), and where the
product rate is low beside the read rate, that is under 8 at 16 streams. The probe's rates are
what torch's product and sum reach, not the hardware's peaks, so the floor is an estimate.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from bench.common import emit, machine, plot_bars
from bench.machine_speed import Prober, Speed, product_dtype, summary, typical
from bench.prefix import tiny_llama
from engine.cache.kv_spec import dtype_name
from engine.cache.scope import Tenant
from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import EngineError
from engine.model.loader import LoadedModel, embedded_model_dir, load_model
from engine.precision import native_bf16_flags, resolve_dtype
from engine.request import GenerationDelta, GenerationRequest
from engine.sampling.sampler import SamplingParams

TENANT = "bench"
T = TypeVar("T")
LINEAR_OPS = ("::mm", "::addmm", "::bmm", "::matmul")


def share_of(name: str) -> str:
    """Which part of a step an op's self time belongs to."""
    if "attention" in name:
        return "attention"
    if "linear" in name or name.endswith(LINEAR_OPS):
        return "linear"
    return "rest"


@dataclass(frozen=True, slots=True)
class StepWork:
    """What a decode step must do at least: FLOPs of arithmetic and bytes read."""

    flops: float
    nbytes: float

    def floor_ms(self, speed: Speed) -> tuple[float, str]:
        """The least milliseconds this work takes at `speed`'s rates, and which one bounds it:
        "compute" or "memory"."""
        compute = self.flops / (speed.matmul_tflops * 1e12)
        memory = self.nbytes / (speed.read_gb_s * 1e9)
        return max(compute, memory) * 1000, "compute" if compute >= memory else "memory"


def step_work(
    model: PreTrainedModel, prefix_tokens: int, unique_tokens: int, streams: int
) -> StepWork:
    """A decode step of `streams` streams over a shared prefix of `prefix_tokens` and
    `unique_tokens` of each stream's own: every weight matrix a step reads whole (all but an
    input embedding that is not also the LM head: a step reads only its tokens' rows of that)
    times each stream's token, each stream's attention over its whole context (q.k and p.v, one
    multiply-add each per head and dimension), and the bytes of those weights and of the K/V."""
    config = model.config
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight is embedding
    weights = sum(
        p.numel() for p in model.parameters() if p.dim() == 2 and (tied or p is not embedding)
    )
    element = model.dtype.itemsize
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    context = prefix_tokens + unique_tokens
    attention = 2 * 2 * layers * heads * head_dim * context
    kv_per_token = layers * 2 * kv_heads * head_dim * element
    return StepWork(
        flops=streams * (2 * weights + attention),
        nbytes=weights * element + kv_per_token * (prefix_tokens + streams * unique_tokens),
    )


def model_shapes(model_dir: Path, dtype: torch.dtype) -> PreTrainedModel:
    """The model in `model_dir` as `step_work` needs it: its parameters' shapes and dtype on
    the meta device, with no weights read or held."""
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def floor_scaling(
    work: StepWork, one: StepWork, streams: int, speed: Speed, one_speed: Speed | None = None
) -> float:
    """How much faster `streams` streams would decode than one (`one`'s work) if each step
    took its floor: the streams' at `speed`, the one's at `one_speed` (default `speed`), for
    a ratio of two measurements taken while the machine ran at different rates."""
    alone = one.floor_ms(one_speed or speed)[0]
    return streams * alone / work.floor_ms(speed)[0]


class Streams:
    """Rounds of n decoding streams over one cached prefix, on one engine."""

    def __init__(self, loaded: LoadedModel, args: argparse.Namespace) -> None:
        self.args = args
        vocab = int(loaded.model.config.vocab_size)
        self.rng = random.Random(0)
        self.prefix = [self.rng.randrange(100, vocab) for _ in range(args.prefix_tokens)]
        defaults = EngineConfig()
        # Prompts are prefilled a step's budget at a time while the first ones already decode:
        # each request runs long enough that every stream decodes through the measured steps.
        prompt = args.prefix_tokens + args.unique_tokens
        prefill_steps = math.ceil(args.streams * prompt / defaults.max_num_batched_tokens)
        self.max_tokens = args.steps + prefill_steps + 4
        blocks = math.ceil((prompt + self.max_tokens) * (args.streams + 1) / defaults.block_size)
        config = replace(defaults, num_blocks=blocks + 64, max_num_seqs=max(64, args.streams))
        self.engine = Engine(loaded, config)
        self.count = 0
        self.run(1, lambda: None)  # the prefix cached, code paths and allocators warm

    def run(self, streams: int, steps: Callable[[], T]) -> T:
        """Submit `streams` requests on the prefix, step until each has its first token, call
        `steps` (which steps the engine through the decode steps measured), then drain."""
        started: set[str] = set()
        failures: list[Exception] = []
        sampling = SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)
        for _ in range(streams):
            self.count += 1
            request_id = f"r{self.count}"
            own = [self.rng.randrange(100, 1000) for _ in range(self.args.unique_tokens)]
            request = GenerationRequest(
                request_id, TENANT, self.prefix + own, sampling, tail_scope=Tenant(TENANT)
            )

            def sink(item: GenerationDelta | Exception, request_id: str = request_id) -> None:
                if isinstance(item, Exception):
                    failures.append(item)
                else:
                    started.add(request_id)

            self.engine.submit(request, sink)
        while len(started) < streams and not failures and self.engine.step():
            pass
        if failures:
            raise failures[0]
        measured = steps()
        while self.engine.step():
            pass
        if failures:
            raise failures[0]
        return measured

    def decode_step(self, streams: int) -> None:
        """One engine step, which must be a decode step of all `streams` streams."""
        scheduler = self.engine.scheduler
        if len(scheduler.running) != streams or scheduler.waiting:
            raise RuntimeError(f"a measured step ran {len(scheduler.running)} of {streams} streams")
        self.engine.step()

    def step_times(self, streams: int) -> list[float]:
        """Milliseconds of each of `--steps` decode steps of `streams` streams."""

        def timed() -> list[float]:
            times = []
            for _ in range(self.args.steps):
                begun = time.perf_counter()
                self.decode_step(streams)
                times.append((time.perf_counter() - begun) * 1000)
            return times

        return self.run(streams, timed)

    def shares(self, streams: int) -> dict[str, float]:
        """A profiled decode step of `streams` streams: milliseconds of attention, linear
        layers and the rest (the step's wall time less the other two)."""

        def profiled() -> dict[str, float]:
            with profile(activities=[ProfilerActivity.CPU]) as trace:
                begun = time.perf_counter()
                for _ in range(self.args.steps):
                    self.decode_step(streams)
                wall = (time.perf_counter() - begun) * 1000 / self.args.steps
            parts = {"attention": 0.0, "linear": 0.0}
            for event in trace.key_averages():
                part = share_of(event.key)
                if part in parts:
                    parts[part] += event.self_cpu_time_total / 1000 / self.args.steps
            return {**parts, "rest": wall - sum(parts.values()), "step": wall}

        return self.run(streams, profiled)


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        return value

    return parse


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model directory (default: the embedded SmolLM2)")
    parser.add_argument("--tiny", action="store_true", help="a seeded tiny Llama instead")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    parser.add_argument("--prefix-tokens", type=at_least(0), default=1024)
    parser.add_argument("--unique-tokens", type=at_least(1), default=512)
    parser.add_argument("--streams", type=at_least(2), default=16)
    parser.add_argument("--steps", type=at_least(1), default=30, help="decode steps a round")
    parser.add_argument("--rounds", type=at_least(1), default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="also write the JSON result to this file")
    parser.add_argument("--plot", help="draw each stream count's step shares to this PNG")
    args = parser.parse_args(argv)
    if args.tiny:
        loaded = tiny_llama(args.prefix_tokens + args.unique_tokens + args.steps + 64)
    else:
        loaded = load_model(args.model or embedded_model_dir(), dtype=resolve_dtype(args.dtype))
    counts = (1, args.streams)
    # Before the engine packs the weights (the model's own parameters are counted).
    work = {
        count: step_work(loaded.model, args.prefix_tokens, args.unique_tokens, count)
        for count in counts
    }
    prober = Prober(product_dtype(loaded.model.dtype, bool(native_bf16_flags())))
    speeds = [prober.probe()]
    medians: dict[int, list[float]] = {count: [] for count in counts}
    try:
        streams = Streams(loaded, args)
        for _ in range(args.rounds):
            for count in counts:
                medians[count].append(statistics.median(streams.step_times(count)))
        shares = {str(count): streams.shares(count) for count in counts}
    except EngineError as error:  # a workload this model or pool cannot hold
        parser.error(str(error))
    speeds.append(prober.probe())
    speed = typical(speeds)
    floor: dict[str, Any] = {"product": prober.describe(), "rates": summary(speeds)}
    for count in counts:
        ms, bound = work[count].floor_ms(speed)
        floor[str(count)] = {
            "flops": work[count].flops,
            "bytes": work[count].nbytes,
            "ms": ms,
            "bound": bound,
        }
    floor["scaling"] = floor_scaling(work[args.streams], work[1], args.streams, speed)
    step_ms = {count: statistics.median(medians[count]) for count in counts}
    served = streams.engine.describe()
    result = {
        "bench": "decode_step",
        "model": loaded.name,
        "dtype": dtype_name(loaded.model.dtype),
        "attention_backend": served["attention_backend"],
        "linear_kernel": served["linear_kernel"],
        "prefix_tokens": args.prefix_tokens,
        "unique_tokens": args.unique_tokens,
        "streams": args.streams,
        "step_ms": {str(count): step_ms[count] for count in counts},
        "step_ms_per_round": {str(count): medians[count] for count in counts},
        "scaling": args.streams * step_ms[1] / step_ms[args.streams],
        "shares_ms": shares,
        "floor": floor,
        "machine": machine(),
    }
    if not args.json:
        for count in counts:
            parts_ms = shares[str(count)]
            print(
                f"{count:3d} streams: step {step_ms[count]:.2f} ms (profiled "
                f"{parts_ms['step']:.2f}: attention {parts_ms['attention']:.2f}, linear "
                f"{parts_ms['linear']:.2f}, rest {parts_ms['rest']:.2f})"
            )
        print(f"{args.streams} streams decode {result['scaling']:.2f}x one stream (target 8x)")
        many = floor[str(args.streams)]
        print(
            f"floor at the probed {speed.matmul_tflops:g} TFLOP/s and {speed.read_gb_s:g} GB/s "
            f"read: {floor['1']['ms']:.2f} ms at 1 stream ({floor['1']['bound']}), "
            f"{many['ms']:.2f} ms at {args.streams} ({many['bound']}): {floor['scaling']:.2f}x "
            "with no other work"
        )
    if args.plot:
        parts = ("attention", "linear", "rest")
        labels = [f"{count}: {part}" for count in counts for part in parts]
        values = [shares[str(count)][part] for count in counts for part in parts]
        plot_bars(args.plot, "decode step, ms", labels, values, "ms")
    emit(result, args.json, args.out)
    return result


if __name__ == "__main__":
    main()
