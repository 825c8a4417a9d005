"""The engines `bench.peers` compares, each started once and then handed one phase at a time.

`bench.peers` interleaves them: every phase runs on every engine in turn before the next phase
starts, so that the engines' measurements of one phase are seconds apart, not minutes. Each
runner keeps its engine loaded (a model in this process, a server or a vLLM process idle in
the background) between its phases.

Every runner reports the times at which each token reached its client:
  - engine: PrefixGate's `Engine` in this process, driven by `Engine.step()`; one Tenant scope.
  - api: `prefixgate serve` as a subprocess (its own GIL; SQLite and state in a temp dir; a
    tenant and key made with the CLI), `/v1/completions` with token-id prompts, streamed with
    httpx; TTFT is the first streamed text. The API has no `ignore_eos`, so a request may stop
    at EOS (counted as `stopped_early`), and it streams text, so agreement compares text.
  - transformers: `generate` with sdpa attention; cold phases from scratch, the others from the
    prefix's DynamicCache computed once and deep-copied per request (the copy is timed).
  - vllm: bench/vllm_runner.py in the vLLM interpreter, one process with prefix caching off and
    one with it on; see its docstring for how it streams and the CPU settings it uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    StoppingCriteria,
    StoppingCriteriaList,
)

from bench.common import fp32_kv_bytes_per_token
from bench.served_gateway import served_gateway
from engine.cache.kv_spec import dtype_name
from engine.cache.scope import Tenant
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.loader import load_model
from engine.model.openmp import foreign_environment
from engine.precision import resolve_dtype
from engine.request import GenerationDelta, GenerationRequest
from engine.sampling.sampler import SamplingParams
from engine.sequence import Sink

TENANT = "bench"
GIB = 1 << 30
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
VLLM_RUNNER = Path(__file__).with_name("vllm_runner.py")
ANSWER_TIMEOUT_S = 900  # vLLM's start-up (compiling its graphs) or one phase, at most


@dataclass(frozen=True, slots=True)
class Phase:
    """Requests submitted together; `kind` is first, cold, prime, warm or streams."""

    name: str
    kind: str
    prompts: list[list[int]]


@dataclass(frozen=True, slots=True)
class Workload:
    """The same token ids for every engine, phase by phase, and the KV pool each gets."""

    model_dir: Path
    prefix: list[int]
    phases: list[Phase]
    output_tokens: int
    concurrency: int
    kv_cache_gib: int

    def of_kind(self, kind: str) -> list[Phase]:
        return [phase for phase in self.phases if phase.kind == kind]


@dataclass(slots=True)
class Trace:
    """One request as its client saw it; `times` are seconds from its phase's start."""

    times: list[float] = field(default_factory=list)  # per token (per text chunk over HTTP)
    completion_tokens: int = 0
    token_ids: list[int] | None = field(default_factory=list)  # None: the client sees text
    text: str | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class CpuThreads:
    """What PrefixGate's ThreadGovernor (engine/model/openmp.py) reports: the OpenMP threads its
    steps compute with now, and how often it has gone from all of them to fewer."""

    threads: int
    narrowings: int


@dataclass(slots=True)
class EngineRun:
    """What one engine did: the dtype it computed in, and its traces per phase."""

    name: str
    dtype: str
    traces: dict[str, list[Trace]]
    notes: dict[str, Any] = field(default_factory=dict)


class Runner(ABC):
    """One engine: `start()` loads it, `run(phase)` times a phase, `close()` releases it, and
    `result()` is what it did."""

    name: str

    def __init__(self, workload: Workload, dtype: str) -> None:
        self.workload, self.dtype = workload, dtype
        self.traces: dict[str, list[Trace]] = {}
        # Phases during which PrefixGate's engine computed with fewer threads than it started
        # with (its ThreadGovernor judged the CPUs busy): their numbers are not the engine's
        # best. None for an engine that does not say.
        self.narrowed_phases: list[str] | None = None
        self._all_threads: int | None = None

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def run_phase(self, phase: Phase) -> list[Trace]: ...

    def close(self) -> None:  # noqa: B027 - most runners hold nothing outside this process
        """Release what `start` took (processes, files); safe to call more than once."""

    @abstractmethod
    def result(self) -> EngineRun: ...

    def cpu_threads(self) -> CpuThreads | None:
        """The threads PrefixGate's engine computes with now; None for the other engines."""
        return None

    def run(self, phase: Phase) -> None:
        before = self.cpu_threads()
        self.traces[phase.name] = self.run_phase(phase)
        after = self.cpu_threads()
        if before is None or after is None:
            return
        if self._all_threads is None:  # a fresh engine starts with all of them
            self._all_threads, self.narrowed_phases = before.threads, []
        if before.threads < self._all_threads or after.narrowings > before.narrowings:
            self.narrowed_phases = [*(self.narrowed_phases or []), phase.name]


class EngineRunner(Runner):
    """PrefixGate's engine in this process, stepped on this thread; one Tenant scope."""

    name = "prefixgate_engine"

    def start(self) -> None:
        self.loaded = load_model(self.workload.model_dir, dtype=resolve_dtype(self.dtype))
        pool = self.workload.kv_cache_gib * GIB
        seqs = max(64, self.workload.concurrency)
        config = EngineConfig(kv_cache_bytes=pool, max_num_seqs=seqs, queue_timeout_s=3600)
        self.engine = Engine(self.loaded, config)

    def run_phase(self, phase: Phase) -> list[Trace]:
        sampling = SamplingParams(
            max_tokens=self.workload.output_tokens, temperature=0.0, ignore_eos=True
        )
        traces = [Trace() for _ in phase.prompts]
        started = time.perf_counter()
        for index, prompt in enumerate(phase.prompts):
            request_id = f"{phase.name}-{index}"
            request = GenerationRequest(
                request_id, TENANT, prompt, sampling, tail_scope=Tenant(TENANT)
            )
            self.engine.submit(request, recorder(traces[index], started))
        while self.engine.step():
            pass
        return traces

    def cpu_threads(self) -> CpuThreads | None:
        governor = self.engine.threads
        return None if governor is None else CpuThreads(governor.threads, governor.narrowed)

    def result(self) -> EngineRun:
        dtype = dtype_name(self.loaded.model.dtype)
        return EngineRun(self.name, dtype, self.traces, self.engine.describe())


def recorder(trace: Trace, started: float) -> Sink:
    """An engine sink that timestamps each token into `trace`."""

    def sink(item: GenerationDelta | Exception) -> None:
        if isinstance(item, Exception):
            raise item
        assert trace.token_ids is not None
        trace.times += [time.perf_counter() - started] * len(item.token_ids)
        trace.token_ids += item.token_ids
        trace.completion_tokens = len(trace.token_ids)
        if item.usage is not None:
            trace.cached_tokens = item.usage.cached_tokens

    return sink


class StepClock(StoppingCriteria):
    """Notes when `generate` produced each token; never stops it."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class TransformersRunner(Runner):
    """transformers `generate` (sdpa): cold from scratch, warm from a copied prefix cache."""

    name = "transformers"

    def start(self) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(
            self.workload.model_dir,
            dtype=TORCH_DTYPES.get(self.dtype, "auto"),
            attn_implementation="sdpa",
            local_files_only=True,
        ).eval()
        self.generation = copy.deepcopy(self.model.generation_config)  # no eos_token_id
        self.generation.update(
            eos_token_id=None, do_sample=False, max_new_tokens=self.workload.output_tokens
        )
        self.prefix_cache: DynamicCache | None = None

    def run_phase(self, phase: Phase) -> list[Trace]:
        ids = torch.tensor(phase.prompts)
        clock = StepClock()
        started = time.perf_counter()
        reuse: dict[str, Any] = {}
        if self.prefix_cache is not None and phase.kind in ("warm", "streams"):
            reuse["cache"] = copy.deepcopy(self.prefix_cache)  # timed: part of reusing it
            reuse["cache"].batch_repeat_interleave(len(phase.prompts))
        output = self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=self.generation,
            stopping_criteria=StoppingCriteriaList([clock]),
            **reuse,
        )
        times = [moment - started for moment in clock.times]
        rows = output[:, ids.shape[1] :].tolist()
        if phase.kind == "prime":
            prefix = torch.tensor([self.workload.prefix])
            empty = DynamicCache(config=self.model.config)
            self.prefix_cache = self.model(input_ids=prefix, cache=empty).cache
        return [Trace(times, len(row), row) for row in rows]

    def result(self) -> EngineRun:
        return EngineRun(self.name, dtype_name(self.model.dtype), self.traces)


class ApiRunner(Runner):
    """PrefixGate's HTTP API in a subprocess: streamed `/v1/completions` with token ids, each
    phase's requests sent at once, each on its own connection."""

    name = "prefixgate_api"

    def start(self) -> None:
        workload = self.workload
        pool = workload.kv_cache_gib * GIB
        quota = pool // (16 * fp32_kv_bytes_per_token(workload.model_dir))  # the pool, in fp32
        seqs = max(64, workload.concurrency)
        server = served_gateway(workload.model_dir, pool, self.dtype, quota, seqs, TENANT)
        served = server.__enter__()
        self.server = server  # entered: close() exits it
        self.url, key = served.url, served.keys[TENANT][0]
        self.loop = asyncio.Runner()
        headers = {"Authorization": f"Bearer {key}"}
        limits = httpx.Limits(max_connections=workload.concurrency + 4)
        self.client = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=600, limits=limits
        )
        self.model = self.get("/v1/models")["data"][0]["id"]
        self.ready = served.ready

    def get(self, path: str) -> Any:
        response = self.loop.run(self.client.get(path))
        response.raise_for_status()
        return response.json()

    def run_phase(self, phase: Phase) -> list[Trace]:
        return self.loop.run(self.stream_phase(phase))

    def cpu_threads(self) -> CpuThreads | None:
        # The global series, asked without the API key (a bearer there must be a metrics token).
        response = httpx.get(f"{self.url}/metrics", timeout=60)
        response.raise_for_status()
        values = {}
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                values[sample.name] = int(sample.value)
        threads = values.get("prefixgate_engine_cpu_threads")
        narrowings = values.get("prefixgate_engine_cpu_narrowings_total")
        if threads is None or narrowings is None:  # a server without a governor
            return None
        return CpuThreads(threads, narrowings)

    async def stream_phase(self, phase: Phase) -> list[Trace]:
        body = {
            "model": self.model,
            "max_tokens": self.workload.output_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        started = time.perf_counter()
        streams = [self.stream_one({**body, "prompt": p}, started) for p in phase.prompts]
        return list(await asyncio.gather(*streams))

    async def stream_one(self, body: dict[str, Any], started: float) -> Trace:
        trace = Trace(token_ids=None, text="")
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread())[:500]
                raise RuntimeError(f"HTTP {response.status_code}: {text!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    raise RuntimeError(f"the stream failed: {chunk['error']}")
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    trace.times.append(time.perf_counter() - started)
                    trace.text = f"{trace.text}{chunk['choices'][0]['text']}"
                if usage := chunk.get("usage"):
                    trace.completion_tokens = usage["completion_tokens"]
                    trace.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
        return trace

    def close(self) -> None:
        loop = self.__dict__.pop("loop", None)  # taken: a second close() does nothing
        server = self.__dict__.pop("server", None)
        try:
            if loop is not None:
                try:
                    loop.run(self.client.aclose())
                finally:
                    loop.close()
        finally:
            if server is not None:  # the server stops even if the client did not close
                server.__exit__(None, None, None)

    def result(self) -> EngineRun:
        every = [trace for phase in self.traces.values() for trace in phase]
        short = sum(trace.completion_tokens < self.workload.output_tokens for trace in every)
        serving = self.ready.get("engine", {})  # what /readyz says serves: dtype, backend
        notes = {**serving, "stopped_early": short}
        return EngineRun(self.name, serving.get("dtype", "not reported"), self.traces, notes)


class VllmRunner(Runner):
    """bench/vllm_runner.py in the vLLM interpreter, kept running: phase names go to its stdin,
    one JSON line of traces per phase comes back on its stdout."""

    def __init__(self, workload: Workload, dtype: str, python: str, caching: bool) -> None:
        super().__init__(workload, dtype)
        self.python, self.caching = python, caching
        self.name = f"vllm_caching_{'on' if caching else 'off'}"

    def start(self) -> None:
        workload = self.workload
        longest = max(len(prompt) for phase in workload.phases for prompt in phase.prompts)
        request = {
            "model": str(workload.model_dir),
            "dtype": self.dtype,
            "enable_prefix_caching": self.caching,
            "max_model_len": max(2048, longest + workload.output_tokens),
            "output_tokens": workload.output_tokens,
            "kv_cache_gib": workload.kv_cache_gib,
            "phases": [{"name": p.name, "prompts": p.prompts} for p in workload.phases],
        }
        print(f"{self.name}: starting vLLM", file=sys.stderr)
        self.scratch = tempfile.TemporaryDirectory(prefix="peers-vllm-")
        path = Path(self.scratch.name) / "workload.json"
        path.write_text(json.dumps(request))
        self.command = [self.python, str(VLLM_RUNNER), str(path)]
        self.process = subprocess.Popen(
            self.command,
            cwd=self.scratch.name,
            env=foreign_environment(),  # vLLM's own OpenMP defaults, not PrefixGate's
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: vLLM's engine processes with it
        )
        self.notes = self.receive()  # vLLM's version, dtype, start-up time, settings

    def receive(self) -> dict[str, Any]:
        """The runner's next line; its exit status as an error if it ends instead, a
        TimeoutError if it says nothing for ANSWER_TIMEOUT_S."""
        stdout: IO[str] | None = self.process.stdout
        assert stdout is not None
        readable, _, _ = select.select([stdout], [], [], ANSWER_TIMEOUT_S)
        if not readable:
            raise TimeoutError(f"{self.name} said nothing for {ANSWER_TIMEOUT_S} s")
        line = stdout.readline()  # the runner writes whole lines
        if not line:
            raise subprocess.CalledProcessError(self.process.wait(), self.command)
        answer: dict[str, Any] = json.loads(line)
        return answer

    def run_phase(self, phase: Phase) -> list[Trace]:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(phase.name + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            raise subprocess.CalledProcessError(self.process.wait(), self.command) from None
        return [
            Trace(t["times"], len(t["token_ids"]), t["token_ids"], None, t["cached_tokens"])
            for t in self.receive()["traces"]
        ]

    def close(self) -> None:
        process = self.__dict__.pop("process", None)  # taken: a second close() does nothing
        scratch = self.__dict__.pop("scratch", None)
        try:
            if process is not None:
                with contextlib.suppress(BrokenPipeError):  # it may have died already
                    process.stdin.close()  # the runner's cue to exit
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)  # the runner and vLLM's engine
                    process.wait()
                process.stdout.close()
        finally:
            if scratch is not None:
                scratch.cleanup()

    def result(self) -> EngineRun:
        notes = dict(self.notes)
        return EngineRun(self.name, notes.pop("dtype"), self.traces, notes)
