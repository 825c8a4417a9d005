"""Structured outputs: decoding constrained to a JSON grammar, with xgrammar.

A request's `response_format` is compiled once (off the engine thread, by whoever prepares the
request) into a grammar over the model's vocabulary; its sequence keeps a matcher that, each
step, masks every token that would leave the grammar, and accepts the token sampled. The
grammar ends with the model's end-of-sequence token, so a finished output always parses.

xgrammar was chosen over llguidance by measurement (`python -m bench.grammar`, 2 CPU cores,
SmolLM2's 49,152-token vocabulary, two schemas, compact JSON): the per-token mask took 15 and
2.7 us median, 133 and 24 us at worst with xgrammar; 25 and 35 us, 5.3 ms and 133 us with
llguidance. Compiling took 11-12 ms per schema with xgrammar, 1.4-9 ms with llguidance, and is
cached per schema. Both are far below a decode step (20-30 ms); xgrammar's worst case, the one
that delays a whole batch, is the smaller.

xgrammar ignores JSON-schema keywords it does not implement; a schema is therefore checked
against the keywords it does, and anything else is refused naming the keyword, never
silently unenforced.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from engine.errors import InvalidRequest

MAX_SCHEMA_BYTES = 32 * 1024
COMPACT = (",", ":")  # JSON's separators, without the spaces
MAX_WHITESPACE = 16  # characters of whitespace in a row: a model cannot stall in it
MAX_SCHEMA_DEPTH = 32
# Keywords xgrammar enforces, and annotations that constrain nothing.
SUPPORTED_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs",
    "definitions", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "patternProperties", "minProperties",
    "maxProperties", "title", "description", "default", "examples", "$schema", "$id",
    "$comment", "strict", "nullable",
})  # fmt: skip
# Keywords whose value is a map of names to schemas, or a schema / list of schemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties")


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """`json_object` (any JSON object) or `json_schema` (`schema` as JSON text)."""

    kind: str
    schema: str | None = None


def unsupported(message: str) -> InvalidRequest:
    return InvalidRequest(f"response_format: {message}", param="response_format")


def check_schema(schema: Any, where: str = "#", depth: int = 0) -> None:
    """Raise `InvalidRequest` naming the first keyword xgrammar would not enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise unsupported(f"the schema at {where} is not an object")
    if depth > MAX_SCHEMA_DEPTH:
        raise unsupported(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    for keyword, value in schema.items():
        if keyword not in SUPPORTED_KEYWORDS:
            raise unsupported(f"JSON schema keyword {keyword!r} (at {where}) is not supported")
        if keyword in _SCHEMA_MAPS and isinstance(value, dict):
            for name, child in value.items():
                check_schema(child, f"{where}/{keyword}/{name}", depth + 1)
        elif keyword in _SCHEMA_LISTS and isinstance(value, list):
            for index, child in enumerate(value):
                check_schema(child, f"{where}/{keyword}/{index}", depth + 1)
        elif keyword in _SCHEMAS and isinstance(value, dict | bool):
            check_schema(value, f"{where}/{keyword}", depth + 1)


class Grammars:
    """Compiles response formats for one model's vocabulary (thread-safe, cached by schema)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Collection[int]):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def _ready(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size,
                    stop_token_ids=self.stop_token_ids or None,
                )  # fmt: skip
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
        try:  # whitespace as models write JSON, but never more than a run of MAX_WHITESPACE
            grammar = xgr.Grammar.from_json_schema(
                text, max_whitespace_cnt=MAX_WHITESPACE, strict_mode=True
            )
            return compiler.compile_grammar(_json_strings(str(grammar)))
        except RuntimeError as error:  # xgrammar's own refusal, e.g. a $ref it cannot resolve
            reason = str(error).strip().splitlines()[-1].split(": ", 1)[-1]
            raise unsupported(f"the schema cannot be compiled: {reason[:200]}") from None


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
