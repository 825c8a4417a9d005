"""Structured outputs: every sampled output follows its JSON schema, at temperatures above 0,
and a schema keyword the grammar would not enforce is refused by name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import EngineOverloaded, InvalidRequest
from engine.model.loader import load_model
from engine.sampling.sampler import SamplingParams
from engine.structured.grammar import GrammarState, ResponseFormat
from engine.structured.schema_checks import check_schema
from policies.templates import render
from tests.support.models import make_request, run_all

# Bounded on purpose: the model here has random weights, and only a bounded schema makes it
# finish (a free string would never be closed by chance).
SCHEMAS: dict[str, dict[str, Any]] = {
    "flags-and-enum": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]},
                       "nothing": {"type": "null"}},
        "required": ["ok", "colour", "nothing"], "additionalProperties": False,
    },
    "bounded-array": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 1, "maxItems": 4,
    },
    "short-strings": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 5},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 3},
                                "maxItems": 2},
                       "kind": {"anyOf": [{"const": "a"}, {"type": "boolean"}]}},
        "required": ["name", "tags", "kind"], "additionalProperties": False,
    },
    # Classes that match control characters, quotes and backslashes: the grammar leaves them
    # out, so every string parses. A one-schema allOf is its schema.
    "wide-patterns-and-references": {
        "type": "object",
        "properties": {"any": {"type": "string", "pattern": "^[\\s\\S]{1,6}$"},
                       "not_a": {"type": "string", "pattern": "^[^a]{1,6}$"},
                       "dot": {"type": "string", "pattern": "^.{1,6}$"},
                       "tag": {"allOf": [{"$ref": "#/$defs/tag"}], "description": "a tag"}},
        "required": ["any", "not_a", "dot", "tag"], "additionalProperties": False,
        "$defs": {"tag": {"enum": ["x", "y"], "type": "string"}},
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def engine(tiny_chat_dir: Path) -> Engine:
    """A random model with SmolLM2's real tokenizer (the grammar needs a vocabulary)."""
    return Engine(load_model(tiny_chat_dir), EngineConfig(num_blocks=512, max_num_seqs=16))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_sampled_output_parses_and_validates(engine: Engine, name: str) -> None:
    schema = SCHEMAS[name]
    grammar = engine.grammars.compile(ResponseFormat("json_schema", json.dumps(schema)))
    requests = [
        dataclasses.replace(
            make_request(f"{name}-{seed}-{temperature}", list(range(100, 120)),
                         sampling=SamplingParams(max_tokens=80, temperature=temperature,
                                                 seed=seed)),
            grammar=grammar,
        )
        for seed in range(6)
        for temperature in (0.7, 1.5)
    ]  # fmt: skip
    outputs = run_all(engine, requests)
    for output in outputs:
        assert output.deltas[-1].finish_reason == "stop", output.text  # the grammar ended it
        jsonschema.validate(json.loads(output.text), schema)
    assert len({output.text for output in outputs}) > 3  # sampled, not one fixed answer


UNSUPPORTED = [
    ({"not": {"type": "string"}}, "'not' (at #)"),
    ({"type": "object", "properties": {"a": {"if": {}, "then": {}}}}, "'if' (at #/properties/a)"),
    ({"type": "array", "items": {"uniqueItems": True}}, "'uniqueItems' (at #/items)"),
    ({"anyOf": [{"type": "string"}, {"contains": {}}]}, "'contains' (at #/anyOf/1)"),
    ({"$ref": "#/$defs/missing"}, "$ref (at #) points to no definition: '#/$defs/missing'"),
    # Patterns whose grammars take seconds to compile.
    ({"type": "string", "pattern": "([a-z]{1,20})+"}, "repeats a group that holds"),
    ({"type": "string", "pattern": "([a-z]{1,20}){1,20}"}, "over 1 counted repetitions"),
    ({"type": "string", "pattern": ".{1,32}.{1,32}"}, "over 1 counted repetitions"),
    ({"type": "string", "pattern": "[a-z]{1,64}"}, "more than 32 times"),
    ({"type": "string", "pattern": "([a-z]{1, 14}){1, 14}"}, "over 1 counted repetitions"),
    ({"type": "string", "pattern": "\\\\{1,3000}"}, "more than 32 times"),
    ({"$ref": "#/examples/0", "examples": [{"type": "integer"}]}, "must point into #/$defs"),
    ({"type": "object", "patternProperties": {"^(ab{2})+$": {}}}, "repeats a group"),
    ({"type": "array", "prefixItems": [{"type": "string", "pattern": "a"}] * 5}, "over 4 patterns"),
    ({"type": "wizard"}, "'type' (at #) names no JSON type: 'wizard'"),
    # allOf of several schemas: xgrammar allows any value for it.
    ({"type": "object", "properties": {"a": {"allOf": [{"minimum": 1}, {"maximum": 2}]}}},
     "'allOf' (at #/properties/a) of more than one schema"),
    ({"allOf": []}, "'allOf' (at #) holds no schemas"),
    # Patterns that need a control character, quote or backslash: written raw, not escaped.
    ({"type": "string", "pattern": "[\\x00-\\x1f]"}, "at # has the control character \\x00"),
    ({"type": "string", "pattern": "[\\n]"}, "at # has the control character \\n"),
    ({"type": "string", "pattern": "a\\tb"}, "at # has the control character \\t"),
    ({"type": "string", "pattern": "\\cJ"}, "at # has the control character \\cJ"),
    ({"type": "string", "pattern": "x\u0001"}, "at # has the raw control character '\\x01'"),
    ({"type": "object", "patternProperties": {"^\\r$": {}}},
     "at #/patternProperties has the control character \\r"),
    ({"type": "string", "pattern": '^"$'}, "cannot be kept inside a JSON string"),
    ({"type": "string", "pattern": "^\\\\$"}, "cannot be kept inside a JSON string"),
    ({"type": "string", "pattern": "[^\u00e9]"}, "cannot be kept inside a JSON string"),
    # Regex constructs xgrammar ignores or misreads.
    ({"type": "string", "pattern": "a(?=b)"}, "at # has a lookahead '(?='"),
    ({"type": "string", "pattern": "a(?!b)"}, "at # has a lookahead '(?!'"),
    ({"type": "string", "pattern": "(?<=a)b"}, "at # has a lookbehind '(?<='"),
    ({"type": "string", "pattern": "(?<!a)b"}, "at # has a lookbehind '(?<!'"),
    ({"type": "string", "pattern": "(a)\\1"}, "at # has a backreference \\1"),
    ({"type": "string", "pattern": "(?<x>a)\\k<x>"}, "at # has a backreference \\k"),
    ({"type": "string", "pattern": "\\bword"}, "at # has a word boundary \\b"),
    ({"type": "string", "pattern": "\\p{L}"}, "at # has a Unicode property \\p"),
    ({"type": "string", "pattern": "a\\Z"}, "at # has the unknown escape \\Z"),
    ({"type": "string", "pattern": "(?i)a"}, "at # has the group modifier '(?i'"),
    ({"type": "string", "pattern": "a^b"}, "at # has an anchor '^' inside it"),
    ({"type": "string", "pattern": "(a$)b"}, "at # has an anchor '$' inside it"),
    ({"type": "string", "pattern": "a?+"}, "at # has a quantifier '+' on a quantifier"),
    # Empty lists, and references outside the schema.
    ({"anyOf": []}, "'anyOf' (at #) holds no schemas"),
    ({"type": "array", "items": {"oneOf": []}}, "'oneOf' (at #/items) holds no schemas"),
    ({"type": []}, "'type' (at #) lists no types"),
    ({"$ref": "http://example.com/schema.json"}, "must point into #/$defs"),
    ({"$ref": "other.json#/$defs/a"}, "must point into #/$defs"),
    # Keywords xgrammar ignores beside the one it reads a schema by.
    ({"$ref": "#/$defs/n", "maximum": 3, "$defs": {"n": {"type": "integer"}}},
     "'maximum' beside '$ref' (at #)"),
    ({"anyOf": [{"type": "integer"}, {"type": "null"}], "minimum": 1},
     "'minimum' beside 'anyOf' (at #)"),
    ({"enum": ["a", 1], "type": "string"}, "'type' beside 'enum' (at #)"),
    ({"type": "object", "properties": {"a": {"maxLength": 2}}},
     "'maxLength' (at #/properties/a) is not enforced without a 'type'"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, "'pattern' and 'maxLength'"),
    ({"type": "string", "format": "date", "pattern": "^1"}, "'pattern' and 'format'"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf' (at #) is only enforced"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]},
     "required property 'b' (at #)"),
    ({"type": "object", "properties": {"a": {}}, "required": [["a"]]},
     "'required' (at #) is not an array of strings"),
    ({"type": "object", "properties": {"ab": {"type": "integer"}},
      "patternProperties": {"^a": {"type": "string"}}}, "'patternProperties' beside 'properties'"),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "named"), UNSUPPORTED)
def test_a_schema_the_grammar_cannot_enforce_is_refused_by_name(
    engine: Engine, schema: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidRequest, match="response_format") as raised:
        engine.grammars.compile(ResponseFormat("json_schema", json.dumps(schema)))
    assert named in str(raised.value) and raised.value.param == "response_format"


# What the refusals above must leave alone: each is enforced as written.
ENFORCED = [
    {"allOf": [{"type": "integer", "minimum": 1}], "description": "one schema is that schema"},
    {"enum": ["a", "b"], "type": "string", "title": "a type every value has"},
    {"oneOf": [{"const": "a"}, {"const": "b"}, {"type": "integer"}]},
    {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}], "$defs": {"n": {"type": "integer"}}},
    {"type": "string", "pattern": "^[^\"\\\\]+$"},  # a negated class may name any character
    {"type": "string", "pattern": "^[^\\x00-\\x1f]$|^\\u00e9\\.$"},
    {"type": "string", "pattern": "^(?:a|(?<b>b))*?[\\s\\S]\\d{2}$"},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "object", "patternProperties": {"^b": {"type": "string"}}, "maxProperties": 2},
]  # fmt: skip


@pytest.mark.parametrize("schema", ENFORCED)
def test_a_schema_the_grammar_enforces_is_accepted(engine: Engine, schema: dict[str, Any]) -> None:
    assert engine.grammars.compile(ResponseFormat("json_schema", json.dumps(schema)))


@pytest.fixture(scope="module")
def unescaped_tokens(engine: Engine) -> list[int]:
    """The tokens a JSON string cannot hold raw: those with a control character or backslash."""
    tokenizer = engine.loaded.tokenizer
    texts = tokenizer.batch_decode([[token] for token in range(len(tokenizer))])
    return [token for token, text in enumerate(texts)
            if "\\" in text or any(ord(char) < 0x20 for char in text)]  # fmt: skip


@pytest.mark.parametrize("pattern", ["[^a]", ".", "\\S", "[\\s\\S]", "[^\\t]"])
def test_a_class_that_holds_control_characters_never_writes_one_raw(
    engine: Engine, unescaped_tokens: list[int], pattern: str
) -> None:
    schema = {"type": "string", "pattern": f"^{pattern}+$"}
    grammar = engine.grammars.compile(ResponseFormat("json_schema", json.dumps(schema)))
    tokenizer = engine.loaded.tokenizer
    quote, letter = (tokenizer.encode(text, add_special_tokens=False)[0] for text in ('"', "b"))
    state = GrammarState(grammar, list(engine.loaded.eos_token_ids))
    assert state.accept(quote)
    bitmask = xgr.allocate_token_bitmask(1, engine.loaded.vocab_size)
    state.fill(bitmask, 0)
    allowed = xgr.testing.bitmask_to_bool_mask(bitmask)[0]
    assert allowed[letter] and not allowed[unescaped_tokens].any()


def test_a_too_deep_schema_is_refused_before_it_is_walked_further() -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(40):
        schema = {"type": "array", "items": schema}
    with pytest.raises(InvalidRequest, match="deeper than 32"):
        check_schema(schema)


@pytest.mark.slow
def test_json_mode_on_the_embedded_model_gives_a_json_object(smollm2: Any) -> None:
    engine = Engine(smollm2, EngineConfig(num_blocks=256, max_num_seqs=4))
    content = "Reply with a JSON object with two keys, name and age, for a cat called Tom aged 3."
    messages = [{"role": "user", "content": content}]
    prompt = render(smollm2.tokenizer, messages, generation_prompt=True)
    grammar = engine.grammars.compile(ResponseFormat("json_object"))
    requests = [
        dataclasses.replace(
            make_request(f"cat-{seed}", list(prompt),
                         sampling=SamplingParams(max_tokens=200, temperature=temperature,
                                                 seed=seed)),
            grammar=grammar,
        )
        for seed, temperature in ((0, 0.0), (1, 0.7), (2, 1.0))
    ]  # fmt: skip
    outputs = run_all(engine, requests)
    # Whether a small model ends its object is the model's doing (sampled, it may loop until
    # max_tokens); every output that ends is one JSON object, and greedy ends.
    assert outputs[0].deltas[-1].finish_reason == "stop", outputs[0].text
    for output in outputs:
        if output.deltas[-1].finish_reason == "stop":
            assert json.loads(output.text)["name"] == "Tom"


def test_bounded_strings_refuse_control_characters(engine: Engine) -> None:
    # xgrammar's own rule for a length-bounded string lets a tab through; JSON does not.
    schema = {"type": "string", "maxLength": 3}
    grammar = engine.grammars.compile(ResponseFormat("json_schema", json.dumps(schema)))
    tokenizer = engine.loaded.tokenizer
    quote, tab, letter = (tokenizer.encode(text, add_special_tokens=False)[0]
                          for text in ('"', "\t", "a"))  # fmt: skip
    state = GrammarState(grammar, list(engine.loaded.eos_token_ids))
    assert state.accept(quote) and not state.accept(tab) and state.accept(letter)


def test_a_compile_waits_its_turn_for_at_most_a_second(engine: Engine) -> None:
    schema = {"type": "string", "pattern": "^[a-z]{1,7}$"}
    pool = engine.grammars._ready()[1]
    # Every compile process is held: other requests' schemas are compiling.
    held = [pool._idle.get() for _ in range(pool.limits.processes)]
    try:
        with pytest.raises(EngineOverloaded, match="retry shortly"):
            engine.grammars.compile(ResponseFormat("json_schema", json.dumps(schema)))
    finally:
        for process in held:
            pool._idle.put(process)
    assert engine.grammars.compile(ResponseFormat("json_schema", json.dumps(schema)))
