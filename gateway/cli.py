"""The `prefixgate` command line."""

from __future__ import annotations

import json
import sys
from typing import Annotated, NoReturn

import typer

from engine.capacity import plan_capacity
from engine.kv_spec import KVSpec, parse_dtype

app = typer.Typer(
    help="PrefixGate: a multi-tenant LLM gateway with a safely shared prefix cache.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def root() -> None:
    """PrefixGate: a multi-tenant LLM gateway with a safely shared prefix cache."""


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a one-line error and exit non-zero."""
    typer.echo(f"prefixgate: error: {message}", err=True)
    raise typer.Exit(code)


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:,.0f} B" if unit == "B" else f"{count:,.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


@app.command()
def plan(
    layers: Annotated[int, typer.Option(help="Transformer layers.")],
    kv_heads: Annotated[int, typer.Option(help="KV heads per layer.")],
    head_dim: Annotated[int, typer.Option(help="Size of one attention head.")],
    prefix_tokens: Annotated[int, typer.Option(help="Tokens of the shared prefix.")],
    suffix_tokens: Annotated[int, typer.Option(help="Unique tokens per request.")],
    requests: Annotated[int, typer.Option(help="Requests sharing the prefix.")],
    dtype: Annotated[str, typer.Option(help="KV dtype: bf16, fp16 or fp32.")] = "bf16",
    block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Plan KV memory and prefill work for requests sharing one prefix."""
    positive = {"--layers": layers, "--kv-heads": kv_heads, "--head-dim": head_dim}
    positive["--block-size"] = block_size
    for flag, value in positive.items():
        if value <= 0:
            fail(f"{flag} must be positive, got {value}")
    counts = {"--prefix-tokens": prefix_tokens, "--suffix-tokens": suffix_tokens}
    counts["--requests"] = requests
    for flag, value in counts.items():
        if value < 0:
            fail(f"{flag} must not be negative, got {value}")
    try:
        spec = KVSpec(layers, kv_heads, head_dim, parse_dtype(dtype), block_size)
        result = plan_capacity(spec, prefix_tokens, suffix_tokens, requests)
    except ValueError as error:
        fail(str(error))
    if as_json:
        typer.echo(json.dumps(result.as_dict()))
        return
    n = requests
    rows = [
        ("KV bytes per token", human_bytes(result.kv_bytes_per_token)),
        (
            "KV bytes per prefix",
            f"{human_bytes(result.kv_bytes_per_prefix)} ({prefix_tokens:,} tokens, "
            f"{result.shareable_prefix_tokens:,} shareable in whole blocks)",
        ),
        (
            f"Prefix copies for {n:,} requests",
            f"{human_bytes(result.prefix_copies_unshared_bytes)} unshared vs "
            f"{human_bytes(result.kv_bytes_per_prefix)} shared",
        ),
        (
            f"KV memory for {n:,} requests",
            f"{human_bytes(result.unshared_bytes)} unshared vs "
            f"{human_bytes(result.shared_bytes)} shared",
        ),
        (
            "Fresh prefill tokens",
            f"{result.fresh_prefill_tokens_uncached:,} without cache vs "
            f"{result.fresh_prefill_tokens_cached:,} with cache (one warm-up); "
            f"{result.avoided_prefill_tokens:,} avoided ({result.avoided_fraction:.1%})",
        ),
    ]
    width = max(len(label) for label, _ in rows)
    for label, text in rows:
        typer.echo(f"{label:<{width}}  {text}")
    typer.echo("Saved prefill tokens are not saved time: the suffix still attends over the prefix.")


@app.command()
def demo() -> None:
    """Show the prefix cache at work on a scripted multi-tenant workload (no model)."""
    from rich.console import Console
    from rich.table import Table

    from engine.budget import describe_owner
    from engine.demo import run_demo

    steps, stats = run_demo()
    console = Console()
    served = Table(title="Requests through the KV cache manager")
    for column in ("request", "prompt tokens", "cached tokens", "outcome"):
        served.add_column(column)
    for step in steps:
        served.add_row(
            step.description, f"{step.prompt_tokens:,}", f"{step.cached_tokens:,}", step.outcome
        )
    console.print(served)
    owners = Table(title="Blocks per owner")
    for column in ("owner", "active", "cached", "reserved", "quota", "reuse", "evicted"):
        owners.add_column(column)
    for owner, owner_stats in sorted(stats.owners.items(), key=lambda item: str(item[0])):
        counters = owner_stats.counters
        owners.add_row(
            describe_owner(owner),
            str(owner_stats.active_blocks),
            str(owner_stats.cached_blocks),
            str(owner_stats.reserved_blocks),
            str(owner_stats.quota_blocks),
            f"{counters.reuse:.0%}",
            str(counters.evicted_blocks),
        )
    console.print(owners)
    console.print(
        f"pool: {stats.num_blocks} blocks, {stats.free_blocks} free; "
        f"{stats.blocks_zeroed} blocks zeroed in {stats.zero_operations} batched operations; "
        f"{stats.collisions} verified key collisions"
    )


def main() -> None:
    """Entry point that keeps click's own usage errors but never shows a traceback."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
