"""Grammars compile in a pool of processes: a schema too costly in time or memory is refused
as the client's and the pool recovers, xgrammar's words never reach a refusal, the processes
end with the pool (or with their parent), and an object's property names cannot be spelled
or repeated past its schema."""

from __future__ import annotations

import json
import os
import random
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr

from engine.errors import InvalidRequest
from engine.model.loader import LoadedModel, load_model
from engine.structured.compile_limits import CompileLimits
from engine.structured.grammar import Grammars, ResponseFormat
from engine.structured.tool_grammar import ToolCalls

# 50 declared properties beside additional ones: xgrammar spells "any name but these 50" as a
# trie of rules, whose compile takes ~10 s over SmolLM2's vocabulary (2.3 KB of schema).
_names = random.Random(0)
COSTLY = {
    "type": "object",
    "properties": {
        "".join(_names.choices(string.ascii_letters, k=10)): {"type": "integer"} for _ in range(50)
    },
    "additionalProperties": True,
}
# 300 integers with 15-digit bounds: ~200 MB and ~1.3 s to compile.
MEMORY_HUNGRY = {
    "type": "object",
    "properties": {
        f"p{index}": {"type": "integer", "minimum": -(10**14) - index, "maximum": 10**15 + index}
        for index in range(300)
    },
    "required": [f"p{index}" for index in range(300)],
}
SIMPLE = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def model(tiny_chat_dir: Path) -> LoadedModel:
    return load_model(tiny_chat_dir)


def grammars_for(model: LoadedModel, limits: CompileLimits) -> Grammars:
    return Grammars(model.tokenizer, model.vocab_size, model.eos_token_ids, limits)


@pytest.fixture
def grammars(model: LoadedModel) -> Any:
    """Grammars with time to compile ordinary schemas on a busy machine."""
    grammars = grammars_for(model, CompileLimits(timeout_s=10, memory_mb=1024, processes=1))
    yield grammars
    grammars.close()


@pytest.fixture
def hasty(model: LoadedModel) -> Any:
    """Grammars with half a second a compile: what the costly schemas are refused under."""
    grammars = grammars_for(model, CompileLimits(timeout_s=0.5, memory_mb=1024, processes=1))
    yield grammars
    grammars.close()


def compile_schema(grammars: Grammars, schema: Any) -> xgr.CompiledGrammar:
    return grammars.compile(ResponseFormat("json_schema", json.dumps(schema)))


def running(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (a zombie has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_schema_too_costly_to_compile_is_refused_and_the_pool_recovers(
    hasty: Grammars,
) -> None:
    assert compile_schema(hasty, SIMPLE)
    [before] = hasty.compile_pids()
    with pytest.raises(InvalidRequest, match=r"too costly to compile within 0\.5 s") as raised:
        compile_schema(hasty, COSTLY)
    assert raised.value.param == "response_format"
    assert not running(before)  # killed, not left compiling
    assert compile_schema(hasty, {"type": "array", "items": {"type": "boolean"}})
    assert hasty.compile_pids() != [before]  # a new process took its place


def tool_calls(parameters: Any) -> ToolCalls:
    """A call of one function `f` with these parameters."""
    return ToolCalls(("f",), (json.dumps(parameters),), "<tool_call>", "</tool_call>")


def test_a_tool_grammar_too_costly_to_compile_is_refused_on_tools(hasty: Grammars) -> None:
    with pytest.raises(InvalidRequest, match=r"^tools: the schema is too costly") as raised:
        hasty.compile_tools(tool_calls(COSTLY))
    assert raised.value.param == "tools"


# 600 properties, half of them required by count: xgrammar takes seconds (and hundreds of MB)
# only to write this schema's grammar, before any compile (17 KB of schema).
COSTLY_TO_WRITE = {
    "type": "object",
    "properties": {f"p{index}": {"type": "integer"} for index in range(600)},
    "minProperties": 300,
}


@pytest.mark.parametrize("kind", ["response_format", "tools"])
def test_writing_a_costly_grammar_counts_against_the_time_limit(hasty: Grammars, kind: str) -> None:
    assert compile_schema(hasty, SIMPLE)  # its compile process is running
    started = time.monotonic()
    with pytest.raises(InvalidRequest, match=r"too costly to compile within 0\.5 s"):
        if kind == "tools":
            hasty.compile_tools(tool_calls(COSTLY_TO_WRITE))
        else:
            compile_schema(hasty, COSTLY_TO_WRITE)
    # The limit and no more: never the seconds the grammar takes to write.
    assert time.monotonic() - started < 1.5


def test_a_schema_that_needs_too_much_memory_is_refused(model: LoadedModel) -> None:
    grammars = grammars_for(model, CompileLimits(timeout_s=30, memory_mb=32, processes=1))
    try:
        with pytest.raises(InvalidRequest, match="needs more than 32 MiB to compile"):
            compile_schema(grammars, MEMORY_HUNGRY)
        assert compile_schema(grammars, SIMPLE)  # the process (or its successor) still serves
    finally:
        grammars.close()


def test_the_compile_processes_end_when_the_pool_closes(model: LoadedModel) -> None:
    grammars = grammars_for(model, CompileLimits(timeout_s=5, processes=2))
    compile_schema(grammars, SIMPLE)
    compile_schema(grammars, {"type": "boolean"})
    pids = grammars.compile_pids()
    assert len(pids) == 2 and all(running(pid) for pid in pids)
    grammars.close()
    assert grammars.compile_pids() == [] and not any(running(pid) for pid in pids)


_ORPHAN_SCRIPT = """
import os, signal, sys
import xgrammar as xgr
from engine.structured.compile_limits import CompileLimits
from engine.structured.compile_pool import CompilePool
from engine.structured.compile_worker import Job

if __name__ == "__main__":
    info = xgr.TokenizerInfo(["a", "b"]).serialize_json()
    pool = CompilePool(info, CompileLimits(processes=2))
    pool.compile(Job("schema", '{"type": "integer"}'), 5)
    pool.compile(Job("schema", '{"type": "boolean"}'), 5)
    print(" ".join(map(str, pool.pids())), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no clean-up: the parent dies
"""


def test_no_compile_process_outlives_a_killed_parent(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(_ORPHAN_SCRIPT)
    root = Path(__file__).resolve().parents[3]
    environment = {**os.environ, "PYTHONPATH": str(root)}
    parent = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=environment, check=False
    )
    pids = [int(pid) for pid in parent.stdout.split()]
    assert parent.returncode == -9 and len(pids) == 2, parent.stderr
    # They read the end of their pipe and leave; bounded, so a failure cannot hang the run.
    deadline = time.monotonic() + 30
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(running(pid) for pid in pids)


_MAIN_SCRIPT = """
import sys
import xgrammar as xgr
from engine.structured.compile_limits import CompileLimits
from engine.structured.compile_pool import CompilePool
from engine.structured.compile_worker import Job

with open(sys.argv[1], "a") as runs:  # each run of this script's top level leaves a line
    print("ran", file=runs)

if __name__ == "__main__":
    info = xgr.TokenizerInfo(["a", "b"]).serialize_json()
    pool = CompilePool(info, CompileLimits(processes=2))
    pool.compile(Job("schema", '{"type": "integer"}'), 5)
    pool.compile(Job("schema", '{"type": "boolean"}'), 5)
    pool.close()  # and a third process, as after a compile killed at its limit
    pool.compile(Job("schema", '{"type": "null"}'), 5)
    pool.close()
"""


def test_a_compile_process_does_not_run_the_main_script_again(tmp_path: Path) -> None:
    # multiprocessing would run the parent's main script in each process it starts; for
    # `prefixgate serve` that imports the whole gateway, seconds per compile process.
    script, runs = tmp_path / "main.py", tmp_path / "runs"
    script.write_text(_MAIN_SCRIPT)
    root = Path(__file__).resolve().parents[3]
    environment = {**os.environ, "PYTHONPATH": str(root)}
    parent = subprocess.run(
        [sys.executable, str(script), str(runs)],
        capture_output=True,
        text=True,
        env=environment,
        check=False,
        timeout=120,
    )
    assert parent.returncode == 0, parent.stderr
    assert runs.read_text().splitlines() == ["ran"]  # the parent's run alone


# Schemas xgrammar itself refuses (past schema_checks.py), and what the refusal says instead of
# xgrammar's words.
XGRAMMAR_REFUSES = [
    ({"type": "integer", "exclusiveMinimum": 2, "exclusiveMaximum": 3},
     "'exclusiveMinimum' (at #) is not one it can hold"),
    ({"type": "object", "properties": {"a": {"enum": []}}},
     "'enum' (at #/properties/a) is not one it can hold"),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 3, "items": False},
     "'minItems' (at #) is not one it can hold"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
     "'$ref' (at #) is not one it can hold"),
    ({"type": "integer", "maximum": 1e20}, "'maximum' (at #) is not one it can hold"),
    # xgrammar names another keyword ("Integer exceeds maximum limit"), or none ("Invalid range").
    ({"type": "integer", "minimum": 1e300}, "'minimum' (at #) is not one it can hold"),
    ({"type": "object", "properties": {"a": {"type": "number", "minimum": 1,
                                             "exclusiveMaximum": 1}}},
     "'minimum' (at #/properties/a) is not one it can hold"),
]  # fmt: skip
XGRAMMAR_WORDS = ("json_schema_converter", ".cc", "Check failed", "Invalid range", "must be")


@pytest.mark.parametrize(("schema", "said"), XGRAMMAR_REFUSES)
def test_an_xgrammar_refusal_names_the_keyword_and_path_in_our_words(
    grammars: Grammars, schema: Any, said: str
) -> None:
    with pytest.raises(InvalidRequest) as raised:
        compile_schema(grammars, schema)
    message = str(raised.value)
    assert message == f"response_format: {said}" or message.endswith(said), message
    assert not any(words in message for words in XGRAMMAR_WORDS), message


@pytest.mark.parametrize(
    ("schema", "said"),
    [
        ({"type": "string", "pattern": "[z-a]"}, "the pattern at # cannot be compiled"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "'minimum' (at #) is greater than"),
        ({"type": "object", "properties": {"a": {"type": "array", "minItems": 3,
                                                 "maxItems": 1}}},
         "'minItems' (at #/properties/a) is greater than 'maxItems'"),
        # Values of the wrong type or range, which xgrammar refuses without naming them.
        ({"type": "array", "items": {"type": "integer"}, "maxItems": -2},
         "'maxItems' (at #) is not a whole number from 0 to 2147483647"),
        ({"type": "string", "minLength": -1}, "'minLength' (at #) is not a whole number"),
        ({"type": "array", "minItems": 10**12}, "'minItems' (at #) is not a whole number"),
        ({"type": "array", "minItems": 2.0}, "'minItems' (at #) is not a whole number"),
        ({"type": "object", "properties": []}, "'properties' (at #) is not an object"),
        ({"type": "object", "properties": {"a": {"type": "array", "items": [{}]}}},
         "'items' (at #/properties/a) is not a schema (an object or a boolean)"),
        ({"type": "object", "additionalProperties": 3},
         "'additionalProperties' (at #) is not a schema"),
        ({"type": "integer", "minimum": "3"}, "'minimum' (at #) is not a finite number"),
        ({"type": "number", "maximum": float("inf")}, "'maximum' (at #) is not a finite number"),
        ({"type": "integer", "minimum": 1.5, "maximum": 1.7},
         "'minimum' (at #) of an integer is not a whole number"),
        ({"type": "string", "format": 3}, "'format' (at #) is not a string"),
        ({"type": "object", "properties": {"a": {}}, "required": [1]},
         "'required' (at #) is not an array of strings"),
        ({"anyOf": {}}, "'anyOf' (at #) is not an array"),
        ({"type": "object", "properties": {"a": False}, "required": ["a"]},
         "required property 'a' (at #) has the schema false"),
    ],
)  # fmt: skip
def test_what_xgrammar_would_refuse_is_refused_first_by_keyword(
    grammars: Grammars, schema: Any, said: str
) -> None:
    with pytest.raises(InvalidRequest, match="response_format") as raised:
        compile_schema(grammars, schema)
    assert said in str(raised.value)
    assert not any(words in str(raised.value) for words in XGRAMMAR_WORDS)


def test_an_unreadable_serialized_grammar_is_refused_without_xgrammar_words(
    grammars: Grammars,
) -> None:
    with pytest.raises(InvalidRequest) as raised:
        grammars.compile_serialized('{"not": "a grammar"}')
    assert str(raised.value) == "not a serialized grammar"


# Property names spelled with escapes, or written twice, against the compiled grammar.
TYPED = {"type": "object", "properties": {"a": {"type": "integer"}}}
OUTPUTS = [
    ({**TYPED, "additionalProperties": True}, '{"a": 1, "b": "x"}', True),
    ({**TYPED, "additionalProperties": True}, '{"b": "x", "c": [1]}', True),
    ({**TYPED, "additionalProperties": True}, '{"\\u0061": "text"}', False),  # "a", escaped
    ({**TYPED, "additionalProperties": True}, '{"b\\u0061": "x"}', False),  # any escape
    ({**TYPED, "additionalProperties": True}, '{"a": 1, "a": "x"}', False),
    ({**TYPED, "additionalProperties": False}, '{"a": 1}', True),
    ({**TYPED, "additionalProperties": False}, '{"\\u0061": "text"}', False),
    ({**TYPED, "additionalProperties": False}, '{"a": 1, "a": "x"}', False),
    ({**TYPED, "additionalProperties": {"type": "string"}}, '{"a": 2, "é": "x"}', True),
    ({**TYPED, "additionalProperties": {"type": "string"}}, '{"\\u0061": "x"}', False),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2},
     '{"b": 1, "b": 2}', True),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2},
     '{"b": 1, "b": 2, "b": 3}', False),  # the grammar counts names as written
    ({"type": "object", "patternProperties": {"^b$": {"type": "string"}}},
     '{"\\u0062": 1}', False),
    # What a model ordinarily writes still passes.
    ({**TYPED, "required": ["a"], "additionalProperties": True},
     '{\n  "a": -3,\n  "note": "fine",\n  "nested": {"x\\"y": [true, null]}\n}', True),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "output", "allowed"), OUTPUTS)
def test_property_names_cannot_be_spelled_or_repeated_past_the_schema(
    grammars: Grammars, schema: Any, output: str, allowed: bool
) -> None:
    matcher = xgr.GrammarMatcher(
        compile_schema(grammars, schema), terminate_without_stop_token=True
    )
    assert (matcher.accept_string(output) and matcher.is_terminated()) is allowed


@pytest.mark.parametrize(
    ("schema", "said"),
    [
        ({**TYPED, "required": ["a"], "additionalProperties": True, "minProperties": 2},
         "'minProperties' (at #) beyond the required properties is not enforced"),
        ({"type": "object", "patternProperties": {"^b": {}}, "minProperties": 1},
         "'minProperties' (at #) beyond the required properties"),
        ({"type": "object", "properties": {"a": {}}, "minProperties": 2},
         "'minProperties' (at #) is more than the properties it allows"),
        ({"type": "object", "properties": {'a"b': {"type": "integer"}},
          "additionalProperties": True}, "property 'a\"b' (at #) is not plain printable ASCII"),
    ],
)  # fmt: skip
def test_what_repeated_or_escaped_names_would_get_past_is_refused(
    grammars: Grammars, schema: Any, said: str
) -> None:
    with pytest.raises(InvalidRequest) as raised:
        compile_schema(grammars, schema)
    assert said in str(raised.value)


def test_min_properties_the_required_properties_meet_is_accepted(grammars: Grammars) -> None:
    schema = {**TYPED, "required": ["a"], "additionalProperties": True, "minProperties": 1}
    matcher = xgr.GrammarMatcher(
        compile_schema(grammars, schema), terminate_without_stop_token=True
    )
    assert matcher.accept_string('{"a": 1, "b": 2}') and matcher.is_terminated()
