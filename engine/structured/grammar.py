"""Structured outputs: decoding constrained to a JSON grammar, with xgrammar.

A request's `response_format` is compiled once (off the engine thread, by whoever prepares the
request) into a grammar over the model's vocabulary; its sequence keeps a matcher that, each
step, masks every token that would leave the grammar, and accepts the token sampled. The
grammar ends with the model's end-of-sequence token, so a finished output always parses.

xgrammar was chosen over llguidance by measurement (`python -m bench.grammar`; figures:
docs/performance.md): both mask a token and compile a schema (cached per schema) far faster
than a decode step, and xgrammar's worst case per token, the one that delays a whole batch, is
the smaller.

What a schema may hold is checked first (engine/structured/schema_checks.py): anything xgrammar
would not enforce is refused naming it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from engine.errors import EngineOverloaded, InvalidRequest
from engine.structured.regex_checks import xgrammar_reason
from engine.structured.schema_checks import (
    MAX_SCHEMA_BYTES,
    check_schema,
    tools_refused,
    unsupported,
)

COMPACT = (",", ":")  # JSON's separators, without the spaces
MAX_WHITESPACE = 16  # characters of whitespace in a row: a model cannot stall in it
COMPILE_WAIT_S = 1.0


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """`json_object` (any JSON object) or `json_schema` (`schema` as JSON text)."""

    kind: str
    schema: str | None = None


def json_schema_ebnf(schema_text: str) -> str:
    """The EBNF grammar (root rule `root`) of the JSON that follows `schema_text`.

    Whitespace as models write JSON, but never more than a run of MAX_WHITESPACE; strings hold
    only what JSON allows. Raises xgrammar's RuntimeError for a schema it cannot convert.
    """
    grammar = xgr.Grammar.from_json_schema(
        schema_text, max_whitespace_cnt=MAX_WHITESPACE, strict_mode=True
    )
    return _json_strings(str(grammar))


class Grammars:
    """Compiles response formats for one model's vocabulary (thread-safe, cached by schema)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()
        # One compile at a time, and a request waits at most COMPILE_WAIT_S for its turn: a
        # costly schema holds one of the gateway's shared preparation slots, not all of them.
        self._compiling = threading.Lock()

    def _ready(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer,
                    vocab_size=self._vocab_size,
                    stop_token_ids=self.stop_token_ids or None,
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, response_format: ResponseFormat) -> xgr.CompiledGrammar:
        """The grammar for `response_format`; `InvalidRequest` for a schema it cannot hold."""
        if self._tokenizer is None:
            raise unsupported("structured outputs need a model with a tokenizer")
        compiler = self._ready()
        if response_format.kind == "json_object":  # an object, as OpenAI's JSON mode gives
            return compiler.compile_json_schema(
                '{"type": "object"}', max_whitespace_cnt=MAX_WHITESPACE, strict_mode=False
            )
        text = response_format.schema or "{}"
        if len(text.encode()) > MAX_SCHEMA_BYTES:
            raise unsupported(f"the schema is over {MAX_SCHEMA_BYTES} bytes")
        check_schema(json.loads(text))
        try:
            return self._compile_in_turn(compiler, json_schema_ebnf(text))
        except RuntimeError as error:  # xgrammar's own refusal, e.g. a $ref it cannot resolve
            raise unsupported(f"the schema cannot be compiled: {xgrammar_reason(error)}") from None

    def compile_ebnf(self, ebnf: str) -> xgr.CompiledGrammar:
        """The grammar for `ebnf` (xgrammar's EBNF, root rule `root`), for a request's tool
        calls; `InvalidRequest` on `tools` for a grammar xgrammar refuses."""
        if self._tokenizer is None:
            raise tools_refused("forced tool calls need a model with a tokenizer")
        compiler = self._ready()
        try:
            return self._compile_in_turn(compiler, ebnf)
        except RuntimeError as error:
            reason = xgrammar_reason(error)
            raise tools_refused(f"the grammar cannot be compiled: {reason}") from None

    def compile_serialized(self, text: str) -> xgr.CompiledGrammar:
        """A grammar another process compiled and sent as `serialized(compiled)`, compiled
        again for this model (an engine worker, from its gateway)."""
        if self._tokenizer is None:
            raise unsupported("structured outputs need a model with a tokenizer")
        compiler = self._ready()
        try:
            grammar = xgr.Grammar.deserialize_json(text)
        except (RuntimeError, ValueError) as error:
            raise InvalidRequest(f"not a serialized grammar: {error}") from None
        return self._compile_in_turn(compiler, grammar)

    def _compile_in_turn(
        self, compiler: xgr.GrammarCompiler, grammar: str | xgr.Grammar
    ) -> xgr.CompiledGrammar:
        """Compile once no other compile runs; `EngineOverloaded` after COMPILE_WAIT_S."""
        if not self._compiling.acquire(timeout=COMPILE_WAIT_S):
            raise EngineOverloaded("another grammar is being compiled; retry shortly")
        try:
            return compiler.compile_grammar(grammar)
        finally:
            self._compiling.release()


def serialized(compiled: xgr.CompiledGrammar) -> str:
    """The grammar behind `compiled` as text that `Grammars.compile_serialized` reads."""
    return str(compiled.grammar.serialize_json())


# xgrammar writes a length-bounded string's characters as this class, which lets control
# characters through (JSON forbids them unescaped; parsers refuse them).
_LOOSE_STRING_CHARACTER = r"[^\"\\\r\n]"
_JSON_STRING_CHARACTER = r"[^\0-\x1f\"\\]"


def _json_strings(ebnf: str) -> str:
    """The grammar with every string character class narrowed to what JSON allows."""
    return ebnf.replace(_LOOSE_STRING_CHARACTER, _JSON_STRING_CHARACTER)


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
