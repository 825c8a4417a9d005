"""The JSON schemas structured outputs accept: what xgrammar enforces, nothing else.

xgrammar ignores JSON-schema keywords it does not implement, reads a schema by one keyword
(`$ref`, `const`, `enum`, `anyOf`, ... ; a string by one of `pattern`, `format` or lengths)
and ignores the rest beside it, and ignores regex constructs it does not implement. A schema
is therefore checked against what xgrammar enforces, and anything else is refused naming the
keyword and where it is, never silently unenforced. Tools' `parameters` are checked the same
way, and bounded in all.

Some schemas xgrammar would refuse itself (a `$ref` that points nowhere, an unknown type,
bounds that cross) are refused here first, so that the refusal can name the keyword and its
path. Others it would accept but not enforce as JSON reads it: JSON keeps the last of two
equal names, so a name written twice would pass the grammar's count of properties twice; and a
name that needs an escape xgrammar cannot keep apart from additional properties' names. Both
are refused where they matter (see `_check_object`).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequest
from engine.structured.regex_checks import MAX_PATTERNS, PatternRefused, check_pattern

MAX_SCHEMA_BYTES = 32 * 1024
MAX_SCHEMA_DEPTH = 32
# Keywords that constrain nothing (`nullable`, OpenAPI's, only widens what xgrammar ignores),
# and the definitions a `$ref` reads. (The keyword tables below stay dense, a few names a line,
# where the formatter would give each name a line of its own.)
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "strict",
    "nullable", "$defs", "definitions",
})  # fmt: skip
# Keywords xgrammar enforces (in the combinations `_check_combination` allows), and annotations.
SUPPORTED_KEYWORDS = ANNOTATIONS | frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems",
    "minItems", "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "minLength",
    "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "patternProperties", "minProperties", "maxProperties",
})  # fmt: skip
# xgrammar reads a schema that holds one of these by the first it holds, and ignores every
# other keyword beside it.
_WHOLE_SCHEMA = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
# Without one of these xgrammar allows any value, and ignores every constraint beside.
_SHAPES = ("type", "properties", "additionalProperties", "items", "prefixItems")
# Keywords whose value is a map of names to schemas, or a schema / list of schemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties")
JSON_TYPES = frozenset({"null", "boolean", "object", "array", "number", "integer", "string"})
# Keywords whose value must be a count: a whole number xgrammar can hold (a C++ int).
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
MAX_COUNT = 2**31 - 1
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# Lower and upper bounds that xgrammar refuses when they cross.
_BOUNDS = (("minimum", "maximum"), ("minLength", "maxLength"), ("minItems", "maxItems"),
           ("minProperties", "maxProperties"))  # fmt: skip


def unsupported(message: str) -> InvalidRequest:
    return InvalidRequest(f"response_format: {message}", param="response_format")


def tools_refused(message: str) -> InvalidRequest:
    """The error for a tool (its `parameters` schema, or the grammar of its calls)."""
    return InvalidRequest(f"tools: {message}", param="tools")


def check_tool_parameters(parameters: Any, function: str) -> None:
    """Refuse a tool's `parameters` schema as `check_schema` refuses a response format's (and
    one over MAX_SCHEMA_BYTES), as an `InvalidRequest` on `tools` naming the function."""
    if len(json.dumps(parameters).encode()) > MAX_SCHEMA_BYTES:
        raise tools_refused(f"function {function!r}: parameters are over {MAX_SCHEMA_BYTES} bytes")
    try:
        check_schema(parameters)
    except InvalidRequest as error:
        reason = str(error).removeprefix("response_format: ")
        raise tools_refused(f"function {function!r}: {reason}") from None


def check_tool_set(schemas: list[Any]) -> None:
    """Bound a grammar over several tools' parameters as one schema is bounded: at most
    MAX_SCHEMA_BYTES and MAX_PATTERNS in all, so many tools cost no more than one schema."""
    size = sum(len(json.dumps(schema).encode()) for schema in schemas)
    if size > MAX_SCHEMA_BYTES:
        raise tools_refused(f"the functions' parameters are over {MAX_SCHEMA_BYTES} bytes in all")
    patterns = sum(len(list(_patterns(schema))) for schema in schemas)
    if patterns > MAX_PATTERNS:
        raise tools_refused(f"the functions' parameters have over {MAX_PATTERNS} patterns in all")


def check_schema(schema: Any, where: str = "#", depth: int = 0) -> None:
    """Raise `InvalidRequest` naming the first keyword, combination of keywords or regex
    construct xgrammar would not enforce, or the first pattern too expensive to compile."""
    patterns = list(_patterns(schema))
    if len(patterns) > MAX_PATTERNS:
        raise unsupported(f"the schema has over {MAX_PATTERNS} patterns")
    for pattern, at in patterns:
        try:
            check_pattern(pattern, at)
        except PatternRefused as refused:
            raise unsupported(str(refused)) from None
    _check_keywords(schema, schema, where, depth)


def subschemas(schema: Any, where: str = "#", depth: int = 0) -> Iterator[tuple[Any, str]]:
    """`schema` and every schema in it, each with its path, parents first."""
    yield schema, where
    if not isinstance(schema, dict) or depth > MAX_SCHEMA_DEPTH:
        return
    for keyword, value in schema.items():
        for child, at in _children(keyword, value, where):
            yield from subschemas(child, at, depth + 1)


def _patterns(schema: Any, where: str = "#", depth: int = 0) -> Iterator[tuple[Any, str]]:
    """Every regex in the schema: `pattern` values and `patternProperties` names."""
    if not isinstance(schema, dict) or depth > MAX_SCHEMA_DEPTH:
        return
    for keyword, value in schema.items():
        if keyword == "pattern":
            yield value, where
        if keyword == "patternProperties" and isinstance(value, dict):
            yield from ((name, f"{where}/patternProperties") for name in value)
        for child, at in _children(keyword, value, where):
            yield from _patterns(child, at, depth + 1)


def _children(keyword: str, value: Any, where: str) -> Iterator[tuple[Any, str]]:
    if keyword in _SCHEMA_MAPS and isinstance(value, dict):
        yield from ((child, f"{where}/{keyword}/{name}") for name, child in value.items())
    elif keyword in _SCHEMA_LISTS and isinstance(value, list):
        yield from ((child, f"{where}/{keyword}/{index}") for index, child in enumerate(value))
    elif keyword in _SCHEMAS and isinstance(value, dict | bool):
        yield value, f"{where}/{keyword}"


def _check_keywords(schema: Any, root: Any, where: str, depth: int) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise unsupported(f"the schema at {where} is not an object")
    if depth > MAX_SCHEMA_DEPTH:
        raise unsupported(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    for keyword, value in schema.items():
        if keyword not in SUPPORTED_KEYWORDS:
            raise unsupported(f"JSON schema keyword {keyword!r} (at {where}) is not supported")
        # A reference may only name a definition, which is checked like the rest; never an
        # annotation such as `examples`, which is not.
        if keyword == "$ref" and not (
            isinstance(value, str) and value.startswith(("#/$defs/", "#/definitions/"))
        ):
            raise unsupported(f"$ref (at {where}) must point into #/$defs or #/definitions")
        if keyword == "$ref" and not _resolves(root, value):
            raise unsupported(f"$ref (at {where}) points to no definition: {value!r}")
        _check_value(keyword, value, where)
    _check_combination(schema, where)
    for keyword, value in schema.items():
        for child, at in _children(keyword, value, where):
            _check_keywords(child, root, at, depth + 1)


def _check_value(keyword: str, value: Any, where: str) -> None:
    """Refuse a keyword whose value has the wrong type or range, naming it: xgrammar's own
    refusal would not say which keyword (nor where)."""
    expected = _expected(keyword, value)
    if expected is not None:
        raise unsupported(f"{keyword!r} (at {where}) is not {expected}")


def _expected(keyword: str, value: Any) -> str | None:
    """What `value` should be for `keyword`, when it is not; None when it is (or any value
    goes)."""
    if keyword in _SCHEMA_MAPS:
        return None if isinstance(value, dict) else "an object"
    if keyword in _SCHEMAS:
        return None if isinstance(value, dict | bool) else "a schema (an object or a boolean)"
    if keyword in _SCHEMA_LISTS or keyword == "enum":
        return None if isinstance(value, list) else "an array"
    if keyword == "required":
        strings = isinstance(value, list) and all(isinstance(name, str) for name in value)
        return None if strings else "an array of strings"
    if keyword in ("type", "format", "pattern"):
        return None if keyword == "type" or isinstance(value, str) else "a string"
    if keyword in _COUNTS:
        count = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT
        return None if count else f"a whole number from 0 to {MAX_COUNT}"
    if keyword in _NUMBERS:
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return None if number and math.isfinite(value) else "a finite number"
    return None


def _resolves(root: Any, reference: str) -> bool:
    """Whether the JSON pointer `reference` ("#/$defs/...") names a schema in `root`."""
    target = root
    for step in reference.removeprefix("#/").split("/"):
        name = step.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or name not in target:
            return False
        target = target[name]
    return isinstance(target, dict | bool)


def _check_combination(schema: dict[str, Any], where: str) -> None:
    """Refuse a keyword xgrammar would ignore beside the one it reads the schema by, or enforce
    otherwise than JSON schema says."""
    whole = next((keyword for keyword in _WHOLE_SCHEMA if keyword in schema), None)
    if whole is not None:
        # A `type` every value of a `const` or `enum` has is already enforced by them.
        typed = whole in ("const", "enum") and _values_have_type(schema)
        allowed = ANNOTATIONS | {whole} | ({"type"} if typed else set())
        ignored = [keyword for keyword in schema if keyword not in allowed]
        if ignored:
            raise unsupported(f"{ignored[0]!r} beside {whole!r} (at {where}) is not enforced")
        _check_schema_list(whole, schema[whole], where)
        return
    if isinstance(schema.get("type"), list) and not schema["type"]:
        raise unsupported(f"'type' (at {where}) lists no types")
    if "type" in schema:
        declared = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        unknown = [name for name in declared if not (isinstance(name, str) and name in JSON_TYPES)]
        if unknown:
            raise unsupported(f"'type' (at {where}) names no JSON type: {unknown[0]!r}")
    for lower, upper in _BOUNDS:
        low, high = schema.get(lower), schema.get(upper)
        if isinstance(low, int | float) and isinstance(high, int | float) and low > high:
            raise unsupported(f"{lower!r} (at {where}) is greater than {upper!r}")
    if schema.get("type") == "integer":  # xgrammar bounds an integer by whole numbers only
        fraction = next((k for k in _NUMBERS if _fractional(schema.get(k))), None)
        if fraction is not None:
            raise unsupported(f"{fraction!r} (at {where}) of an integer is not a whole number")
    if not any(shape in schema for shape in _SHAPES):
        for keyword in schema:
            if keyword not in ANNOTATIONS:
                raise unsupported(f"{keyword!r} (at {where}) is not enforced without a 'type'")
    # A string is read by one of its pattern, its format or its lengths; the others are ignored.
    rules = [rule for rule in ("pattern", "format", "minLength", "maxLength") if rule in schema]
    if len(rules) > 1 and rules[:2] != ["minLength", "maxLength"]:
        message = f"{rules[0]!r} and {rules[1]!r} together (at {where}) are not enforced"
        raise unsupported(f"{message}: the grammar keeps only one")
    _check_object(schema, where)


def _check_schema_list(keyword: str, schemas: Any, where: str) -> None:
    """Refuse an empty `anyOf`/`oneOf`/`allOf`, an `allOf` of several schemas (xgrammar allows
    anything for one), and a `oneOf` whose schemas may overlap (xgrammar reads it as `anyOf`)."""
    if keyword not in _SCHEMA_LISTS or not isinstance(schemas, list):
        return
    if not schemas:
        raise unsupported(f"{keyword!r} (at {where}) holds no schemas")
    if keyword == "allOf" and len(schemas) > 1:
        raise unsupported(f"'allOf' (at {where}) of more than one schema is not enforced")
    if keyword == "oneOf" and not _disjoint(schemas):
        message = f"'oneOf' (at {where}) is only enforced when its schemas differ in type or value"
        raise unsupported(f"{message}; use 'anyOf'")


def _check_object(schema: dict[str, Any], where: str) -> None:
    """Refuse a `required` property that is not in `properties` (xgrammar leaves it out),
    `patternProperties` beside `properties` (a property both name would follow only one), and
    what names written twice or spelled with escapes would get past."""
    properties = schema.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = schema.get("required")
    for name in required if isinstance(required, list) else []:
        if not isinstance(name, str) or name not in properties:
            raise unsupported(f"required property {name!r} (at {where}) is not in 'properties'")
        if properties[name] is False:
            message = f"required property {name!r} (at {where}) has the schema false"
            raise unsupported(f"{message}: no value can follow it")
    # Telling whether a regex matches a property's name would run the client's regex here.
    if properties and "patternProperties" in schema:
        raise unsupported(f"'patternProperties' beside 'properties' (at {where}) is not enforced")
    # Names the schema does not declare: additional properties, or those of patternProperties.
    additional = schema.get("additionalProperties", False)
    undeclared = "patternProperties" in schema or additional is not False
    minimum = schema.get("minProperties")
    if isinstance(minimum, int) and minimum > len(properties) and not undeclared:
        raise unsupported(f"'minProperties' (at {where}) is more than the properties it allows")
    # Declared names are distinct, and only required ones always there; undeclared names may
    # repeat, and JSON keeps one of each, so the grammar's count of them proves nothing.
    if isinstance(minimum, int) and undeclared and minimum > len(required or []):
        message = f"'minProperties' (at {where}) beyond the required properties is not enforced"
        raise unsupported(f"{message}: a property's name may be written twice")
    # xgrammar keeps declared names out of additional ones character by character, which
    # holds only for printable ASCII that JSON writes as it is.
    unplain = next((name for name in properties if json.dumps(name)[1:-1] != name), None)
    if undeclared and unplain is not None:
        message = f"property {unplain!r} (at {where}) is not plain printable ASCII"
        raise unsupported(f"{message}: the grammar cannot keep it apart from additional ones")


def _fractional(value: Any) -> bool:
    """Whether `value` is a number with a fractional part."""
    return isinstance(value, float) and not value.is_integer()


def _json_types(value: Any) -> frozenset[str]:
    """The JSON-schema types `value` has: a whole number is both an integer and a number."""
    if value is None:
        return frozenset({"null"})
    if isinstance(value, bool):
        return frozenset({"boolean"})
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return frozenset({"integer", "number"})
    if isinstance(value, float):
        return frozenset({"number"})
    if isinstance(value, str):
        return frozenset({"string"})
    return frozenset({"array"}) if isinstance(value, list) else frozenset({"object"})


def _declared_types(schema: dict[str, Any]) -> frozenset[str]:
    """The types a schema's `type` allows (a number may be an integer); none without one."""
    declared = schema.get("type")
    names = declared if isinstance(declared, list) else [declared]
    types = frozenset(name for name in names if isinstance(name, str))
    return types | {"integer"} if "number" in types else types


def _values(schema: dict[str, Any]) -> Any:
    """The values a schema's `const` or `enum` allows (a list, unless the `enum` is malformed)."""
    return [schema["const"]] if "const" in schema else schema.get("enum")


def _values_have_type(schema: dict[str, Any]) -> bool:
    """Whether every value of the schema's `const` or `enum` has a type its `type` allows."""
    values, declared = _values(schema), _declared_types(schema)
    return isinstance(values, list) and all(_json_types(value) & declared for value in values)


@dataclass(frozen=True, slots=True)
class _Footprint:
    """What a schema allows: every value of `types`, and the `values` (JSON texts) whose types
    are `value_types`."""

    types: frozenset[str] = frozenset()
    values: frozenset[str] = frozenset()
    value_types: frozenset[str] = frozenset()

    def overlaps(self, other: _Footprint) -> bool:
        return bool(
            self.types & other.types
            or self.values & other.values
            or self.value_types & other.types
            or other.value_types & self.types
        )


def _footprint(schema: Any) -> _Footprint | None:
    """What `schema` allows, by its `const`/`enum` scalars or its `type`; None where neither
    says it."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema or "enum" in schema:
        values = _values(schema)
        if not isinstance(values, list) or not all(
            value is None or isinstance(value, str | int | float) for value in values
        ):
            return None
        # JSON schema compares numbers by value: 1 and 1.0 are one value.
        whole = [int(v) if isinstance(v, float) and v.is_integer() else v for v in values]
        types = frozenset().union(*(_json_types(value) for value in values))
        return _Footprint(values=frozenset(map(json.dumps, whole)), value_types=types)
    types = _declared_types(schema)
    return _Footprint(types=types) if types else None


def _disjoint(schemas: list[Any]) -> bool:
    """Whether no value can follow two of `schemas`, told by their types or values."""
    footprints = [_footprint(schema) for schema in schemas]
    known = [footprint for footprint in footprints if footprint is not None]
    if len(known) < len(footprints):
        return False
    return not any(one.overlaps(other) for one, other in itertools.combinations(known, 2))
