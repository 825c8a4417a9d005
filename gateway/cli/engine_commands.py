"""Engine commands: `plan`, `demo`, `generate`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from gateway.cli.common import app, fail, load_settings, log_to_state_dir


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
    from engine.cache.capacity import plan_capacity
    from engine.cache.kv_spec import KVSpec, parse_dtype

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


@app.command(short_help="Chat as three users of two tenants through the prefix cache.")
def demo(
    model: Annotated[
        Path | None, typer.Option(help="A local model directory (default: embedded).")
    ] = None,
) -> None:
    """Chat as three users of two tenants through the prefix cache; show what each turn reused."""
    settings = load_settings()  # a mistaken setting is told before torch imports
    log_to_state_dir(settings)
    from rich.console import Console
    from rich.table import Table

    from engine.model.loader import ModelLoadError
    from gateway.cli.engine_demo import reuse_lines, run_demo
    from gateway.runtime.engine_setup import check_engine, load_configured_model

    try:
        check_engine(settings)
        loaded = load_configured_model(settings, model)
    except (ValueError, ModelLoadError) as error:
        fail(str(error))
    if loaded.tokenizer is None:
        fail(f"{loaded.name} has no tokenizer")
    try:
        turns, stats = run_demo(loaded, settings.attention_backend)
    except ValueError as error:  # a backend that does not fit the model (its head size)
        fail(str(error))
    console = Console()
    table = Table(title=f"{loaded.name} on the paged engine: a public system prompt, private chats")
    for column in ("tenant/user", "question", "answer", "prompt", "cached", "TTFT"):
        table.add_column(column)
    for turn in turns:
        table.add_row(
            f"{turn.tenant_id}/{turn.user_id}",
            turn.question,
            turn.answer,
            str(turn.prompt_tokens),
            str(turn.cached_tokens),
            f"{turn.ttft_s * 1000:.0f} ms",
        )
    console.print(table)
    for line in reuse_lines(stats):
        console.print(line)
    console.print(
        f"{stats.blocks_zeroed} blocks zeroed in {stats.zero_operations} batched operations. "
        "Alice's second turn reuses her first; Bob and Carol reuse only the public system prompt."
    )


@app.command(short_help="Stream one chat answer from the paged engine.")
def generate(
    prompt: Annotated[str, typer.Option(help="The user message.")],
    model: Annotated[
        Path | None, typer.Option(help="A local Hugging Face model directory (default: embedded).")
    ] = None,
    system: Annotated[str | None, typer.Option(help="An optional system message.")] = None,
    max_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 256,
    temperature: Annotated[float, typer.Option(help="0 for greedy.")] = 0.0,
    seed: Annotated[int | None, typer.Option(help="Seed for sampling.")] = None,
) -> None:
    """Generate a chat answer on the paged engine and stream it to the terminal."""
    settings = load_settings()  # a mistaken setting is told before torch imports
    log_to_state_dir(settings)
    from engine.cache.scope import User
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.errors import EngineError
    from engine.model.loader import ModelLoadError
    from engine.request import GenerationRequest
    from engine.sampling.sampler import InvalidSampling, SamplingParams
    from gateway.runtime.engine_setup import check_engine, load_configured_model
    from policies.templates import TemplateRejected, render

    try:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        check_engine(settings)
        loaded = load_configured_model(settings, model)
    except InvalidSampling as error:
        fail(f"--{error.param.replace('_', '-')}: {error}")
    except (ValueError, ModelLoadError) as error:
        fail(str(error))
    if loaded.tokenizer is None or not getattr(loaded.tokenizer, "chat_template", None):
        fail(f"{loaded.name} has no tokenizer with a chat template")
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    try:  # as the gateway renders it: special tokens in the text stay text
        token_ids = render(loaded.tokenizer, messages, generation_prompt=True)
    except TemplateRejected as error:
        fail(str(error))
    try:
        config = EngineConfig(
            max_num_seqs=1,
            warm_up=False,  # one request: warming up would cost it as much as it saves
            attention_backend=settings.attention_backend,
            kv_cache_bytes=settings.kv_cache_bytes,
            gpu_memory_fraction=settings.gpu_memory_fraction,
        )
        engine = Engine(loaded, config).start()
    except ValueError as error:  # a backend that does not fit the model (its head size)
        fail(str(error))
    request = GenerationRequest(
        "cli", "local", token_ids, sampling, tail_scope=User("local", "cli")
    )
    try:
        for delta in engine.generate_sync(request):
            typer.echo(delta.text, nl=False)
            if delta.usage is not None:
                typer.echo("")
                typer.echo(
                    f"[{delta.usage.prompt_tokens} prompt tokens, "
                    f"{delta.usage.completion_tokens} generated, finish: {delta.finish_reason}]",
                    err=True,
                )
    except EngineError as error:
        fail(str(error))
    finally:
        engine.stop()
