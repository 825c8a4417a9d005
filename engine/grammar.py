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
import re
import threading
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from engine.errors import EngineOverloaded, InvalidRequest

MAX_SCHEMA_BYTES = 32 * 1024
COMPACT = (",", ":")  # JSON's separators, without the spaces
MAX_WHITESPACE = 16  # characters of whitespace in a row: a model cannot stall in it
COMPILE_WAIT_S = 1.0
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


def tools_refused(message: str) -> InvalidRequest:
    """The error for a tool (its `parameters` schema, or the grammar of its calls)."""
    return InvalidRequest(f"tools: {message}", param="tools")


def xgrammar_reason(error: RuntimeError) -> str:
    """xgrammar's own words for a refusal, without its source location (at most 200 chars)."""
    return str(error).strip().splitlines()[-1].split(": ", 1)[-1][:200]


def json_schema_ebnf(schema_text: str) -> str:
    """The EBNF grammar (root rule `root`) of the JSON that follows `schema_text`.

    Whitespace as models write JSON, but never more than a run of MAX_WHITESPACE; strings hold
    only what JSON allows. Raises xgrammar's RuntimeError for a schema it cannot convert.
    """
    grammar = xgr.Grammar.from_json_schema(
        schema_text, max_whitespace_cnt=MAX_WHITESPACE, strict_mode=True
    )
    return _json_strings(str(grammar))


def check_tool_parameters(parameters: Any, function: str) -> None:
    """Refuse a tool's `parameters` schema as `check_schema` refuses a response format's (and
    one over MAX_SCHEMA_BYTES), as an `InvalidRequest` on `tools` naming the function."""
    if len(json.dumps(parameters).encode()) > MAX_SCHEMA_BYTES:
        raise tools_refused(f"function {function!r}: parameters are over {MAX_SCHEMA_BYTES} bytes")
    try:
        check_schema(parameters)
    except InvalidRequest as error:
        reason = str(error).removeprefix("response_format: ")
        raise tools_refused(f"function {function!r}: {reason}") from None


def check_tool_set(schemas: list[Any]) -> None:
    """Bound a grammar over several tools' parameters as one schema is bounded: at most
    MAX_SCHEMA_BYTES and MAX_PATTERNS in all, so many tools cost no more than one schema."""
    size = sum(len(json.dumps(schema).encode()) for schema in schemas)
    if size > MAX_SCHEMA_BYTES:
        raise tools_refused(f"the functions' parameters are over {MAX_SCHEMA_BYTES} bytes in all")
    patterns = sum(len(list(_patterns(schema))) for schema in schemas)
    if patterns > MAX_PATTERNS:
        raise tools_refused(f"the functions' parameters have over {MAX_PATTERNS} patterns in all")


def check_schema(schema: Any, where: str = "#", depth: int = 0) -> None:
    """Raise `InvalidRequest` naming the first keyword xgrammar would not enforce, or the
    first pattern too expensive to compile."""
    patterns = list(_patterns(schema))
    if len(patterns) > MAX_PATTERNS:
        raise unsupported(f"the schema has over {MAX_PATTERNS} patterns")
    for pattern, at in patterns:
        check_pattern(pattern, at)
    _check_keywords(schema, where, depth)


def _patterns(schema: Any, where: str = "#", depth: int = 0) -> Iterator[tuple[Any, str]]:
    """Every regex in the schema: `pattern` values and `patternProperties` names."""
    if not isinstance(schema, dict) or depth > MAX_SCHEMA_DEPTH:
        return
    for keyword, value in schema.items():
        if keyword == "pattern":
            yield value, where
        if keyword == "patternProperties" and isinstance(value, dict):
            yield from ((name, f"{where}/patternProperties") for name in value)
        for child, at in _children(keyword, value, where):
            yield from _patterns(child, at, depth + 1)


def _children(keyword: str, value: Any, where: str) -> Iterator[tuple[Any, str]]:
    if keyword in _SCHEMA_MAPS and isinstance(value, dict):
        yield from ((child, f"{where}/{keyword}/{name}") for name, child in value.items())
    elif keyword in _SCHEMA_LISTS and isinstance(value, list):
        yield from ((child, f"{where}/{keyword}/{index}") for index, child in enumerate(value))
    elif keyword in _SCHEMAS and isinstance(value, dict | bool):
        yield value, f"{where}/{keyword}"


def _check_keywords(schema: Any, where: str, depth: int) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise unsupported(f"the schema at {where} is not an object")
    if depth > MAX_SCHEMA_DEPTH:
        raise unsupported(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    for keyword, value in schema.items():
        if keyword not in SUPPORTED_KEYWORDS:
            raise unsupported(f"JSON schema keyword {keyword!r} (at {where}) is not supported")
        # A reference may only name a definition, which is checked like the rest; never an
        # annotation such as `examples`, which is not.
        if keyword == "$ref" and not (
            isinstance(value, str) and value.startswith(("#/$defs/", "#/definitions/"))
        ):
            raise unsupported(f"$ref (at {where}) must point into #/$defs or #/definitions")
        for child, at in _children(keyword, value, where):
            _check_keywords(child, at, depth + 1)


# A regex's counted repetitions are what make its grammar expensive to compile: measured on 2
# cores, `.{1,32}.{1,32}` takes 2.4 s and `([a-z]{1,20}){1,20}` 14 s, where `[a-z]{1,32}` takes
# 0.08 s and `.{1,64}` 0.6 s. A schema holds at most a few patterns (`pattern` values and
# `patternProperties` names), each with one short counted repetition, never nested.
MAX_PATTERNS = 4
MAX_PATTERN_CHARS = 256
MAX_COUNTED_REPETITIONS = 1
MAX_REPETITION_BOUND = 32
# Counted repetitions as xgrammar reads them, spaces included; an escaped brace counts too
# (refusing a literal `\{1,3\}` is cheaper than telling it from `\\{1,3}`).
_COUNTED = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


def check_pattern(pattern: Any, where: str) -> None:
    """Refuse a `pattern` whose grammar would be expensive to compile."""
    if not isinstance(pattern, str):
        raise unsupported(f"the pattern at {where} is not a string")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise unsupported(f"the pattern at {where} is over {MAX_PATTERN_CHARS} characters")
    counted = list(_COUNTED.finditer(pattern))
    if len(counted) > MAX_COUNTED_REPETITIONS:
        message = f"the pattern at {where} has over {MAX_COUNTED_REPETITIONS} counted repetitions"
        raise unsupported(message)
    for match in counted:
        bounds = [int(bound) for bound in match.groups() if bound]
        if any(bound > MAX_REPETITION_BOUND for bound in bounds):
            message = f"the pattern at {where} repeats more than {MAX_REPETITION_BOUND} times"
            raise unsupported(message)
    # A counted repetition inside a group that is itself repeated.
    counted_at = {match.start() for match in counted}
    holds_counted: list[bool] = []
    escaped = False
    for index, char in enumerate(pattern):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "(":
            holds_counted.append(False)
        elif char == ")" and holds_counted:
            inner = holds_counted.pop()
            if inner and pattern[index + 1 : index + 2] in ("*", "+", "{"):
                message = f"the pattern at {where} repeats a group that holds a repetition"
                raise unsupported(message)
            if holds_counted:
                holds_counted[-1] = holds_counted[-1] or inner
        elif index in counted_at and holds_counted:
            holds_counted[-1] = True


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

    def _compile_in_turn(self, compiler: xgr.GrammarCompiler, ebnf: str) -> xgr.CompiledGrammar:
        """Compile once no other compile runs; `EngineOverloaded` after COMPILE_WAIT_S."""
        if not self._compiling.acquire(timeout=COMPILE_WAIT_S):
            raise EngineOverloaded("another grammar is being compiled; retry shortly")
        try:
            return compiler.compile_grammar(ebnf)
        finally:
            self._compiling.release()


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
