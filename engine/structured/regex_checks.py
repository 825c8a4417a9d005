"""The regexes a JSON schema's `pattern` may hold for structured outputs.

xgrammar ignores regex constructs it does not implement, compiles some patterns at a cost that
grows fast with their counted repetitions, and writes a pattern it cannot keep inside a JSON
string with its quotes, backslashes and control characters raw. `check_pattern` refuses all
three, naming the construct.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr


class PatternRefused(ValueError):
    """A pattern structured outputs cannot enforce; the message says which part and why."""


# A regex's counted repetitions are what make its grammar expensive to compile: two in a row
# (`.{1,32}.{1,32}`) or nested (`([a-z]{1,20}){1,20}`) measured many times as slow as one
# (`[a-z]{1,32}`, `.{1,64}`). A schema holds at most a few patterns (`pattern` values and
# `patternProperties` names), each with one short counted repetition, never nested.
MAX_PATTERNS = 4
MAX_PATTERN_CHARS = 256
MAX_COUNTED_REPETITIONS = 1
MAX_REPETITION_BOUND = 32
# Counted repetitions as xgrammar reads them, spaces included; an escaped brace counts too
# (refusing a literal `\{1,3\}` is cheaper than telling it from `\\{1,3}`).
_COUNTED = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


def check_pattern(pattern: Any, where: str) -> None:
    """Refuse a `pattern` that uses a construct xgrammar would not enforce, whose grammar would
    be expensive to compile, or that xgrammar cannot keep inside a JSON string."""
    if not isinstance(pattern, str):
        raise PatternRefused(f"the pattern at {where} is not a string")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternRefused(f"the pattern at {where} is over {MAX_PATTERN_CHARS} characters")
    _check_constructs(pattern, where)
    _check_cost(pattern, where)
    _check_json_string(pattern, where)


def _check_cost(pattern: str, where: str) -> None:
    """Refuse a pattern whose grammar would be expensive to compile."""
    counted = list(_COUNTED.finditer(pattern))
    if len(counted) > MAX_COUNTED_REPETITIONS:
        message = f"the pattern at {where} has over {MAX_COUNTED_REPETITIONS} counted repetitions"
        raise PatternRefused(message)
    for match in counted:
        bounds = [int(bound) for bound in match.groups() if bound]
        if any(bound > MAX_REPETITION_BOUND for bound in bounds):
            message = f"the pattern at {where} repeats more than {MAX_REPETITION_BOUND} times"
            raise PatternRefused(message)
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
                raise PatternRefused(message)
            if holds_counted:
                holds_counted[-1] = holds_counted[-1] or inner
        elif index in counted_at and holds_counted:
            holds_counted[-1] = True


# How xgrammar reads a regex (`cpp/fsm_builder.cc`): it ignores lookaheads and an anchor inside
# the pattern, matches an unknown escape such as `\Z` literally, and reads a possessive `a?+`
# as `(a?)+`; lookbehinds, backreferences, word boundaries and Unicode properties it refuses.
# Each is refused here by name. A control character is refused too: xgrammar keeps the ones a
# regex matches out of a JSON string only when it can drop them (see `_check_json_string`).
_ESCAPE = re.compile(
    r"\\(?:x[0-9A-Fa-f]{2}|u\{[0-9A-Fa-f]{1,6}\}|u[0-9A-Fa-f]{4}|c[A-Za-z]|.)?", re.S
)
_GROUP_OPENING = re.compile(r"\(\?(?:P?<\w+>|<[=!]|.)?", re.S)
_NAMED_GROUP = re.compile(r"\(\?P?<\w+>")
_GROUP_MODIFIERS = {
    "(?=": "a lookahead",
    "(?!": "a lookahead",
    "(?<=": "a lookbehind",
    "(?<!": "a lookbehind",
}
_CONTROL_ESCAPES = {
    "n": 0x0A,
    "r": 0x0D,
    "t": 0x09,
    "f": 0x0C,
    "v": 0x0B,
    "0": 0x00,
    "a": 0x07,
    "e": 0x1B,
}
_CLASS_ESCAPES = frozenset("dDwWsS")
_NOT_ENFORCED = "which the grammar would not enforce"
_NO_CONTROL = "which a JSON string cannot hold unescaped"
_QUANTIFIERS = ("*", "+", "?")


@dataclass(frozen=True, slots=True)
class _RegexToken:
    """One character of a regex, or a whole escape, group opening or counted repetition."""

    text: str
    class_negated: bool | None  # inside a character class: whether it is negated
    depth: int  # groups open around it

    def at_top(self, text: str) -> bool:
        """Whether this is `text`, outside every class and group."""
        return self.text == text and self.class_negated is None and self.depth == 0

    def is_quantifier(self) -> bool:
        """Whether this repeats what comes before it (`*`, `+`, `?` or a counted repetition)."""
        counted = self.text.startswith("{") and len(self.text) > 1
        return self.class_negated is None and (self.text in _QUANTIFIERS or counted)


def _regex_tokens(pattern: str) -> list[_RegexToken]:
    """The regex's tokens, each with where it stands: in which class, under how many groups."""
    tokens: list[_RegexToken] = []
    class_negated: bool | None = None
    depth = index = 0
    while index < len(pattern):
        match = (
            _ESCAPE.match(pattern, index)
            or (_GROUP_OPENING.match(pattern, index) if class_negated is None else None)
            or (_COUNTED.match(pattern, index) if class_negated is None else None)
        )
        text = match.group() if match else pattern[index]
        tokens.append(_RegexToken(text, class_negated, depth))
        if class_negated is not None:
            class_negated = None if text == "]" else class_negated
        elif text == "[":
            class_negated = pattern.startswith("^", index + 1)
        elif text.startswith("("):
            depth += 1
        elif text == ")":
            depth = max(depth - 1, 0)
        index += len(text)
    return tokens


def _check_constructs(pattern: str, where: str) -> None:
    """Refuse a regex construct xgrammar would ignore or read otherwise, naming it."""
    tokens = _regex_tokens(pattern)
    found = [_construct(token) for token in tokens]
    found += [_anchor_construct(tokens), _quantifier_construct(tokens)]
    construct = next((construct for construct in found if construct), None)
    if construct:
        raise PatternRefused(f"the pattern at {where} has {construct}")


def _anchor_construct(tokens: list[_RegexToken]) -> str | None:
    """An anchor that xgrammar ignores: one not at either end of the pattern or of a top-level
    alternative (xgrammar always matches a whole string)."""
    for index, token in enumerate(tokens):
        if token.class_negated is not None:
            continue
        if token.text == "^" and index > 0 and not tokens[index - 1].at_top("|"):
            return f"an anchor '^' inside it, {_NOT_ENFORCED}"
        if token.text == "$" and index + 1 < len(tokens) and not tokens[index + 1].at_top("|"):
            return f"an anchor '$' inside it, {_NOT_ENFORCED}"
    return None


def _quantifier_construct(tokens: list[_RegexToken]) -> str | None:
    """A quantifier on a quantifier: possessive (`a*+`) or repeated (`a**`). A lazy one (`a*?`)
    matches the same strings, and is read as it is."""
    before: str | None = None  # the quantifier just before; "" once it is made lazy
    for token in tokens:
        if not token.is_quantifier():
            before = None
        elif before is None:
            before = token.text
        elif before and token.text == "?":
            before = ""
        else:
            return f"a quantifier {token.text!r} on a quantifier, {_NOT_ENFORCED}"
    return None


def _construct(token: _RegexToken) -> str | None:
    """What `token` does that xgrammar does not enforce, in words; None if nothing."""
    text = token.text
    if len(text) == 1 and ord(text) < 0x20:
        return f"the raw control character {text!r}, {_NO_CONTROL}"
    if text.startswith("\\") and len(text) > 1:
        return _escape_construct(text, token.class_negated)
    if (
        token.class_negated is None
        and text.startswith("(?")
        and not (text == "(?:" or _NAMED_GROUP.fullmatch(text))
    ):
        return f"{_GROUP_MODIFIERS.get(text, 'the group modifier')} {text!r}, {_NOT_ENFORCED}"
    return None


def _escape_construct(escape: str, class_negated: bool | None) -> str | None:
    """What a regex escape does that xgrammar does not enforce, in words; None if nothing."""
    name = escape[1]
    if name in "123456789k":
        return f"a backreference {escape}, {_NOT_ENFORCED}"
    if name == "B" or (name == "b" and class_negated is None):
        return f"a word boundary {escape}, {_NOT_ENFORCED}"
    if name in "pP":
        return f"a Unicode property {escape}, {_NOT_ENFORCED}"
    code = _escaped_code(escape)
    if code is not None:
        # In a negated class a control character is one more that the class leaves out.
        if code < 0x20 and not class_negated:
            return f"the control character {escape}, {_NO_CONTROL}"
        return None
    if name in _CLASS_ESCAPES or not (name.isascii() and name.isalnum()):
        return None
    return f"the unknown escape {escape}, {_NOT_ENFORCED}"


def _escaped_code(escape: str) -> int | None:
    """The character code an escape stands for, when it names one by a letter or digits."""
    name, digits = escape[1], escape[2:].strip("{}")
    if name in _CONTROL_ESCAPES:
        return _CONTROL_ESCAPES[name]
    if name == "b":  # inside a character class: a backspace
        return 0x08
    if name == "c" and digits:
        return ord(digits) & 0x1F
    return int(digits, 16) if name in "xu" and digits else None


def _check_json_string(pattern: str, where: str) -> None:
    """Refuse a pattern xgrammar would write into a JSON string unescaped.

    xgrammar compiles a pattern of printable ASCII into one automaton that leaves out of every
    character it matches what a JSON string must escape (quote, backslash, control characters).
    A pattern it cannot compile so (one that needs such a character, holds a character beyond
    printable ASCII, or a construct that automaton lacks) it expands into rules that write
    those characters raw.
    """
    schema = json.dumps({"type": "string", "pattern": pattern})
    try:
        rules = str(xgr.Grammar.from_json_schema(schema)).splitlines()
    except RuntimeError:  # xgrammar's words stay here: the pattern and its place say it
        message = f"the pattern at {where} cannot be compiled"
        raise PatternRefused(f"{message}: a construct xgrammar's regex engine lacks") from None
    if not any(_JSON_STRING_REGEX.fullmatch(rule) for rule in rules):
        message = f"the pattern at {where} cannot be kept inside a JSON string"
        raise PatternRefused(
            f"{message}: it needs a quote, backslash or control character, holds non-ASCII "
            "text (write it as \\uXXXX), or a construct xgrammar's regex engine lacks"
        )


# The rule xgrammar writes for a pattern it compiles as one automaton within a JSON string.
_JSON_STRING_REGEX = re.compile(r'root_1 ::= Regex\(".*", json_string=true\)')
