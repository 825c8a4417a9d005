"""Shared plumbing for benchmarks: JSON output and optional PNG plots."""

from __future__ import annotations

import json
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch


def machine() -> dict[str, Any]:
    """Where a result was measured."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }


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
