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
# xgrammar's words for a keyword's subject, where it does not name the keyword (or names one
# the schema does not hold: "Integer exceeds maximum limit" for a `minimum`).
_BOUNDS = ("minimum", "maximum")  # and their exclusive forms, by `_held`
_SUBJECTS = (
    ("regex", ("pattern",)), ("Regex", ("pattern",)), ("Unsupported type", ("type",)),
    ("Integer", _BOUNDS), ("integer", _BOUNDS), ("Invalid range", _BOUNDS),
)  # fmt: skip


def schema_refusal(schema: Any, detail: str) -> str:
    """Why `schema` cannot be compiled, given xgrammar's `detail`, without its words."""
    for keyword in _keywords(detail):
        for subschema, path in subschemas(schema):
            held = _held(subschema, keyword)
            if held is not None:
                return f"the schema cannot be compiled: {held!r} (at {path}) is not one it can hold"
    return "the schema cannot be compiled at #"


def _keywords(detail: str) -> list[str]:
    """The keywords xgrammar's text names, first named first (the longest where two start
    together), then those of the subjects it names."""
    found = [
        (match.start(), -len(keyword), keyword)
        for keyword in _NAMED_KEYWORDS
        if (match := re.search(rf"(?<![\w$]){re.escape(keyword)}(?!\w)", detail))
    ]
    named = [keyword for _, _, keyword in sorted(found)]
    subjects = [keyword for words, keywords in _SUBJECTS if words in detail for keyword in keywords]
    return list(dict.fromkeys(named + subjects))


def _held(schema: Any, keyword: str) -> str | None:
    """`keyword` if `schema` holds it (or, for a bound, its exclusive form), else None."""
    if not isinstance(schema, dict):
        return None
    exclusive = f"exclusive{keyword[0].upper()}{keyword[1:]}"
    return next((held for held in (keyword, exclusive) if held in schema), None)
