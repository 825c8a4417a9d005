"""Shared plumbing for benchmarks: JSON output, optional PNG plots, a model's KV size."""

from __future__ import annotations

import json
import platform
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

BENCH_MODEL = "tiny-chat"


def machine() -> dict[str, Any]:
    """Where a result was measured."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }


def fp32_kv_bytes_per_token(model_dir: Path) -> int:
    """The KV bytes one token takes in every layer of this model, in fp32."""
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return int(config.num_hidden_layers * 2 * kv_heads * head_dim * 4)


def emit(result: Mapping[str, Any], as_json: bool, out: str | None) -> None:
    """Print the result (one JSON object with --json) and write it to `out` if given."""
    text = json.dumps(result, indent=None if as_json else 2, sort_keys=False)
    if out:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    if as_json:
        sys.stdout.write(text + "\n")


def plot_bars(
    path: str, title: str, labels: Sequence[str], values: Sequence[float], unit: str
) -> None:
    """Draw a simple bar chart to a PNG file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.bar(labels, values, color="#4477aa")
    axes.set_title(title)
    axes.set_ylabel(unit)
    for index, value in enumerate(values):
        axes.annotate(f"{value:.3g}", (index, value), ha="center", va="bottom")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


@contextmanager
def bench_gateway(overrides: Mapping[str, Any] | None = None) -> Iterator[tuple[Any, str]]:
    """A real gateway on a localhost port (SQLite, a tiny random Llama with SmolLM2's
    tokenizer) and an API key of a tenant with limits no benchmark reaches."""
    from bench.local_server import serve, tiny_chat_model
    from engine.model.loader import embedded_model_dir
    from tenancy import api_keys, tenants
    from tenancy.migrate import upgrade
    from tenancy.store import Store
    from tenancy.tenants import TenantLimits

    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        model_dir = tiny_chat_model(work / BENCH_MODEL, embedded_model_dir())
        database = f"sqlite:///{work / 'bench.db'}"
        upgrade(database)
        store = Store.open(database, work / "seed.spool", "bench-key", "bench-signing")
        with store.transaction() as session:
            limits = TenantLimits(requests_per_minute=100_000, tokens_per_minute=10**9,
                                  max_concurrent=10_000, cache_quota_blocks=100_000)  # fmt: skip
            tenant = tenants.create_tenant(session, "bench", limits=limits)
            key = api_keys.create_key(session, tenant, "bench", "bench-key").secret
        store.close()
        settings = {
            "database_url": database, "state_dir": work, "key_hash_secret": "bench-key",
            "audit_signing_key": "bench-signing", "model_dir": model_dir,
            **(overrides or {}),
        }  # fmt: skip
        with serve(settings) as server:
            yield server, key


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]
