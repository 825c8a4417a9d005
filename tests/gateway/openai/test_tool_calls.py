"""Tool calls read from a model's answer, whole or streamed: the same content and calls either
way, and a block that is not a well-formed call stays text."""

from __future__ import annotations

import json
import re
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.openai.tool_calls import (
    IndexedToolCall,
    ToolCall,
    ToolCallStream,
    new_call_id,
    parse_tool_calls,
    template_supports_tools,
    to_template_messages,
)

WEATHER = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}\n</tool_call>'
)
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
TWO_CALLS = f"Let me check both.\n{WEATHER}\n{TIME}\n"
# Answers the stream must read exactly as the whole-text parse does.
ANSWERS = [
    TWO_CALLS,
    "plain text, no calls at all ",
    f"{WEATHER}\nand then <tool but not a tag, <tool_cal> neither\n{TIME} done",
    '<tool_call>\n{"name": "broken", "arguments": {\n</tool_call>\nafter',
    f"{WEATHER}\n<tool_call>\n" + '{"name": "cut short", "argu',
    '<tool_call>\n{"broken"\n' + TIME,
    f"  \n{TIME}\n\n  {TIME}  \n",
    "<<tool_call><tool_call>></tool_call></tool_call><",
]


def named(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in calls]


def streamed(chunks: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """Content and calls as the stream gives them for `chunks`, checking call indexes."""
    stream = ToolCallStream()
    events = [event for chunk in chunks for event in stream.feed(chunk)] + stream.finish()
    calls = [event for event in events if isinstance(event, IndexedToolCall)]
    assert [call.index for call in calls] == list(range(len(calls)))
    content = "".join(event for event in events if isinstance(event, str))
    return content or None, named([call.call for call in calls])


def whole(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text)
    return content, named(calls)


def test_calls_become_tool_calls_and_the_rest_content() -> None:
    content, calls = parse_tool_calls(TWO_CALLS)
    assert content == "Let me check both."
    assert named(calls) == [
        ("get_weather", '{"city":"Zürich","days":3}'),  # compact, not ASCII-escaped
        ("get_time", '{"zone":"UTC"}'),
    ]
    assert len({call.id for call in calls}) == 2


def test_an_answer_of_calls_alone_has_no_content() -> None:
    content, calls = parse_tool_calls(f"\n{WEATHER}\n\n{TIME}\n")
    assert content is None and len(calls) == 2


def test_an_answer_without_calls_is_all_content() -> None:
    assert parse_tool_calls("  Paris is sunny.\n") == ("Paris is sunny.", [])
    assert parse_tool_calls("") == (None, [])


def test_missing_arguments_are_an_empty_object() -> None:
    _, calls = parse_tool_calls('<tool_call>{"name": "now"}</tool_call>')
    assert named(calls) == [("now", "{}")]


MALFORMED = [
    '{"name": "f", "arguments": {"a": 1}',  # JSON cut short
    '{"arguments": {"a": 1}}',  # no name
    '{"name": 7, "arguments": {}}',  # a name that is not a string
    '{"name": "f", "arguments": "{\\"a\\": 1}"}',  # arguments as text, not an object
    '{"name": "f", "arguments": [1, 2]}',
    '{"name": "f", "arguments": {"a": NaN}}',  # not JSON, though Python reads it
    '["f", {"a": 1}]',
]


@pytest.mark.parametrize("body", MALFORMED)
def test_a_malformed_call_stays_in_the_content_as_written(body: str) -> None:
    block = f"<tool_call>\n{body}\n</tool_call>"
    content, calls = parse_tool_calls(f"{block}\n{TIME}")
    assert content == block
    assert named(calls) == [("get_time", '{"zone":"UTC"}')]


def test_an_unterminated_call_is_content() -> None:
    cut = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "U'
    content, calls = parse_tool_calls(f"{WEATHER}\n{cut}")
    assert content == cut and named(calls) == [("get_weather", '{"city":"Zürich","days":3}')]


def test_a_call_opened_again_before_it_closed_keeps_the_second_opening() -> None:
    content, calls = parse_tool_calls('<tool_call>\n{"name": "f", "argu\n' + TIME)
    assert content == '<tool_call>\n{"name": "f", "argu'
    assert named(calls) == [("get_time", '{"zone":"UTC"}')]


@pytest.mark.parametrize("answer", ANSWERS)
def test_streaming_split_anywhere_reads_as_the_whole_text(answer: str) -> None:
    expected = whole(answer)
    for cut in range(len(answer) + 1):
        assert streamed([answer[:cut], answer[cut:]]) == expected, cut
    assert streamed(list(answer)) == expected  # one character at a time


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(ANSWERS), st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_streaming_in_any_chunks_reads_as_the_whole_text(answer: str, cuts: list[int]) -> None:
    points = sorted({0, len(answer), *(cut % (len(answer) + 1) for cut in cuts)})
    chunks = [answer[start:end] for start, end in pairwise(points)]
    assert streamed(chunks) == whole(answer)


def test_content_streams_at_once_but_a_possible_tag_is_held() -> None:
    stream = ToolCallStream()
    assert stream.feed("Hello <too") == ["Hello"]  # the space waits for what follows
    assert stream.feed("lbox> here") == [" <toolbox> here"]
    assert stream.feed("<tool_") == []
    assert stream.finish() == ["<tool_"]


def test_a_call_is_given_whole_when_its_closing_tag_arrives() -> None:
    stream = ToolCallStream()
    assert stream.feed('<tool_call>\n{"name": "now", "arguments": {}}') == []
    assert stream.feed("\n</tool_") == []
    [event] = stream.feed("call>")
    assert isinstance(event, IndexedToolCall) and event.index == 0
    assert (event.call.name, event.call.arguments) == ("now", "{}")


def test_whitespace_around_calls_is_never_streamed() -> None:
    stream = ToolCallStream()
    events = stream.feed(f"\n{WEATHER}\n\n") + stream.feed(f"{TIME}\n") + stream.finish()
    assert [type(event) for event in events] == [IndexedToolCall, IndexedToolCall]


def test_openai_shapes_of_a_call() -> None:
    call = ToolCall("call_abc", "get_time", '{"zone":"UTC"}')
    function = {"name": "get_time", "arguments": '{"zone":"UTC"}'}
    assert call.message_entry() == {"id": "call_abc", "type": "function", "function": function}
    assert IndexedToolCall(2, call).delta() == {
        "index": 2, "id": "call_abc", "type": "function", "function": function,
    }  # fmt: skip


def test_call_ids_are_call_and_24_random_letters_or_digits() -> None:
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", call_id) for call_id in ids)


def conversation(arguments: str) -> list[dict[str, Any]]:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": arguments}}  # fmt: skip
    return [
        {"role": "user", "content": "What time is it in UTC?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]


def test_template_messages_carry_arguments_as_objects_and_name_the_tool() -> None:
    messages = conversation('{"zone": "UTC"}')
    original = json.dumps(messages)
    user, assistant, tool = to_template_messages(messages)
    assert user == messages[0]
    assert assistant["tool_calls"] == [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}
    ]  # fmt: skip
    assert tool == {**messages[2], "name": "get_time"}
    assert json.dumps(messages) == original  # the request's own messages are not changed


@pytest.mark.parametrize("arguments", ['["UTC"]', '{"zone": ', '"UTC"', ""])
def test_template_messages_refuse_arguments_that_are_not_a_json_object(arguments: str) -> None:
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"):
        to_template_messages(conversation(arguments))


class CountingTokenizer:
    """A tokenizer whose chat template prints the tools it is given, or refuses them."""

    def __init__(self, refuses: bool = False) -> None:
        self.refuses = refuses
        self.renders = 0

    def apply_chat_template(self, messages: Any, tools: Any = None, **options: Any) -> str:
        self.renders += 1
        if self.refuses:
            raise ValueError("this template takes no tools")
        return json.dumps([messages, tools])


def test_tool_support_is_probed_once_per_tokenizer() -> None:
    printing, refusing = CountingTokenizer(), CountingTokenizer(refuses=True)
    assert [template_supports_tools(printing) for _ in range(3)] == [True] * 3
    assert [template_supports_tools(refusing) for _ in range(3)] == [False] * 3
    assert printing.renders == refusing.renders == 1
