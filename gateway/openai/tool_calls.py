"""Tool calls: OpenAI's `tools` in the chat template, and the calls a model writes back.

Models trained on the Hermes format (Qwen2.5, Hermes, ...) call a function by writing

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

in their answer, one block per call. `parse_tool_calls` reads a whole answer, `ToolCallStream`
an answer as it streams; both give the same content and calls for the same text, because the
whole-text parse is the stream fed at once. A block that is not a well-formed call (broken
JSON, no name, arguments that are not an object, no closing tag) stays in the content, as the
text the model wrote: parsing never fails.

`tool_choice` "required" or a named function forces the answer into such blocks with a
grammar: `tool_choice_grammar` checks each function's `parameters` as a response format's schema
is checked and describes the calls; `Grammars.compile_tools` writes their grammar and compiles
it in a compile process, within its limits, as a response format's.
"""

from __future__ import annotations

import json
import secrets
import string
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from engine.errors import InvalidRequest
from engine.structured.schema_checks import check_tool_parameters, check_tool_set, tools_refused
from engine.structured.tool_grammar import ToolCalls
from gateway.openai.schemas import check_json_value

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
CALL_SEPARATOR = "\n"  # between parallel calls, as Hermes-format templates write them
_ID_ALPHABET = string.ascii_letters + string.digits
_ID_LENGTH = 24


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call: `arguments` is a JSON object as compact text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str

    def message_entry(self) -> dict[str, Any]:
        """The call as an entry of a non-streamed `message.tool_calls`."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class IndexedToolCall:
    """A call the stream completed, and its place among the answer's calls (0, 1, ...)."""

    index: int
    call: ToolCall

    def delta(self) -> dict[str, Any]:
        """The whole call as one streamed `delta.tool_calls` entry (clients merge by index)."""
        return {"index": self.index, **self.call.message_entry()}


# What the stream gives: content text, or a completed call.
StreamEvent = str | IndexedToolCall


def new_call_id() -> str:
    """A fresh call id: `call_` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(_ID_LENGTH))


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """The content outside the well-formed calls (stripped; None when empty) and the calls."""
    stream = ToolCallStream()
    events = stream.feed(text) + stream.finish()
    content = "".join(event for event in events if isinstance(event, str))
    calls = [event.call for event in events if isinstance(event, IndexedToolCall)]
    return content or None, calls


class ToolCallStream:
    """Splits an answer, as it streams, into content text and completed tool calls.

    Content is given as soon as it cannot be the start of a call: only a tail that could be the
    beginning of `<tool_call>` is held back. A call is given whole when its closing tag arrives.
    Content is stripped as `parse_tool_calls` strips it: leading whitespace is dropped, and
    whitespace is held until more content follows it (so the whitespace around calls is never
    sent). The content pieces joined are exactly `parse_tool_calls`'s content.
    """

    def __init__(self) -> None:
        self._buffer = ""  # text not yet given: a possible tag start, or an open call's body
        self._in_call = False
        self._held_whitespace = ""
        self._started = False  # some content was given
        self._calls = 0

    def feed(self, text: str) -> list[StreamEvent]:
        """The content and calls that `text`, appended to the answer so far, completes."""
        self._buffer += text
        events: list[StreamEvent] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[StreamEvent]:
        """The rest of the answer: an unterminated call is given back as content."""
        rest = OPEN + self._buffer if self._in_call else self._buffer
        self._buffer, self._in_call = "", False
        return self._content(rest)

    def _step(self, events: list[StreamEvent]) -> bool:
        """Consume one piece of the buffer into `events`; False when it must wait for more."""
        return self._close_call(events) if self._in_call else self._open_call(events)

    def _open_call(self, events: list[StreamEvent]) -> bool:
        start = self._buffer.find(OPEN)
        if start < 0:
            given = len(self._buffer) - _tag_prefix_length(self._buffer)
            events += self._content(self._buffer[:given])
            self._buffer = self._buffer[given:]
            return False
        events += self._content(self._buffer[:start])
        self._buffer = self._buffer[start + len(OPEN) :]
        self._in_call = True
        return True

    def _close_call(self, events: list[StreamEvent]) -> bool:
        end = self._buffer.find(CLOSE)
        if end < 0:
            return False
        body = self._buffer[:end]
        self._buffer = self._buffer[end + len(CLOSE) :]
        self._in_call = False
        # An opening tag inside the body: the text before the last one was not a call.
        restart = body.rfind(OPEN)
        if restart >= 0:
            events += self._content(OPEN + body[:restart])
            body = body[restart + len(OPEN) :]
        call = _read_call(body)
        if call is None:
            events += self._content(OPEN + body + CLOSE)
        else:
            events.append(IndexedToolCall(self._calls, call))
            self._calls += 1
        return True

    def _content(self, text: str) -> list[StreamEvent]:
        """`text` as content to give now, whitespace at either end held or dropped."""
        text = self._held_whitespace + text
        given = text.rstrip()
        self._held_whitespace = text[len(given) :]
        if not self._started:
            given = given.lstrip()
            self._started = bool(given)
        return [given] if given else []


def _tag_prefix_length(text: str) -> int:
    """The length of the longest end of `text` that `<tool_call>` starts with (never all of it)."""
    for length in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-length:]):
            return length
    return 0


def _read_call(body: str) -> ToolCall | None:
    """The call a block holds: a JSON object with a string `name` and an object `arguments`
    (none means {}); None for anything else."""
    try:
        parsed = json.loads(body, parse_constant=_refuse_constant)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))
    return ToolCall(new_call_id(), parsed["name"], text)


def _refuse_constant(name: str) -> None:
    """NaN and Infinity are not JSON: arguments holding them are not a call."""
    raise ValueError(f"{name} is not JSON")


def to_template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-shaped messages as Hugging Face chat templates take them.

    An assistant's `tool_calls` get their arguments as objects (OpenAI sends them as JSON
    text); a `tool` message keeps its `tool_call_id` and gains the called function's `name`
    (templates print either). Everything else is copied unchanged. Raises ValueError naming the
    call whose arguments are not a JSON object.
    """
    converted: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> function name, from the assistant turns so far
    for index, message in enumerate(messages):
        entry = dict(message)
        if message.get("tool_calls"):
            calls = message["tool_calls"]
            entry["tool_calls"] = [
                _template_call(call, f"messages[{index}].tool_calls[{position}]")
                for position, call in enumerate(calls)
            ]
            names.update((call["id"], call["function"]["name"]) for call in entry["tool_calls"])
        if message.get("role") == "tool" and message.get("tool_call_id") in names:
            entry.setdefault("name", names[message["tool_call_id"]])
        converted.append(entry)
    return converted


def _template_call(call: Mapping[str, Any], where: str) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where}.function must have a name")
    try:
        arguments = json.loads(function.get("arguments", ""))
    except RecursionError:
        raise ValueError(f"{where}.function.arguments nests too deep") from None
    except (TypeError, ValueError):
        arguments = None
    if not isinstance(arguments, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object, as text")
    try:
        check_json_value(arguments)  # what its text escapes: depth, lone surrogates
    except ValueError as error:
        raise ValueError(f"{where}.function.arguments {error}") from None
    template_function = {"name": function["name"], "arguments": arguments}
    return {"id": call.get("id"), "type": "function", "function": template_function}


# A function no real tool list holds, rendered to see whether a template prints tools.
_PROBE_NAME = "prefixgate_probe_4c1f0e"
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": _PROBE_NAME, "description": "", "parameters": {"type": "object"}},
}
_tool_support: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_tool_support_lock = threading.Lock()


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template shows the model the `tools` it is given
    (answered once per tokenizer)."""
    with _tool_support_lock:
        if tokenizer not in _tool_support:
            _tool_support[tokenizer] = _renders_probe(tokenizer)
        return _tool_support[tokenizer]


def _renders_probe(tokenizer: Any) -> bool:
    messages = [{"role": "user", "content": "hi"}]
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True
        )
    except (TemplateError, ValueError, TypeError):  # no template, or one that refuses tools
        return False
    return isinstance(text, str) and _PROBE_NAME in text


def tool_choice_grammar(
    tools: Sequence[Mapping[str, Any]], choice: str | Mapping[str, Any], parallel: bool
) -> ToolCalls | None:
    """The tool calls `choice` forces the answer into, for `Grammars.compile_tools`, or None
    for "auto" and "none", which force nothing.

    "required" allows a call of any of `tools`, a named function (`{"type": "function",
    "function": {"name": ...}}`) a call of that one: `<tool_call>\\n{"name": ..., "arguments":
    ...}\\n</tool_call>`, with arguments that follow the function's `parameters`. With
    `parallel`, one or more calls, one per line. `InvalidRequest` on `tools` for parameters
    the grammar cannot enforce, on `tool_choice` for a choice no tool answers. Only checks run
    here: the grammar is written and compiled in a compile process, within its limits.
    """
    if choice in ("auto", "none"):
        return None
    functions = _chosen_functions(tools, choice)
    check_tool_set([function.get("parameters") or {} for function in functions])
    return ToolCalls(
        names=tuple(str(function["name"]) for function in functions),
        parameters=tuple(json.dumps(_parameters(function)) for function in functions),
        open=OPEN,
        close=CLOSE,
        separator=CALL_SEPARATOR if parallel else None,
    )


def _chosen_functions(
    tools: Sequence[Mapping[str, Any]], choice: str | Mapping[str, Any]
) -> list[Mapping[str, Any]]:
    """The `function` objects of the tools `choice` allows."""
    functions = [tool["function"] for tool in tools if tool.get("type") == "function"]
    if choice == "required":
        if not functions:
            raise InvalidRequest("tool_choice 'required' needs at least one tool", "tool_choice")
        return functions
    wanted = choice.get("function", {}).get("name") if isinstance(choice, Mapping) else None
    chosen = [function for function in functions if function.get("name") == wanted]
    if not chosen:
        message = f"tool_choice names function {wanted!r}, which is not among the tools"
        raise InvalidRequest(message, "tool_choice")
    return chosen[:1]


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    """The schema a call's arguments follow: `function`'s parameters, an object."""
    name = function["name"]
    given = function.get("parameters") or {}  # none: any object
    if not isinstance(given, Mapping) or given.get("type", "object") != "object":
        raise tools_refused(f"function {name!r}: parameters must describe an object")
    parameters = {"type": "object", **given}
    check_tool_parameters(parameters, name)
    return parameters
