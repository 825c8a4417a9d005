"""The grammar of the JSON that follows a schema, as xgrammar writes it, narrowed where JSON or
the schema needs it.

xgrammar writes a schema's grammar in EBNF; two of its rules let through what the schema
forbids, and are narrowed here:
- a length-bounded string's characters include control characters, which JSON forbids raw;
- the name of an additional property (one the schema does not declare) may hold escapes.
  xgrammar keeps declared names out of additional names by their spelling, so `"\\u0061"`, a
  spelling of the declared `"a"`, would pass as an additional property and escape `a`'s type.
  An additional property's name is therefore written without escapes: every name has one
  spelling, and a declared name can only be the declared property. (A name that needs an
  escape, a quote or a control character, cannot be an additional property's.)
"""

from __future__ import annotations

import re

import xgrammar as xgr

MAX_WHITESPACE = 16  # characters of whitespace in a row: a model cannot stall in it


def json_schema_ebnf(schema_text: str) -> str:
    """The EBNF grammar (root rule `root`) of the JSON that follows `schema_text`.

    Whitespace as models write JSON, but never more than a run of MAX_WHITESPACE; strings hold
    only what JSON allows; additional properties' names hold no escapes. Raises xgrammar's
    RuntimeError for a schema it cannot convert.
    """
    grammar = xgr.Grammar.from_json_schema(
        schema_text, max_whitespace_cnt=MAX_WHITESPACE, strict_mode=True
    )
    return _unescaped_names(_json_strings(str(grammar)))


# xgrammar writes a length-bounded string's characters as this class, which lets control
# characters through (JSON forbids them unescaped; parsers refuse them).
_LOOSE_STRING_CHARACTER = r"[^\"\\\r\n]"
_JSON_STRING_CHARACTER = r"[^\0-\x1f\"\\]"


def _json_strings(ebnf: str) -> str:
    """The grammar with every string character class narrowed to what JSON allows."""
    return ebnf.replace(_LOOSE_STRING_CHARACTER, _JSON_STRING_CHARACTER)


# An additional property's name: the rule `<object>_addl_key` and the rules it is spelled with
# (`<object>_addl_key_<n>`, a trie that leaves the declared names out). Their characters go on
# as a JSON string (`basic_string_sub`), escapes included.
_NAME_RULE = re.compile(r"^(\w+_addl_key(?:_\d+)?) ::= (.*)$", re.M)
_ESCAPE_ALTERNATIVE = re.compile(r'\s*\|\s*\("\\\\" basic_escape basic_string_sub\)')
_NAME_CHARACTERS = "name_string_sub"
_NAME_CHARACTERS_RULE = rf'{_NAME_CHARACTERS} ::= (("\"") | ([^\0-\x1f\"\\] {_NAME_CHARACTERS}))'


def _unescaped_names(ebnf: str) -> str:
    """The grammar with additional properties' names spelled without escapes."""

    def narrowed(rule: re.Match[str]) -> str:
        body = _ESCAPE_ALTERNATIVE.sub("", rule.group(2))
        return f"{rule.group(1)} ::= {body.replace('basic_string_sub', _NAME_CHARACTERS)}"

    rewritten, count = _NAME_RULE.subn(narrowed, ebnf)
    if not count:
        return ebnf
    if any("basic_escape" in body for _, body in _NAME_RULE.findall(rewritten)):
        raise RuntimeError("an additional property's name kept its escapes")  # a new xgrammar
    return f"{rewritten}\n{_NAME_CHARACTERS_RULE}\n"
