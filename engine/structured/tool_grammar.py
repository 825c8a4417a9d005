"""The grammar of forced tool calls, built inside the compile sandbox (`compile_worker.py`).

A call's grammar holds the JSON grammar of its function's `parameters`, and turning a schema
into that grammar can itself take xgrammar seconds and hundreds of megabytes (a few hundred
properties with `minProperties`, within the size limits). So the serving process only checks
the schemas and describes the calls (`ToolCalls`); the grammar is written where the compile
runs, within its time and memory limits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from engine.structured.schema_grammar import json_schema_ebnf


@dataclass(frozen=True, slots=True)
class ToolCalls:
    """The calls a forced `tool_choice` allows: a call object `{"name": ..., "arguments": ...}`
    of any of the functions `names`, whose arguments follow its `parameters` (JSON schemas'
    text, checked by `schema_checks.check_tool_parameters`), written between `open` and `close`;
    with a `separator`, one or more calls separated by it, else exactly one."""

    names: tuple[str, ...]
    parameters: tuple[str, ...]  # in the order of `names`
    open: str
    close: str
    separator: str | None = None

    def to_json(self) -> str:
        """The description as a compile job's text."""
        return json.dumps(
            {
                "names": self.names,
                "parameters": self.parameters,
                "open": self.open,
                "close": self.close,
                "separator": self.separator,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> ToolCalls:
        fields = json.loads(text)
        return cls(
            tuple(fields["names"]),
            tuple(fields["parameters"]),
            fields["open"],
            fields["close"],
            fields["separator"],
        )


class CallSchemaRefused(RuntimeError):
    """xgrammar could not turn the parameters of the function at `index` into a grammar.

    Its text is `<index>:<xgrammar's text>`, the form `refused_call` reads back in the serving
    process (only the text crosses the pipe).
    """

    def __init__(self, index: int, detail: str) -> None:
        super().__init__(f"{index}:{detail}")


def refused_call(text: str) -> tuple[int, str] | None:
    """The index and xgrammar's text of a `CallSchemaRefused`'s text, else None."""
    index, separator, detail = text.partition(":")
    return (int(index), detail) if separator and index.isdigit() else None


def tool_calls_grammar(calls: ToolCalls) -> xgr.Grammar:
    """The grammar `calls` describes. Raises `CallSchemaRefused` for parameters xgrammar cannot
    convert, RuntimeError for anything else it refuses."""
    functions = enumerate(zip(calls.names, calls.parameters, strict=True))
    one_call = xgr.Grammar.union(
        *(
            _call_grammar(index, name, json.loads(given), calls)
            for index, (name, given) in functions
        )
    )
    if calls.separator is None:
        return one_call
    # xgrammar prints a grammar's root rule as `root` (renaming any other rule of that name).
    repeated = f"{one_call}\nparallel_calls ::= root ({json.dumps(calls.separator)} root)*\n"
    return xgr.Grammar.from_ebnf(repeated, root_rule_name="parallel_calls")


def _call_grammar(index: int, name: str, parameters: Any, calls: ToolCalls) -> xgr.Grammar:
    """One call block: `open`, a line break, the call object, a line break, `close`."""
    try:
        body = xgr.Grammar.from_ebnf(json_schema_ebnf(json.dumps(call_schema(name, parameters))))
    except RuntimeError as error:  # xgrammar's own refusal, e.g. a $ref it cannot resolve
        raise CallSchemaRefused(index, str(error)) from None
    return xgr.Grammar.concat(_literal(calls.open + "\n"), body, _literal("\n" + calls.close))


def call_schema(name: str, parameters: Any) -> dict[str, Any]:
    """The schema of a call object of function `name`, whose arguments follow `parameters`."""
    arguments = dict(parameters)
    # The call object nests the parameters: their definitions move to its top, where their
    # references ("#/$defs/...", "#/definitions/...") point.
    definitions = {key: arguments.pop(key) for key in ("$defs", "definitions") if key in arguments}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **definitions,
    }


def _literal(text: str) -> xgr.Grammar:
    """The grammar of exactly `text` (ASCII: JSON's escapes are EBNF's)."""
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")
