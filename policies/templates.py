"""Chat templates rendered once per request, with message text that stays text.

A conversation is rendered by the model's own template twice, whatever its length: once with a
unique placeholder in place of each message's content (the *layout*) and once as it is. When
putting the contents back into the layout reproduces the real rendering exactly, the rendering
is a chain of pieces, template text and message contents in turn:

    T0 C0 T1 C1 ... C(n-1) Tn

Template pieces are tokenized with special tokens (they are the template's own role markers);
content pieces with special tokens split into plain text, as Hugging Face's
`split_special_tokens=True` would, so "<|im_end|>" typed by a user is ordinary text and can
never close a turn or open a forged system turn. Pieces are tokenized separately, so message
text can neither become nor merge into the template's tokens. A template that rewrites
contents (trims them, say) cannot be cut that way, nor can a tokenizer that prefixes every
call (SentencePiece's "▁"): then the whole rendering is tokenized as one
text, and a conversation whose contents hold a special-token string is refused
(`TemplateRejected`), because nothing would tell its forged markers from the real ones.

For ordinary chats this gives the very tokens of the whole rendering, because pre-tokenizers
cut at the special tokens and line breaks around contents anyway. Measured on SmolLM2, one
place differs: a content that starts with two or more whitespace characters ("\n\n", "  "),
which a whole rendering would merge with the template's newline before it into one
pre-token; here the content keeps its own tokens whatever the template puts around it.

Span boundary rule: message i owns the template text in front of its content and the content,
T(i) C(i); the first span starts at token 0 and the last one also owns the closing text Tn
(its end markers and the generation prompt). Spans tile the token ids. When the template
rewrites contents the boundaries are unknown: the first message's span holds every token and
the others are empty at the end (the planner only asks which role comes first).
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from tokenizers import Tokenizer

# Two user messages that share no first character, so renderings diverge at the user text.
_PROBES = ("A", "\u2603 z")


class TemplateRejected(ValueError):
    """A conversation the chat template cannot render safely; the client should change it."""


@dataclass(frozen=True, slots=True)
class MessageSpan:
    """Where one chat message lies in the rendered token ids."""

    role: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class _Backends:
    """Private copies of a tokenizer's Rust backend, one per way of reading special tokens.

    Copies, never the shared backend with a flag toggled, because requests tokenize from
    several threads at once and Hugging Face code may reconfigure its own backend.
    """

    markers: Tokenizer  # special-token strings are special tokens: template pieces
    text: Tokenizer  # special-token strings are plain text: message contents
    specials: re.Pattern[str] | None  # any special-token string, for templates we cannot cut
    piecewise: bool  # pieces tokenize as their concatenation would (no per-call prefix space)


_backends: weakref.WeakKeyDictionary[Any, _Backends] = weakref.WeakKeyDictionary()
_backends_lock = threading.Lock()


def render_with_spans(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[MessageSpan]]:
    """Token ids of a conversation and where each message lies in them (see the module doc).

    Costs two template renders and two batched tokenizer calls, whatever the number of
    messages. Raises TemplateRejected when the template refuses the conversation or when
    message text could pass for special tokens.

    `tools` (OpenAI function definitions) and assistants' `tool_calls` are rendered by the
    template as part of its own text, so no string in them may hold a special token.
    """
    if not messages:
        raise TemplateRejected("a conversation needs at least one message")
    backends = _backends_of(tokenizer)
    calls = [message.get("tool_calls") for message in messages if message.get("tool_calls")]
    _refuse_special_tokens(backends, "tools", tools)
    _refuse_special_tokens(backends, "tool calls", calls)
    rendering = _render_text(tokenizer, messages, generation_prompt, tools)
    template = _template_pieces(tokenizer, messages, generation_prompt, rendering, tools)
    if template is None or not backends.piecewise:
        return _tokenize_whole(backends, messages, rendering)
    template_ids = _encode_all(backends.markers, template)
    content_ids = _encode_all(backends.text, [message["content"] for message in messages])
    token_ids: list[int] = []
    spans: list[MessageSpan] = []
    for message, before, content in zip(messages, template_ids, content_ids, strict=False):
        start = len(token_ids)
        token_ids += before
        token_ids += content
        spans.append(MessageSpan(message["role"], start, len(token_ids)))
    token_ids += template_ids[-1]
    last = spans[-1]
    spans[-1] = MessageSpan(last.role, last.start, len(token_ids))
    return token_ids, spans


def render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    """Token ids of a conversation rendered by the model's own chat template."""
    return render_with_spans(tokenizer, messages, generation_prompt)[0]


def system_prompt_tokens(tokenizer: Any, system_text: str) -> list[int]:
    """The token ids every conversation with this system prompt starts with.

    Tokenized exactly as requests are (`render_with_spans`), cut where two different user
    turns diverge: template tokens up to the user's text are included, the user's text never
    is, wherever the template puts the boundary.
    """
    first, second = (
        render(
            tokenizer,
            [{"role": "system", "content": system_text}, {"role": "user", "content": probe}],
            generation_prompt=True,
        )
        for probe in _PROBES
    )
    common = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        common += 1
    return first[:common]


def _refuse_special_tokens(backends: _Backends, what: str, value: Any) -> None:
    """Raise TemplateRejected if any string in `value` (JSON-like) holds a special token."""
    if value is None or backends.specials is None:
        return
    found = backends.specials.search(json.dumps(value, ensure_ascii=False))
    if found is not None:
        raise TemplateRejected(
            f"{what} contain the special token {found.group()!r}, which the chat template "
            "would render as its own marker"
        )


def _render_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    extra = {"tools": tools} if tools else {}
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False, **extra
        )
    except TemplateError as error:  # the template's own raise_exception (role order, ...)
        raise TemplateRejected(f"the chat template rejected these messages: {error}") from error
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, not text")
    return text


def _template_pieces(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    generation_prompt: bool,
    rendering: str,
    tools: list[dict[str, Any]] | None,
) -> list[str] | None:
    """T0..Tn when the rendering is exactly template pieces and verbatim contents in turn.

    None when the template moves, repeats, drops or rewrites any content. The placeholders
    carry a fresh random nonce, and the layout is rendered from placeholders alone, so no
    message text can pose as a placeholder.

    An empty content gets no placeholder (templates test it: an assistant turn that only
    calls tools prints no text), so its message's template text joins the next piece and its
    own piece is empty.
    """
    nonce = secrets.token_hex(8)
    marked = [
        {**message, "content": f"[[{nonce}:{index}]]"} if message["content"] else message
        for index, message in enumerate(messages)
    ]
    layout = _render_text(tokenizer, marked, generation_prompt, tools)
    parts = re.split(rf"\[\[{nonce}:(\d+)\]\]", layout)
    split, order = parts[0::2], parts[1::2]
    if order != [str(index) for index, message in enumerate(messages) if message["content"]]:
        return None
    pieces = iter(split)
    template = [next(pieces) if message["content"] else "" for message in messages]
    template.append(next(pieces))
    rebuilt = [template[0]]
    for message, after in zip(messages, template[1:], strict=True):
        rebuilt += (message["content"], after)
    if "".join(rebuilt) != rendering:  # the template transforms content (trim, escape, ...)
        return None
    return template


def _tokenize_whole(
    backends: _Backends, messages: list[dict[str, Any]], rendering: str
) -> tuple[list[int], list[MessageSpan]]:
    """One tokenization of the whole rendering, refused if any content holds a special token."""
    if backends.specials is not None:
        for message in messages:
            found = backends.specials.search(message["content"])
            if found is not None:
                raise TemplateRejected(
                    f"message text contains the special token {found.group()!r}, which this "
                    "model's chat template and tokenizer cannot keep apart from their own markers"
                )
    (token_ids,) = _encode_all(backends.markers, [rendering])
    total = len(token_ids)
    spans = [MessageSpan(messages[0]["role"], 0, total)]
    spans += [MessageSpan(message["role"], total, total) for message in messages[1:]]
    return token_ids, spans


def _encode_all(backend: Tokenizer, pieces: Sequence[str]) -> list[list[int]]:
    """Token ids of each piece: one batched call over the distinct pieces.

    Batched because the batch call releases the GIL (other requests' threads keep running
    while a megabyte is tokenized) and costs one crossing into Rust, not one per message.
    """
    distinct = list(dict.fromkeys(pieces))
    encodings = backend.encode_batch_fast(distinct, add_special_tokens=False)
    ids = {piece: encoding.ids for piece, encoding in zip(distinct, encodings, strict=True)}
    return [ids[piece] for piece in pieces]


def _backends_of(tokenizer: Any) -> _Backends:
    """The tokenizer's two backend copies, made once and cached for its lifetime."""
    with _backends_lock:
        found = _backends.get(tokenizer)
        if found is None:
            found = _copy_backends(tokenizer.backend_tokenizer)
            _backends[tokenizer] = found
        return found


def _copy_backends(source: Tokenizer) -> _Backends:
    serialized = source.to_str()
    markers, text = Tokenizer.from_str(serialized), Tokenizer.from_str(serialized)
    for backend in (markers, text):
        backend.no_truncation()
        backend.no_padding()
    text.encode_special_tokens = True
    specials = sorted(
        (token.content for token in source.get_added_tokens_decoder().values() if token.special),
        key=len,
        reverse=True,  # longest first, so a marker is never reported as its own prefix
    )
    pattern = re.compile("|".join(map(re.escape, specials))) if specials else None
    # A tokenizer that adds something to the start of every call (SentencePiece's "▁")
    # would change tokens when cut into pieces; it gets the whole-rendering path instead.
    pieces = ("Hi", " there", ".\n", "Next line")
    joined = markers.encode("".join(pieces), add_special_tokens=False).ids
    piecewise = joined == [i for ids in _encode_all(markers, pieces) for i in ids]
    return _Backends(markers, text, pattern, piecewise)
