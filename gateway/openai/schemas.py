"""OpenAI request shapes. Anything not listed here is rejected with a 400 naming it.

Types are strict, as in OpenAI's API: `"5"` is not a number and `"yes"` is not a boolean. Every
string must be encodable as UTF-8 (JSON can carry lone surrogates such as `"\\udfff"`), and every
number that reaches the engine is range-checked here, so no value fails deeper down.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
# What torch.Generator.manual_seed accepts, as OpenAI's int64 seeds and unsigned ones.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
TOKEN_ID_MAX = 2**32 - 1


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"contains a lone surrogate at position {error.start}") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
# How deep a JSON value a client sends inside a field (a schema, tool arguments) may nest.
MAX_JSON_DEPTH = 64


def check_json_value(value: Any) -> Any:
    """`value` (parsed JSON) nested at most MAX_JSON_DEPTH deep, every string and key valid
    Unicode; raises ValueError saying what is wrong. Iterative: no depth can exhaust a stack."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(item, str):
            _utf8(item)
        elif isinstance(item, dict):
            for key, child in item.items():
                _utf8(key)
                stack.append((child, depth + 1))
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
    return value


JsonObject = Annotated[dict[str, Any], AfterValidator(check_json_value)]
TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]
StopText = Annotated[Text, Field(max_length=1000)]  # held back from streams: keep it short


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class TextFormat(BaseModel):
    """`response_format` as plain text: what every completion is without one."""

    model_config = _STRICT

    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    """`response_format` JSON mode: the output is one JSON object."""

    model_config = _STRICT

    type: Literal["json_object"]


class JsonSchema(BaseModel):
    model_config = _STRICT

    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: Text | None = Field(default=None, max_length=4096)
    # Checked by engine/structured/schema_checks.py, which names a keyword it cannot enforce.
    schema_: JsonObject = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(BaseModel):
    """`response_format` structured outputs: the output follows `json_schema.schema`."""

    model_config = _STRICT

    type: Literal["json_schema"]
    json_schema: JsonSchema


MetadataKey = Annotated[Text, Field(max_length=64)]
MetadataValue = Annotated[Text, Field(max_length=512)]


class TextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: Text


FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


class FunctionCall(BaseModel):
    """A call an assistant made: `arguments` is a JSON object as text, as OpenAI sends it."""

    model_config = _STRICT

    name: FunctionName
    arguments: Text


class MessageToolCall(BaseModel):
    model_config = _STRICT

    id: Text = Field(max_length=256)
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None only for an assistant turn that made tool calls.
    content: Text | list[TextPart] | None = None
    name: Text | None = Field(default=None, max_length=64)
    tool_calls: Annotated[list[MessageToolCall], Field(min_length=1, max_length=128)] | None = None
    # The call a `tool` message answers.
    tool_call_id: Text | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("tool messages, and only they, need a tool_call_id")
        if self.content is None and self.tool_calls is None:
            raise ValueError("content may be null only in an assistant message with tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_entry(self, role: str) -> dict[str, Any]:
        """The message as a chat template takes it (tool calls' arguments still as text)."""
        entry: dict[str, Any] = {"role": role, "content": self.text()}
        if self.tool_calls is not None:
            entry["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            entry["tool_call_id"] = self.tool_call_id
        return entry


class FunctionDefinition(BaseModel):
    model_config = _STRICT

    name: FunctionName
    description: Text | None = None
    # Checked by engine/structured/schema_checks.py when a tool_choice forces a call (as response
    # formats are).
    parameters: JsonObject | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _STRICT

    name: FunctionName


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the one function the answer must call."""

    model_config = _STRICT

    type: Literal["function"]
    function: NamedFunction


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = _STRICT

    model: Text = Field(max_length=256)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: StopText | Annotated[list[StopText], Field(max_length=4)] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # Token id (a decimal string, as JSON keys are) -> bias; ids are checked in preparation.
    logit_bias: (
        Annotated[dict[Text, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=1024)]
        | None
    ) = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = Field(default=None, max_length=256)
    # null means the default, as in OpenAI's API.
    n: Annotated[int, BeforeValidator(lambda value: 1 if value is None else value)] = Field(
        default=1, ge=1
    )
    # Accepted as a routing hint only: it never widens a cache scope.
    prompt_cache_key: Text | None = Field(default=None, max_length=256)
    # Accepted without effect, as OpenAI allows: nothing is stored, every request is served
    # on the one tier there is. response_format "text" is what every completion is anyway.
    store: bool | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    response_format: (
        Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]
        | None
    ) = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _distinct_names(tools: list[ToolDefinition]) -> list[ToolDefinition]:
    names = [tool.function.name for tool in tools]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"function names must be distinct; repeated: {', '.join(repeated)}")
    return tools


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: (
        Annotated[
            list[ToolDefinition],
            Field(min_length=1, max_length=128),
            AfterValidator(_distinct_names),
        ]
        | None
    ) = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _not_too_many(cls, value: Any, info: ValidationInfo) -> Any:
        """The message cap (validation context `max_messages`), before any is validated."""
        limit = (info.context or {}).get("max_messages")
        if limit is not None and isinstance(value, list) and len(value) > limit:
            raise ValueError(f"{len(value)} messages; the limit is {limit}")
        return value

    def text_chars(self) -> int:
        """Characters of message text (tools and calls included, as JSON), checked against a
        cap before the template runs."""
        chars = sum(len(message.text()) + len(message.name or "") for message in self.messages)
        calls = [message.tool_calls for message in self.messages if message.tool_calls]
        if calls or self.tools:
            chars += len(json.dumps([call.model_dump() for group in calls for call in group]))
            chars += len(json.dumps([tool.model_dump() for tool in self.tools or []]))
        return chars

    def tool_dicts(self) -> list[dict[str, Any]]:
        """The tools as JSON objects, without the fields left out."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools or []]


class CompletionRequest(SamplingFields):
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    echo: bool | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)

    def text_chars(self) -> int:
        """Characters of prompt text, checked against a cap before tokenizing."""
        prompt: Any = self.prompt
        if isinstance(prompt, str):
            return len(prompt)
        return sum(len(item) for item in prompt if isinstance(item, str))
