"""Fairness benchmark: what a tenant flooding within its limits does to a light tenant's
latency, and what fair scheduling costs the flood, beside today's scheduling in the same run.

    python -m bench.fairness [--quick] [--modes per_step,fair] [--seconds 30] [--ramp 5]
        [--concurrency 4] [--prompt-tokens 1900] [--light-interval 0.5] [--model DIR]
        [--seed 0] [--json] [--out fairness.json] [--plot fairness.png]

For each scheduling mode (`PREFIXGATE_SCHEDULING`: `per_step`, the scheduling before issue 43,
and `fair`) a real `prefixgate serve` starts in a process of its own (bench/fairness_server.py:
the embedded SmolLM2 unless `--model`, SQLite, three tenants, an operator for the admin API);
all of them run at once, each gets one warm-up request of each tenant, and then five
scenarios run, each on every server in turn (bench/fairness_scenarios.py: the modes' windows
of a scenario are seconds apart, so the machine's drift in speed stays out of the comparison).
Each scenario has a window of `--seconds`; a flood starts `--ramp` seconds before its window
opens, so that it is at full strength when measured:

    light_alone   tenant light-b alone: a `--light-interval` trickle of short requests
                  (32 prompt tokens, max_tokens 2)
    heavy_alone   tenant heavy-a alone: `--concurrency` clients sending `--prompt-tokens`
                  prompts back to back (max_tokens 16), every other one with echo and logprobs
    mixed         heavy-a's flood and light-b's trickle together
    equal         heavy-a and heavy-c flood together, both of weight 1
    weighted      the same with heavy-a's scheduling weight set to 2 (admin API, PATCH
                  /admin/api/tenants/{id}); not run where the server refuses the weight

Each tenant's traffic comes from a process of its own (bench/fairness_load.py), so that no
client competes with the server or with the measuring process for a GIL. Service per tenant is
sampled from /metrics every half second (bench/fairness_service.py says what is read, and what
stands in for it when the server has no such family: `service_source` names the one used).

Reported per mode: light-b's latency p50/p99 alone and under the flood; heavy-a's tokens
computed per second alone and beside light-b (its throughput loss); each tenant's share of
service over each window and over time (the plot, bench/fairness_plot.py); the engine's steps
and their mean time, and the fewest threads it computed with, per window; and three goals, as
booleans beside the measured numbers (reported, not asserted): light-b's p50 under the flood
<= 2x its p50 alone + one target step (`engine.step_cost.target_ms` in /readyz; null where the
server reports none, and then the bound is 2x alone); equal weights give each flood 50% +/- 5%
of service; weights 2:1 give the heavier 67% +/- 5%. The JSON goes to `--out` (else to
stdout), the plot to `--plot` (else beside `--out`, as .png).

With defaults the whole run takes about seven minutes on a quiet 2-core machine; `--quick`
(windows of 5 s, ramps of 1.5 s) is a smoke run of two to four, most of it starting servers.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm
from transformers import AutoTokenizer

from bench.common import emit, fp32_kv_bytes_per_token, machine
from bench.fairness_plot import plot_shares
from bench.fairness_scenarios import (
    HEAVIER_WEIGHT,
    HEAVY,
    HEAVY_MAX_TOKENS,
    LIGHT,
    LIGHT_MAX_TOKENS,
    LIGHT_PROMPT_TOKENS,
    SCENARIOS,
    SECOND,
    Measured,
    Sizes,
    Window,
    measure,
)
from bench.fairness_server import FairnessServer, fairness_server
from bench.fairness_service import latency, rate, served, share_timeline, shares
from engine.model.loader import embedded_model_dir

MODES = ("per_step", "fair")
SHARE_TOLERANCE = 0.05
TIMELINE_WINDOW_S = 2.0  # the plot's share at a moment: over the seconds before it
# The scenarios whose shares are reported, and between which tenants.
SHARED = {"mixed": (HEAVY, LIGHT), "equal": (HEAVY, SECOND), "weighted": (HEAVY, SECOND)}


def report_mode(run: Measured, ramp_s: float) -> dict[str, Any]:
    """One mode's numbers and goals."""
    windows, series, weight_error = run.windows, run.series, run.weight_error
    light_alone = latency(windows["light_alone"].of(LIGHT))
    light_flood = latency(windows["mixed"].of(LIGHT))
    heavy_alone = heavy_rate(run, windows["heavy_alone"])
    heavy_mixed = heavy_rate(run, windows["mixed"])
    window_shares = {
        name: shares(served(series, windows[name].start, windows[name].end), tenants)
        for name, tenants in SHARED.items()
        if name in windows
    }
    timelines = {
        name: share_timeline(
            series, tenants, windows[name].start - ramp_s, windows[name].end, TIMELINE_WINDOW_S
        )
        for name, tenants in SHARED.items()
        if name in windows
    }
    target_ms = run.server.target_step_ms()
    return {
        "service_source": run.source,
        "target_step_ms": target_ms,
        "step_cost": run.server.ready.get("engine", {}).get("step_cost"),
        "light": {
            "alone": light_alone,
            "under_flood": light_flood,
            "p50_ratio": ratio(light_flood["p50_ms"], light_alone["p50_ms"]),
        },
        "heavy": {
            "alone_tokens_per_s": heavy_alone,
            "mixed_tokens_per_s": heavy_mixed,
            "throughput_loss": loss(heavy_alone, heavy_mixed),
        },
        "shares": window_shares,
        "timelines": timelines,
        "weights": {HEAVY: HEAVIER_WEIGHT, SECOND: 1.0} if weight_error is None else None,
        "weights_error": weight_error,
        "floods": {
            name: flood_counts(window) for name, window in windows.items() if name != "light_alone"
        },
        "steps": {name: step_times(run, window) for name, window in windows.items()},
        "cpu_threads_min": {name: fewest_threads(run, window) for name, window in windows.items()},
        "goals": goals(light_alone, light_flood, target_ms, window_shares, weight_error),
    }


def fewest_threads(run: Measured, window: Window) -> int | None:
    """The fewest threads the engine computed with in a window (its governor narrows them
    when its thread waits for a CPU)."""
    inside = (s.threads for s in run.samples if window.start <= s.at <= window.end)
    return min((threads for threads in inside if threads), default=None)


def heavy_rate(run: Measured, window: Window) -> float | None:
    """heavy-a's tokens computed per second in a window."""
    tokens_per_s = rate(run.tokens, HEAVY, window.start, window.end)
    return None if tokens_per_s is None else round(tokens_per_s, 1)


def step_times(run: Measured, window: Window) -> dict[str, Any]:
    """The engine's steps in a window: how many ended, and their mean time."""
    inside = [s for s in run.samples if window.start <= s.at <= window.end]
    if len(inside) < 2 or inside[-1].steps == inside[0].steps:
        return {"steps": 0, "mean_ms": None}
    steps = inside[-1].steps - inside[0].steps
    seconds = inside[-1].step_seconds - inside[0].step_seconds
    return {"steps": steps, "mean_ms": round(1000 * seconds / steps, 1)}


def loss(alone: float | None, beside: float | None) -> float | None:
    """The part of its rate alone that a tenant lost beside another."""
    if alone is None or beside is None or not alone:
        return None
    return round(1 - beside / alone, 4)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 2)


def flood_counts(window: Window) -> dict[str, Any]:
    """Per flooding tenant: requests answered (with echo), and every status seen."""
    counts: dict[str, Any] = {}
    for tenant in (HEAVY, SECOND):
        mine = window.of(tenant)
        if mine:
            answered = [answer for answer in mine if answer.status == 200]
            counts[tenant] = {
                "answered": len(answered),
                "answered_with_echo": sum(answer.echo for answer in answered),
                "statuses": dict(Counter(str(answer.status) for answer in mine)),
            }
    return counts


def goals(
    light_alone: dict[str, Any],
    light_flood: dict[str, Any],
    target_ms: float | None,
    window_shares: dict[str, dict[str, float | None]],
    weight_error: str | None,
) -> dict[str, Any]:
    """The issue's three goals, each with what was measured and the bound it was held to."""
    alone, flooded = light_alone["p50_ms"], light_flood["p50_ms"]
    bound = None if alone is None else round(2 * alone + (target_ms or 0.0), 1)
    light_goal = {
        "measured_p50_ms": flooded,
        "bound_ms": bound,
        "bound": "2 x alone p50 + target step"
        if target_ms is not None
        else "2 x alone p50 (the server reports no target step)",
        "met": None if bound is None or flooded is None else flooded <= bound,
    }
    equal = window_shares.get("equal", {}).get(HEAVY)
    weighted = window_shares.get("weighted", {}).get(HEAVY)
    heavier = HEAVIER_WEIGHT / (HEAVIER_WEIGHT + 1.0)
    return {
        "light_p50_under_flood": light_goal,
        "equal_weights_share": share_goal(equal, 0.5),
        "weights_2_1_share": share_goal(weighted, heavier)
        | ({"not_run": weight_error} if weight_error else {}),
    }


def share_goal(measured: float | None, target: float) -> dict[str, Any]:
    """A share within `SHARE_TOLERANCE` of its target (None: nothing was measured)."""
    met = None if measured is None else abs(measured - target) <= SHARE_TOLERANCE
    return {
        "measured": measured,
        "target": round(target, 4),
        "tolerance": SHARE_TOLERANCE,
        "met": met,
    }


# -- the run ---------------------------------------------------------------------------------


def normal_vocabulary(model_dir: Path) -> list[int]:
    """The tokenizer's ids that are neither special nor added: prompts of exact length."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    return [token for token in range(tokenizer.vocab_size) if token not in special]


def server_settings(model_dir: Path, sizes: Sizes) -> tuple[dict[str, str], int]:
    """The server's settings and each tenant's quota: a KV pool (in fp32, so any dtype fits)
    that holds both floods' requests and a few short ones at once, all of it each tenant's."""
    tokens_per_flood = sizes.concurrency * (sizes.prompt_tokens + HEAVY_MAX_TOKENS + 16)
    tokens = 2 * tokens_per_flood + 16 * (LIGHT_PROMPT_TOKENS + LIGHT_MAX_TOKENS + 16)
    pool_bytes = tokens * fp32_kv_bytes_per_token(model_dir) * 5 // 4
    return {"KV_CACHE_BYTES": str(pool_bytes)}, tokens // 16


def served_model(server: FairnessServer) -> str:
    """The name the server gives its model (what requests name in `model`)."""
    headers = {"Authorization": f"Bearer {server.keys[LIGHT]}"}
    listed = httpx.get(f"{server.url}/v1/models", headers=headers, timeout=30)
    listed.raise_for_status()
    return str(listed.json()["data"][0]["id"])


def run(model_dir: Path, modes: Sequence[str], sizes: Sizes, seed: int) -> dict[str, Any]:
    """Every scenario under each mode, one server per mode, all of them running at once."""
    started = time.perf_counter()
    vocabulary = normal_vocabulary(model_dir)
    settings, quota = server_settings(model_dir, sizes)
    tenants = (HEAVY, LIGHT, SECOND)
    with ExitStack() as stack:
        servers = {
            mode: stack.enter_context(
                fairness_server(model_dir, {**settings, "SCHEDULING": mode}, tenants, quota)
            )
            for mode in modes
        }
        models = {mode: served_model(server) for mode, server in servers.items()}
        total = len(modes) * len(SCENARIOS)
        with tqdm(total=total, desc="fairness", file=sys.stderr) as progress:
            runs = asyncio.run(measure(servers, models, vocabulary, sizes, seed, progress))
    return {
        "benchmark": "fairness",
        "machine": machine(),
        "model": model_dir.name,
        "sizes": {
            **asdict(sizes),
            "heavy_max_tokens": HEAVY_MAX_TOKENS,
            "light_prompt_tokens": LIGHT_PROMPT_TOKENS,
            "light_max_tokens": LIGHT_MAX_TOKENS,
        },
        "tenants": {"heavy": HEAVY, "light": LIGHT, "second_heavy": SECOND},
        "modes": {mode: report_mode(runs[mode], sizes.ramp_s) for mode in modes},
        "wall_s": round(time.perf_counter() - started, 1),
    }


def print_summary(result: dict[str, Any]) -> None:
    """A few lines per mode on stderr: the light tenant's latency, the flood's rate, the
    shares and the goals."""
    lines = []
    for mode, numbers in result["modes"].items():
        light, heavy, goals_ = numbers["light"], numbers["heavy"], numbers["goals"]
        met = {name: goal["met"] for name, goal in goals_.items()}
        lines += [
            f"{mode}: {LIGHT} p50/p99 {light['alone']['p50_ms']}/{light['alone']['p99_ms']} ms "
            f"alone, {light['under_flood']['p50_ms']}/{light['under_flood']['p99_ms']} ms under "
            f"the flood (x{light['p50_ratio']}); {HEAVY} {heavy['alone_tokens_per_s']} tok/s "
            f"alone, {heavy['mixed_tokens_per_s']} mixed (loss {heavy['throughput_loss']})",
            f"  shares {numbers['shares']}; target step {numbers['target_step_ms']} ms; "
            f"source {numbers['service_source']}; goals met {met}",
        ]
        if numbers["weights_error"]:
            lines.append(f"  weighted scenario not run: {numbers['weights_error']}")
    lines.append(f"wall time {result['wall_s']} s")
    print("\n".join(lines), file=sys.stderr)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 5 s windows")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated")
    parser.add_argument("--seconds", type=float, help="each measured window (default 30)")
    parser.add_argument("--ramp", type=float, help="a flood's start before its window (5)")
    parser.add_argument("--concurrency", type=int, default=4, help="clients per flood")
    parser.add_argument("--prompt-tokens", type=int, default=1900, help="per flood request")
    parser.add_argument("--light-interval", type=float, default=0.5, help="seconds")
    parser.add_argument("--model", type=Path, help="a model directory (default: embedded)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the JSON even with --out")
    parser.add_argument("--out", help="write the JSON result to this file (else to stdout)")
    parser.add_argument("--plot", help="the shares-over-time PNG (default: beside --out)")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if not modes or not set(modes) <= set(MODES) or len(set(modes)) != len(modes):
        parser.error(f"--modes takes some of {','.join(MODES)}, each once")
    sizes = Sizes(seconds=5.0, ramp_s=1.5) if args.quick else Sizes()
    sizes = replace(
        sizes,
        seconds=sizes.seconds if args.seconds is None else args.seconds,
        ramp_s=sizes.ramp_s if args.ramp is None else args.ramp,
        concurrency=args.concurrency,
        prompt_tokens=args.prompt_tokens,
        light_interval_s=args.light_interval,
    )
    if not 1 <= sizes.seconds <= 600 or not 0 <= sizes.ramp_s <= 60:
        parser.error("--seconds must be 1-600 and --ramp 0-60")
    if not 1 <= sizes.concurrency <= 16 or not 16 <= sizes.prompt_tokens <= 8000:
        parser.error("--concurrency must be 1-16 and --prompt-tokens 16-8000")
    if not 0.05 <= sizes.light_interval_s <= 10:
        parser.error("--light-interval must be 0.05-10 s")
    model_dir = (args.model or embedded_model_dir()).absolute()
    result = run(model_dir, modes, sizes, args.seed)
    emit(result, args.json or not args.out, args.out)
    print_summary(result)
    plot = args.plot or (args.out and str(Path(args.out).with_suffix(".png")))
    if plot:
        plot_shares(plot, result)
    return result


if __name__ == "__main__":
    main()
