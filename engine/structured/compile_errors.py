"""Why xgrammar could not compile a schema, in the client's terms: the keyword and where.

xgrammar's own text never reaches a client: it names its source files and internals, and it
is not ours to promise. What it refuses that `schema_checks.py` can tell beforehand (an
unresolved `$ref`, an unknown type, bounds that cross) is refused there, naming the keyword and
its path; what is left is read here by the keyword xgrammar's text names, and placed at the
first subschema that holds that keyword, or refused as a whole.
"""

from __future__ import annotations

import re
from typing import Any

from engine.structured.schema_checks import subschemas

# Keywords xgrammar's refusals name, longest first (`minimum` is part of `exclusiveMinimum`).
_NAMED_KEYWORDS = (
    "additionalProperties", "patternProperties", "exclusiveMinimum", "exclusiveMaximum",
    "minProperties", "maxProperties", "prefixItems", "minLength", "maxLength", "minItems",
    "maxItems", "minimum", "maximum", "pattern", "$ref", "enum", "const", "anyOf", "oneOf",
    "allOf", "format", "required",
)  # fmt: skip
# xgrammar's words for a keyword's subject, where it does not name the keyword.
_SUBJECTS = (("regex", "pattern"), ("Regex", "pattern"), ("Unsupported type", "type"))


def schema_refusal(schema: Any, detail: str) -> str:
    """Why `schema` cannot be compiled, given xgrammar's `detail`, without its words."""
    keyword = _keyword(detail)
    for subschema, path in subschemas(schema):
        held = _held(subschema, keyword)
        if held is not None:
            return f"the schema cannot be compiled: {held!r} (at {path}) is not one it can hold"
    return "the schema cannot be compiled at #"


def _keyword(detail: str) -> str | None:
    """The keyword xgrammar's text names first (the longest where two start together)."""
    found = [
        (match.start(), -len(keyword), keyword)
        for keyword in _NAMED_KEYWORDS
        if (match := re.search(rf"(?<![\w$]){re.escape(keyword)}(?!\w)", detail))
    ]
    if found:
        return min(found)[2]
    return next((keyword for words, keyword in _SUBJECTS if words in detail), None)


def _held(schema: Any, keyword: str | None) -> str | None:
    """`keyword` if `schema` holds it (or, for a bound, its exclusive form), else None."""
    if keyword is None or not isinstance(schema, dict):
        return None
    exclusive = f"exclusive{keyword[0].upper()}{keyword[1:]}"
    return next((held for held in (keyword, exclusive) if held in schema), None)
