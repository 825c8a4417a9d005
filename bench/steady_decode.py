"""Is single-stream decode as fast in one fresh process as in the next, beside how much the
machine itself moved meanwhile?

    python -m bench.steady_decode [--model DIR | --tiny] [--dtype auto|bfloat16|float32]
        [--processes 5] [--steps 200] [--prefix-tokens 1024] [--unique-tokens 512]
        [--tolerance 1.25] [--json] [--out F]

A user who restarts a server gets a fresh process each time; if some processes decoded at half
the speed of others, bench.peers' medians would not be what that user sees. So this starts
`--processes` processes one after another, each as a server starts its engine (the model
loaded on a passing thread, the engine's warm-up included), and in each decodes one greedy
stream for `--steps` tokens after a prompt of `--prefix-tokens + --unique-tokens` random
tokens (EOS ignored). Each process probes the machine (bench/machine_speed.py: a matrix
product, an in-place pass and a read over 512 MiB) right before and right after its decode,
so the probes sample the same minutes as the decodes.

The check: the engine's spread (the fastest process's decode rate over the slowest's) against
the machine's (the fastest probe over the slowest, for the product and for reads, whichever
moved more). `steady` holds while the engine's spread is at most `--tolerance` times the
machine's: a machine that slowed by 1.3x may slow the engine by about as much, but an engine
that runs at two speeds on a machine that moved 1.1x fails. Each process also reports its
per-token gaps (median and 90th percentile), its thread governor's narrowings and its engine
thread's warm-up, so a failing run says which process was slow and whether it computed with
fewer threads.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.common import emit
from bench.machine_speed import Prober, Speed, product_dtype

TOLERANCE = 1.25


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One fresh process's measurement (runs in the child)."""
    from bench.prefix import tiny_llama
    from engine.cache.scope import User
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.model.loader import embedded_model_dir, load_model
    from engine.model.openmp import on_passing_thread
    from engine.precision import native_bf16_flags, resolve_dtype
    from engine.request import GenerationRequest
    from engine.sampling.sampler import SamplingParams

    prompt_tokens = args.prefix_tokens + args.unique_tokens
    if args.tiny:
        loaded = tiny_llama(prompt_tokens + args.steps + 64)
    else:
        model_dir = args.model or embedded_model_dir()
        dtype = resolve_dtype(args.dtype)
        loaded = on_passing_thread(lambda: load_model(model_dir, dtype=dtype))
    served = on_passing_thread(lambda: Engine(loaded, EngineConfig(max_num_seqs=1)))
    served.start()
    prober = Prober(product_dtype(loaded.model.dtype, bool(native_bf16_flags())))
    rng = random.Random(args.seed)
    ids = [rng.randrange(100, min(loaded.vocab_size, 20_000)) for _ in range(prompt_tokens)]
    sampling = SamplingParams(max_tokens=args.steps + 1, temperature=0.0, ignore_eos=True)
    request = GenerationRequest("steady", "bench", ids, sampling, tail_scope=User("bench", "u"))
    before = prober.probe()
    arrivals = [time.perf_counter() for delta in served.generate_sync(request) if delta.token_ids]
    after = prober.probe()
    described = served.describe()
    served.stop()
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    if not gaps:
        raise SystemExit("the decode produced fewer than two tokens")
    gaps.sort()
    return {
        "decode_tok_s": len(gaps) / sum(gaps),
        "gap_ms": {
            "p50": 1000 * statistics.median(gaps),
            "p90": 1000 * gaps[int(0.9 * (len(gaps) - 1))],
        },
        "probes": [asdict(before), asdict(after)],
        "warm_up_s": described["warm_up_s"],
        "cpu_threads": described["cpu_threads"],
        "dtype": described["dtype"],
    }


def spread(values: list[float]) -> float:
    """The largest value over the smallest."""
    return max(values) / min(values)


def judge(processes: list[dict[str, Any]], tolerance: float) -> dict[str, Any]:
    """The engine's spread against the machine's over the same minutes."""
    rates = [process["decode_tok_s"] for process in processes]
    probes = [Speed(**probe) for process in processes for probe in process["probes"]]
    machine_spread = {
        "matmul": spread([probe.matmul_tflops for probe in probes]),
        "read": spread([probe.read_gb_s for probe in probes]),
    }
    engine_spread = spread(rates)
    widest = max(machine_spread.values())
    return {
        "engine_spread": engine_spread,
        "machine_spread": machine_spread,
        "tolerance": tolerance,
        "steady": engine_spread <= tolerance * widest,
        "slowest_process": rates.index(min(rates)),
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a model directory (default: embedded)")
    parser.add_argument("--tiny", action="store_true", help="a seeded tiny Llama instead")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    parser.add_argument("--processes", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--unique-tokens", type=int, default=512)
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="also write the JSON result to this file")
    args = parser.parse_args(argv)
    if args.processes < 2 or args.steps < 2 or args.prefix_tokens + args.unique_tokens < 1:
        parser.error("--processes and --steps must be at least 2, and the prompt not empty")
    if args.tolerance < 1.0:
        parser.error("--tolerance must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from bench.peers import machine_info  # the CPU's model and flags: a record per family

    args = parse(argv)
    if args.child:
        print(json.dumps(child(args)))
        return {}
    passed = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--json",)]
    processes = []
    for index in range(args.processes):
        # A new process each time, as a restarted server is; the same prompt in each.
        completed = subprocess.run(
            [sys.executable, "-m", "bench.steady_decode", *without_output(passed), "--child"],
            capture_output=True,
            text=True,
            check=True,
        )
        processes.append({"process": index, **json.loads(completed.stdout.splitlines()[-1])})
    result = {
        "bench": "steady_decode",
        "model": "tiny" if args.tiny else str(args.model or "embedded"),
        "workload": {
            "prompt_tokens": args.prefix_tokens + args.unique_tokens,
            "steps": args.steps,
            "processes": args.processes,
        },
        "machine": machine_info(),
        "processes": processes,
        **judge(processes, args.tolerance),
    }
    emit(result, args.json, args.out)
    rates = ", ".join(f"{process['decode_tok_s']:.1f}" for process in processes)
    print(
        f"decode tok/s per process: {rates}; engine spread {result['engine_spread']:.2f}, "
        f"machine spread {max(result['machine_spread'].values()):.2f}: "
        + ("steady" if result["steady"] else "NOT steady"),
        file=sys.stderr,
    )
    return result


def without_output(argv: list[str]) -> list[str]:
    """`argv` less `--out F` (the parent writes the result, not each child)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            kept.append(arg)
    return kept


if __name__ == "__main__":
    main()
