"""Typed arguments of calls whose syntax writes every value as text (Qwen3-Coder's
`<parameter=...>`, GLM's `<arg_value>`, MiniMax-M2's `<parameter name=...>`): each value
is read as its property's schema types it, as vLLM's parser engine reads them
(`coerce_to_schema_type`): by the first of null, integer, number, boolean, object, array
and string that the schema allows and the text is; a value no type fits, or one of a
property the tool does not describe, stays a string.
"""
from __future__ import annotations

import json
import math

# The order a value's types are tried in, as vLLM tries them.
_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")


def typed_arguments(arguments: dict, parameters: dict | None) -> dict:
    """`arguments` (text values) with each value read as its property's schema types it."""
    properties = (parameters or {}).get("properties")
    if not isinstance(properties, dict):
        return arguments
    return {key: typed(value, properties[key]) if isinstance(value, str) and isinstance(properties.get(key), dict)
            else value for key, value in arguments.items()}


def typed(value: str, schema: dict) -> object:
    types = schema_types(schema)
    for kind in _ORDER:
        if kind not in types:
            continue
        if kind == "string":
            return value
        read = _read(value, kind)
        if read is not _NO:
            return read
    return value


def schema_types(schema: object) -> set[str]:
    """The JSON types a schema allows, from `type`, `enum` and anyOf/oneOf/allOf; a
    schema that says none allows a string."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    given = schema.get("type")
    types.update([given] if isinstance(given, str) else [t for t in given or () if isinstance(t, str)])
    for value in schema.get("enum") or ():
        types.add(_json_type(value))
    for key in ("anyOf", "oneOf", "allOf"):
        for choice in schema.get(key) or ():
            types |= schema_types(choice)
    return types or {"string"}


_NO = object()


def _read(value: str, kind: str) -> object:
    """`value` as a `kind`, or _NO where it is not one (a number no float holds is not)."""
    text = value.strip()
    if kind == "null":
        return None if text.lower() == "null" else _NO
    if kind == "integer":
        try:
            return int(text)
        except ValueError:
            return _NO
    if kind == "number":
        try:
            number = float(text)
        except ValueError:
            return _NO
        return _NO if not math.isfinite(number) else int(number) if number == int(number) else number
    if kind == "boolean":
        return {"true": True, "1": True, "false": False, "0": False}.get(text.lower(), _NO)
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError):
        return _NO
    wanted = dict if kind == "object" else list
    return parsed if isinstance(parsed, wanted) and _finite(parsed) else _NO


def _finite(value: object) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "string")
