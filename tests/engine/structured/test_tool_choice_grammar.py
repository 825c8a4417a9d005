"""Forced tool calls: `tool_choice` "required" or a named function makes every sampled answer
calls of the allowed functions with arguments that follow their schemas; tools reach the model
through a chat template that renders them, and only such a template is said to."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import EngineOverloaded, InvalidRequest
from engine.sampling.sampler import SamplingParams
from engine.structured.tool_grammar import ToolCalls, tool_calls_grammar
from gateway.openai.tool_calls import (
    parse_tool_calls,
    template_supports_tools,
    to_template_messages,
    tool_choice_grammar,
)
from tests.support.models import make_request, run_all
from tests.support.tool_template import with_tools_template

# Bounded arguments, so that 64 tokens always hold a whole call.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo", "Rome"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": False,
        },
    },
}  # fmt: skip
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 8}},
            "required": ["zone"], "additionalProperties": False,
        },
    },
}  # fmt: skip
NO_PARAMETERS = {"type": "function", "function": {"name": "now"}}
WITH_DEFINITIONS = {
    "type": "function",
    "function": {
        "name": "paint",
        "parameters": {
            "$defs": {"colour": {"enum": ["red", "blue"]}},
            "type": "object",
            "properties": {"colour": {"$ref": "#/$defs/colour"}},
            "required": ["colour"],
        },
    },
}
TOOLS = [WEATHER, TIME, NO_PARAMETERS, WITH_DEFINITIONS]
SCHEMAS = {tool["function"]["name"]: tool["function"].get("parameters", {}) for tool in TOOLS}


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def accepts(calls: ToolCalls | None, text: str) -> bool:
    """Whether `text` is a whole answer the calls' grammar allows (matched as text, no
    vocabulary)."""
    assert calls is not None
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False)
    grammar = compiler.compile_grammar(tool_calls_grammar(calls))
    matcher = xgr.GrammarMatcher(grammar, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


REQUIRED_ANSWERS = [
    (call("get_weather", '{"city": "Oslo", "days": 2}'), True),
    (call("get_weather", '{\n  "city": "Oslo",\n  "days": 2\n}'), True),
    (call("now", '{"anything": [1, {"goes": null}]}'), True),  # no parameters: any object
    (call("now", "[]"), False),  # ... but an object
    (call("paint", '{"colour": "red"}'), True),  # a reference into the parameters' $defs
    (call("paint", '{"colour": "green"}'), False),
    (call("get_weather", '{"city": "Lima", "days": 2}'), False),
    (call("get_weather", '{"city": "Oslo", "days": 9}'), False),
    (call("get_weather", '{"city": "Oslo"}'), False),
    (call("get_time", '{"zone": "Europe/Oslo"}'), False),  # over maxLength
    (call("get_time", '{"zone": "a\tb"}'), False),  # a control character JSON forbids
    (call("get_date", "{}"), False),
    ("Sure! " + call("now", "{}"), False),
    (call("now", "{}") + "\n" + call("now", "{}"), False),  # one call unless parallel
    ("", False),
]


@pytest.mark.parametrize(("answer", "allowed"), REQUIRED_ANSWERS)
def test_required_allows_exactly_one_call_that_follows_its_schema(
    answer: str, allowed: bool
) -> None:
    assert accepts(tool_choice_grammar(TOOLS, "required", parallel=False), answer) is allowed


def test_parallel_allows_one_or_more_calls_one_per_line() -> None:
    grammar = tool_choice_grammar(TOOLS, "required", parallel=True)
    two = call("now", "{}") + "\n" + call("paint", '{"colour": "blue"}')
    assert accepts(grammar, call("now", "{}")) and accepts(grammar, two)
    assert not accepts(grammar, "") and not accepts(grammar, two.replace("\n<", "<", 1))


def test_a_named_function_allows_that_function_alone() -> None:
    grammar = tool_choice_grammar(TOOLS, {"type": "function", "function": {"name": "get_time"}},
                                  parallel=False)  # fmt: skip
    assert accepts(grammar, call("get_time", '{"zone": "UTC"}'))
    assert not accepts(grammar, call("now", "{}"))


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_auto_and_none_force_nothing(choice: str) -> None:
    assert tool_choice_grammar(TOOLS, choice, parallel=True) is None


def function(name: str, parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


REFUSED = [
    (function("f", {"type": "object", "not": {}}), "function 'f': JSON schema keyword 'not'"),
    (function("g", {"type": "object", "properties": {"a": {"if": {}}}}),
     "'if' (at #/properties/a)"),
    (function("h", {"type": "string"}), "function 'h': parameters must describe an object"),
    (function("k", ["type", "object"]), "function 'k': parameters must describe an object"),
    (function("i", {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
     "function 'i': $ref (at #/properties/a) points to no definition"),
    (function("j", {"type": "object", "properties": {"a": {"pattern": "[a-z]{1,64}"}}}),
     "more than 32 times"),
]  # fmt: skip


@pytest.mark.parametrize(("tool", "named"), REFUSED)
def test_parameters_the_grammar_cannot_enforce_are_refused_by_name(
    tool: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidRequest, match=r"^tools: ") as raised:
        tool_choice_grammar([WEATHER, tool], "required", parallel=False)
    assert named in str(raised.value) and raised.value.param == "tools"


@pytest.mark.parametrize(
    ("tools", "choice"),
    [([], "required"), (TOOLS, {"type": "function", "function": {"name": "get_date"}})],
)
def test_a_choice_no_tool_answers_is_refused(tools: list[Any], choice: Any) -> None:
    with pytest.raises(InvalidRequest) as raised:
        tool_choice_grammar(tools, choice, parallel=False)
    assert raised.value.param == "tool_choice"


@pytest.fixture(scope="module")
def engine(smollm2: Any) -> Engine:
    return Engine(smollm2, EngineConfig(num_blocks=256, max_num_seqs=4))


@pytest.fixture(scope="module")
def tools_tokenizer(smollm2_tokenizer: Any) -> Any:
    return with_tools_template(smollm2_tokenizer)


def calls_of(*parameters: Any) -> ToolCalls:
    """Calls of functions f0, f1, ... with these parameters, past the gateway's checks."""
    names = tuple(f"f{index}" for index in range(len(parameters)))
    return ToolCalls(names, tuple(map(json.dumps, parameters)), "<tool_call>", "</tool_call>")


def test_parameters_xgrammar_refuses_are_an_invalid_tools_request_naming_the_function(
    engine: Engine,
) -> None:
    refused = {"type": "object", "properties": {"a": {"enum": []}}}  # past schema_checks.py
    with pytest.raises(InvalidRequest) as raised:
        engine.grammars.compile_tools(calls_of({"type": "object"}, refused))
    message = str(raised.value)  # where in the parameters, as the checks before say it
    assert message == (
        "tools: function 'f1': the schema cannot be compiled: 'enum' (at #/properties/a) is not "
        "one it can hold"
    )
    assert raised.value.param == "tools"


def test_checking_the_tools_writes_no_grammar() -> None:
    # The grammar is written in a compile process, within its limits: what the gateway keeps,
    # inside the preparation slots every tenant shares, is each call's schema. This one's
    # grammar takes xgrammar seconds to write.
    costly = {"type": "object", "minProperties": 300,
              "properties": {f"p{index}": {"type": "integer"} for index in range(600)}}  # fmt: skip
    started = time.monotonic()
    calls = tool_choice_grammar([TIME, function("costly", costly)], "required", parallel=False)
    assert time.monotonic() - started < 0.5
    assert calls is not None and calls.names == ("get_time", "costly")
    assert json.loads(calls.parameters[0]) == TIME["function"]["parameters"]


def test_a_tool_grammar_waits_its_turn_for_at_most_a_second(engine: Engine) -> None:
    calls = tool_choice_grammar([TIME], "required", parallel=False)
    assert calls is not None
    pool = engine.grammars._ready()[1]
    held = [pool._idle.get() for _ in range(pool.limits.processes)]  # all busy compiling
    try:
        with pytest.raises(EngineOverloaded, match="retry shortly"):
            engine.grammars.compile_tools(calls)
    finally:
        for process in held:
            pool._idle.put(process)
    assert engine.grammars.compile_tools(calls)


def test_only_a_template_that_renders_tools_supports_them(
    smollm2_tokenizer: Any, tools_tokenizer: Any
) -> None:
    assert not template_supports_tools(smollm2_tokenizer)
    assert template_supports_tools(tools_tokenizer)


def test_a_call_and_its_result_render_as_the_model_would_write_them(tools_tokenizer: Any) -> None:
    call_entry = {"id": "call_1", "type": "function",
                  "function": {"name": "get_time", "arguments": '{"zone":"UTC"}'}}  # fmt: skip
    messages = [
        {"role": "user", "content": "What time is it in UTC?"},
        {"role": "assistant", "content": None, "tool_calls": [call_entry]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    text = tools_tokenizer.apply_chat_template(
        to_template_messages(messages), tools=[TIME], tokenize=False, add_generation_prompt=True
    )
    assert '<tools>\n{"type": "function", "function": {"name": "get_time"' in text
    turns = text.split("<|im_start|>")
    assistant = next(turn for turn in turns if turn.startswith("assistant\n<tool_call>"))
    content, calls = parse_tool_calls(assistant.removeprefix("assistant").split("<|im_end|>")[0])
    assert content is None and [c.message_entry()["function"] for c in calls] == [
        call_entry["function"]
    ]  # the model is shown its own format, which reads back as the call it was
    assert "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>" in text


def generate(engine: Engine, tokenizer: Any, choice: Any, seeds: range) -> list[str]:
    """Answers sampled at temperature 1 under `choice`'s grammar."""
    question = [{"role": "user", "content": "What will the weather be in Paris for 3 days?"}]
    text = tokenizer.apply_chat_template(
        question, tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=True
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    calls = tool_choice_grammar([WEATHER, TIME], choice, parallel=False)
    assert calls is not None
    grammar = engine.grammars.compile_tools(calls)
    sampling = [SamplingParams(max_tokens=64, temperature=1.0, seed=seed) for seed in seeds]
    requests = [
        dataclasses.replace(make_request(f"{choice}-{params.seed}", prompt, sampling=params),
                            grammar=grammar)
        for params in sampling
    ]  # fmt: skip
    outputs = run_all(engine, requests)
    for output in outputs:
        assert output.deltas[-1].finish_reason == "stop", output.text  # the grammar ended it
    return [output.text for output in outputs]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("choice", "allowed"),
    [("required", {"get_weather", "get_time"}),
     ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})],
)  # fmt: skip
def test_every_sampled_answer_is_a_call_with_valid_arguments(
    engine: Engine, tools_tokenizer: Any, choice: Any, allowed: set[str]
) -> None:
    for answer in generate(engine, tools_tokenizer, choice, range(3)):
        content, calls = parse_tool_calls(answer)
        assert content is None and len(calls) == 1, answer
        assert calls[0].name in allowed
        jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
