"""A grammar compile process: what runs inside the sandbox of `compile_pool.py`.

The process is forked from multiprocessing's fork server (which imported this module, and so
xgrammar, once) and is handed the model's vocabulary as `TokenizerInfo` JSON. Then, for each
job it reads (what to compile, as `Job`), it compiles under two limits of its own and answers
with the compiled grammar as JSON, or with why it could not:
- its address space may grow by at most the memory limit for a compile (`RLIMIT_AS`, set
  afresh from its size before each), so an allocation past it fails: xgrammar raises
  `std::bad_alloc`, Python `MemoryError`;
- its CPU time may grow by at most the time limit and a little more (`RLIMIT_CPU`), a
  backstop that ends it should its parent, which kills it at the time limit, be gone.
It ends when its parent closes the pipe (or dies: the pipe closes with it).
"""

from __future__ import annotations

import math
import os
import resource
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Literal

import xgrammar as xgr

from engine.structured.schema_grammar import MAX_WHITESPACE, json_schema_ebnf
from engine.structured.tool_grammar import ToolCalls, tool_calls_grammar

# What a job compiles: a JSON schema's text, any JSON object (OpenAI's JSON mode), a grammar
# serialized by `Grammar.serialize_json`, or forced tool calls (`ToolCalls.to_json`).
JobKind = Literal["schema", "json_object", "grammar", "tools"]
# How an answer starts: the compiled grammar's JSON follows, or the failure's text.
COMPILED, UNREADABLE, REFUSED, OUT_OF_MEMORY = b"C", b"U", b"R", b"M"
READY = b"ready"
_CPU_MARGIN_S = 2  # past the time limit: the parent kills at the limit; this is a backstop


@dataclass(frozen=True, slots=True)
class Job:
    """One compile: its kind and text."""

    kind: JobKind
    text: str


def serve(connection: Connection, tokenizer_info: str, memory_mb: int, timeout_s: float) -> None:
    """Compile each job read from `connection` until it closes (the process's entry point)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the parent
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    # Limits count from the size at READY, not from the size now: memory an allocator kept
    # after a costly compile does not raise the next one's ceiling.
    limits = _limited(_address_space(), memory_mb, timeout_s)
    connection.send_bytes(READY)
    while True:
        try:
            job: Job = connection.recv()
        except EOFError:
            return
        with limits:
            answer = _compile(compiler, job)
        connection.send_bytes(answer)
        if answer[:1] == OUT_OF_MEMORY:
            return  # xgrammar's state after a failed allocation is unknown: the next job
            # starts a fresh process


def _compile(compiler: xgr.GrammarCompiler, job: Job) -> bytes:
    """The answer to `job`: a tag, then the compiled grammar's JSON or the failure's text."""
    try:
        try:
            grammar = _grammar(job)
        except (RuntimeError, ValueError) as error:
            return _failure(UNREADABLE, error)
        try:
            compiled = compiler.compile_grammar(grammar)
            return COMPILED + str(compiled.serialize_json()).encode()
        except (RuntimeError, ValueError) as error:
            return _failure(REFUSED, error)
    except MemoryError:
        return OUT_OF_MEMORY


def _grammar(job: Job) -> str | xgr.Grammar:
    """What `job` asks to compile, as xgrammar reads it; raises for what it cannot read."""
    if job.kind == "schema":
        return json_schema_ebnf(job.text)
    if job.kind == "json_object":  # an object, as OpenAI's JSON mode gives
        schema = '{"type": "object"}'
        return xgr.Grammar.from_json_schema(
            schema, max_whitespace_cnt=MAX_WHITESPACE, strict_mode=False
        )
    if job.kind == "grammar":
        return xgr.Grammar.deserialize_json(job.text)
    return tool_calls_grammar(ToolCalls.from_json(job.text))


def _failure(tag: bytes, error: BaseException) -> bytes:
    """A failure's answer: out of memory whatever the step, else `tag` and xgrammar's text
    (for the parent to classify; never shown to a client)."""
    text = str(error)
    return OUT_OF_MEMORY if "bad_alloc" in text else tag + text.encode(errors="replace")


class _limited:
    """Within: the address space at most `memory_mb` above `baseline` (bytes), CPU time
    `timeout_s` (+ margin) more than used so far."""

    def __init__(self, baseline: int, memory_mb: int, timeout_s: float) -> None:
        self._ceiling = baseline + memory_mb * 2**20
        self._cpu_s = math.ceil(timeout_s) + _CPU_MARGIN_S

    def __enter__(self) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        used_s = math.ceil(usage.ru_utime + usage.ru_stime)
        _lower(resource.RLIMIT_AS, self._ceiling)
        _lower(resource.RLIMIT_CPU, used_s + self._cpu_s)

    def __exit__(self, *exception: object) -> None:
        for limit in (resource.RLIMIT_AS, resource.RLIMIT_CPU):
            hard = resource.getrlimit(limit)[1]
            resource.setrlimit(limit, (hard, hard))


def _lower(limit: int, soft: int) -> None:
    """Set the soft `limit` to `soft`, or to its hard limit if that is lower."""
    _, hard = resource.getrlimit(limit)
    resource.setrlimit(limit, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _address_space() -> int:
    """This process's virtual memory size now, in bytes."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[0])
    return pages * os.sysconf("SC_PAGE_SIZE")
