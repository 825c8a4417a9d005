"""Structured outputs: decoding constrained to a JSON grammar, with xgrammar.

A request's `response_format` is compiled once (by whoever prepares the request, never on the
engine thread) into a grammar over the model's vocabulary; its sequence keeps a matcher that,
each step, masks every token that would leave the grammar, and accepts the token sampled. The
grammar ends with the model's end-of-sequence token, so a finished output always parses.

xgrammar was chosen over llguidance by measurement (`python -m bench.grammar`; figures:
docs/performance.md): both mask a token and compile a schema (cached per schema) far faster
than a decode step, and xgrammar's worst case per token, the one that delays a whole batch, is
the smaller.

What a schema may hold is checked first (engine/structured/schema_checks.py): anything xgrammar
would not enforce is refused naming it. The compile itself runs in another process, within a
time and a memory limit (engine/structured/compile_pool.py): a schema too costly to compile is
refused as the client's, and holds a compile process for no longer than the time limit.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from engine.errors import InvalidRequest
from engine.structured.compile_errors import schema_refusal
from engine.structured.compile_limits import CompileLimits
from engine.structured.compile_pool import CompileFailed, CompilePool
from engine.structured.compile_worker import Job
from engine.structured.schema_checks import (
    MAX_SCHEMA_BYTES,
    check_schema,
    tools_refused,
    unsupported,
)
from engine.structured.tool_grammar import ToolCalls, refused_call

COMPACT = (",", ":")  # JSON's separators, without the spaces
COMPILE_WAIT_S = 1.0  # how long a request waits for a free compile process
CACHE_BYTES = 256 * 2**20  # compiled grammars kept, by their size in memory


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """`json_object` (any JSON object) or `json_schema` (`schema` as JSON text)."""

    kind: str
    schema: str | None = None


class Grammars:
    """Compiles response formats for one model's vocabulary (thread-safe, cached by schema).

    Compiles run in `limits.processes` processes, each within `limits.timeout_s` and
    `limits.memory_mb`; `close` ends those processes (the next compile starts them again).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Collection[int],
        limits: CompileLimits | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.limits = limits or CompileLimits()
        self._info: xgr.TokenizerInfo | None = None
        self._pool: CompilePool | None = None
        self._lock = threading.Lock()
        self._cache = _CompiledCache(CACHE_BYTES)

    def _ready(self) -> tuple[xgr.TokenizerInfo, CompilePool]:
        with self._lock:
            if self._info is None or self._pool is None:
                self._info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer,
                    vocab_size=self._vocab_size,
                    stop_token_ids=self.stop_token_ids or None,
                )
                self._pool = CompilePool(str(self._info.serialize_json()), self.limits)
            return self._info, self._pool

    def compile(self, response_format: ResponseFormat) -> xgr.CompiledGrammar:
        """The grammar for `response_format`; `InvalidRequest` for a schema it cannot hold
        or that is too costly to compile, `EngineOverloaded` when no compile process is free."""
        if self._tokenizer is None:
            raise unsupported("structured outputs need a model with a tokenizer")
        if response_format.kind == "json_object":
            return self._compiled(Job("json_object", ""), unsupported)
        text = response_format.schema or "{}"
        if len(text.encode()) > MAX_SCHEMA_BYTES:
            raise unsupported(f"the schema is over {MAX_SCHEMA_BYTES} bytes")
        schema = json.loads(text)
        check_schema(schema)
        try:
            return self._compiled(Job("schema", text), unsupported)
        except CompileFailed as failed:
            raise unsupported(schema_refusal(schema, failed.detail)) from None

    def compile_tools(self, calls: ToolCalls) -> xgr.CompiledGrammar:
        """The grammar of the tool calls `calls` allows, for a request's forced `tool_choice`:
        written from the call schemas and compiled in a compile process, within its limits.
        `InvalidRequest` on `tools` naming the function whose parameters xgrammar refuses, or
        for a grammar that cannot be compiled or is too costly to compile."""
        if self._tokenizer is None:
            raise tools_refused("forced tool calls need a model with a tokenizer")
        try:
            return self._compiled(Job("tools", calls.to_json()), tools_refused)
        except CompileFailed as failed:
            raise tools_refused(_tools_refusal(calls, failed)) from None

    def compile_serialized(self, text: str) -> xgr.CompiledGrammar:
        """A grammar another process compiled and sent as `serialized(compiled)`, compiled
        again for this model (an engine worker, from its gateway)."""
        if self._tokenizer is None:
            raise unsupported("structured outputs need a model with a tokenizer")
        try:
            return self._compiled(Job("grammar", text), InvalidRequest)
        except CompileFailed as failed:
            if failed.kind == "unreadable":
                raise InvalidRequest("not a serialized grammar") from None
            raise InvalidRequest("the serialized grammar cannot be compiled") from None

    def close(self) -> None:
        """End the compile processes (the next compile starts them again)."""
        with self._lock:
            pool = self._pool
        if pool is not None:
            pool.close()

    def compile_pids(self) -> list[int]:
        """The ids of the compile processes running now."""
        with self._lock:
            pool = self._pool
        return pool.pids() if pool is not None else []

    def _compiled(self, job: Job, refused: Callable[[str], InvalidRequest]) -> xgr.CompiledGrammar:
        """The compiled grammar of `job`, from the cache or a compile process.

        Past a limit: `refused(message)` (the caller's `InvalidRequest`), naming the limit.
        Raises `CompileFailed` when xgrammar cannot read or compile the job.
        """
        cached = self._cache.get(job)
        if cached is not None:
            return cached
        info, pool = self._ready()
        try:
            serialized_grammar = pool.compile(job, COMPILE_WAIT_S)
        except CompileFailed as failed:
            if failed.kind == "timeout":
                seconds = f"{self.limits.timeout_s:g}"
                raise refused(f"the schema is too costly to compile within {seconds} s") from None
            if failed.kind == "memory":
                megabytes = self.limits.memory_mb
                raise refused(f"the schema needs more than {megabytes} MiB to compile") from None
            raise
        compiled = xgr.CompiledGrammar.deserialize_json(serialized_grammar, info)
        self._cache.put(job, compiled)
        return compiled


class _CompiledCache:
    """Compiled grammars by what they were compiled from, the least recently used dropped
    first once they hold more than `limit_bytes` (thread-safe)."""

    def __init__(self, limit_bytes: int) -> None:
        self._limit = limit_bytes
        self._grammars: OrderedDict[Job, xgr.CompiledGrammar] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, job: Job) -> xgr.CompiledGrammar | None:
        with self._lock:
            grammar = self._grammars.get(job)
            if grammar is not None:
                self._grammars.move_to_end(job)
            return grammar

    def put(self, job: Job, grammar: xgr.CompiledGrammar) -> None:
        with self._lock:
            if job in self._grammars:
                return
            self._grammars[job] = grammar
            self._bytes += grammar.memory_size_bytes
            while self._bytes > self._limit and len(self._grammars) > 1:
                _, dropped = self._grammars.popitem(last=False)
                self._bytes -= dropped.memory_size_bytes


def _tools_refusal(calls: ToolCalls, failed: CompileFailed) -> str:
    """Why the grammar of `calls` cannot be compiled, without xgrammar's words: the function
    and the keyword in its parameters, as the checks before name them."""
    refused = refused_call(failed.detail) if failed.kind == "unreadable" else None
    if refused is None or refused[0] >= len(calls.parameters):
        return "the grammar cannot be compiled"
    index, detail = refused
    reason = schema_refusal(json.loads(calls.parameters[index]), detail)
    return f"function {calls.names[index]!r}: {reason}"


def serialized(compiled: xgr.CompiledGrammar) -> str:
    """The grammar behind `compiled` as text that `Grammars.compile_serialized` reads."""
    return str(compiled.grammar.serialize_json())


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, grammar: xgr.CompiledGrammar, stop_token_ids: list[int]) -> None:
        self._matcher = xgr.GrammarMatcher(grammar, override_stop_tokens=stop_token_ids or None)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance over `token`; False if the grammar does not allow it."""
        return bool(self._matcher.accept_token(token))


def mask_logits(logits: torch.Tensor, states: list[GrammarState | None]) -> None:
    """Set to -inf, in place, every logit a row's grammar does not allow next."""
    rows = [row for row, state in enumerate(states) if state is not None]
    if not rows:
        return
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    for row in rows:
        state = states[row]
        assert state is not None
        state.fill(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
