"""A client's JSON schema before and after generation: one that is no schema, or that no
value can meet, is refused before it is compiled; a constrained output that ended on
its own is checked against its schema afterwards.

The grammar engine (structured.py) enforces most keywords but not all (`not`,
`uniqueItems`, an `allOf` of several branches), and it compiles some contradictions
into a grammar that lets anything through. Refusing what cannot be met, and checking
what came out, keeps an answer that breaks its schema from passing as one that holds.

The satisfiability check finds contradictions a schema states outright: `false` or
`not: {}`, types no value has, const and enum values that exclude one another or the
rest of the schema, bounds that cross, required properties that `additionalProperties:
false` forbids, `anyOf` branches that all fail. It never guesses: what it cannot decide
(a `pattern`, `multipleOf`, recursion past its depth) counts as satisfiable.

Validation is jsonschema-rs: its regular expressions run in linear time or under a
backtracking limit, so a client's `pattern` cannot stall the process (Python's `re`
can be made to), and it fetches no remote `$ref`.
"""
from __future__ import annotations

import json
import math
import time
from urllib.parse import quote

import jsonschema_rs

JSON_OBJECT = json.dumps({"type": "object"})        # response_format {"type": "json_object"}
# A schema is text from a client: bound what compiling it may cost. xgrammar unrolls
# length bounds (a maxLength of a million takes seconds to compile); no output of a
# model's context reaches bounds this large anyway.
MAX_SCHEMA_CHARS = 64 * 1024
MAX_BOUND = 100_000
_BOUNDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")

_OPTIONS = dict(offline=True, validate_formats=False,
                pattern_options=jsonschema_rs.FancyRegexOptions(backtrack_limit=1_000_000))
_ROOT = "urn:pdserve:schema"               # the schema's name in the registry of its own subschemas
# Bounds on the work one schema may cause (a schema is text from a client): nesting
# followed, conjuncts merged per subschema, subschemas whose const/enum are validated.
MAX_DEPTH = 64
MAX_CONJUNCTS = 64
MAX_PINNED_CHECKS = 256
# ... and the time those validations may take, all told: each builds a validator of what
# its subschema's references reach (0.4 s each for a large anyOf of patterns, 44 s for a
# schema of 256 such checks, on the router's tokenizer threads). Past it, what is not yet
# decided counts as satisfiable, and the output guard checks the answer.
PINNED_SECONDS = 0.5
MAX_MESSAGE = 300

# Keywords that constrain nothing: `not` of a schema made only of these excludes every value.
_ANNOTATIONS = frozenset({"title", "description", "$comment", "default", "examples", "deprecated", "readOnly",
                          "writeOnly", "$id", "$schema", "$anchor", "$defs", "definitions", "$vocabulary"})
_KINDS = {"null": {"null"}, "boolean": {"boolean"}, "object": {"object"}, "array": {"array"},
          "string": {"string"}, "integer": {"integer"}, "number": {"integer", "fraction"}}
_ALL_KINDS = frozenset().union(*_KINDS.values())
_OLD_DRAFTS = ("draft-03", "draft-04", "draft-06", "draft-07")     # where `$ref` hides its siblings


def parse(schema: str) -> dict | bool:
    """`schema` (JSON text from a client) parsed, or ValueError saying why it cannot be
    used: too long, not JSON, not a schema, bounds past MAX_BOUND, or `check`'s reasons.
    What the router checks before any worker compiles the schema (structured.py)."""
    if len(schema) > MAX_SCHEMA_CHARS:
        raise ValueError(f"the JSON schema is longer than {MAX_SCHEMA_CHARS} characters")
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError("the JSON schema nests objects or arrays too deeply") from None
    if not isinstance(parsed, (dict, bool)):
        raise ValueError("a JSON schema must be an object or a boolean")
    _check_bounds(parsed)
    check(parsed)
    return parsed


# Keys whose values are data, not schemas: a bound's name in them bounds nothing.
_DATA_KEYS = frozenset({"const", "enum", "default", "examples"})


def _check_bounds(node) -> None:
    """ValueError for a length or count bound past MAX_BOUND anywhere in the schema
    (not in its data: `{"enum": [{"maxItems": 1000000}]}` has none)."""
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in _BOUNDS:
                value = node.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_BOUND:
                    raise ValueError(f"the JSON schema's {key} of {value} is above the {MAX_BOUND} supported")
            stack.extend(v for k, v in node.items() if k not in _DATA_KEYS)
        elif isinstance(node, list):
            stack.extend(node)


def check(schema: dict | bool) -> None:
    """ValueError saying why `schema` (parsed JSON) cannot be used: it is no valid JSON
    schema, a `$ref` does not resolve, or no value can meet it."""
    try:
        jsonschema_rs.validator_for(schema, **_OPTIONS)
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError) as exc:
        raise ValueError(f"the JSON schema is not valid: {_first_line(exc)}") from None
    reason = _Satisfiability(schema).unmet(schema, "", 0)
    if reason:
        raise ValueError(f"no output can match the JSON schema: {reason[:MAX_MESSAGE]}")


# Keys whose values are schemas, or maps or lists of schemas (values of `const`, `enum`,
# `default` and `examples` are data, and never rewritten).
_SUBSCHEMA_KEYS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                   "additionalItems", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def for_the_grammar(schema):
    """`schema` (parsed) as xgrammar compiles what it means: xgrammar closes objects
    that say nothing of additional properties (its strict mode) and leaves out `required`
    names missing from `properties`, so `{"required": ["x"]}` could only give `{}`, which
    breaks it; and refuses an array's minItems or an object's minProperties that only
    its unnamed items or properties can meet. Such names, items and properties are
    stated (each as `additionalProperties` says, else any value). The rest is as given."""
    if isinstance(schema, list):
        return [for_the_grammar(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_KEYS:
        if key in out:
            out[key] = for_the_grammar(out[key])
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: for_the_grammar(s) for name, s in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = for_the_grammar(out[key])
    out = _merged_all_of(out)
    required = out.get("required")
    extra = out.get("additionalProperties")
    if isinstance(required, list) and ("properties" in out or "object" in _kinds(out.get("type"))) \
            and extra is not False:
        properties = dict(out.get("properties") or {})
        for name in required:
            if isinstance(name, str) and name not in properties:
                properties[name] = extra if isinstance(extra, dict) else {}
        out["properties"] = properties
    if "items" not in out and "prefixItems" not in out and isinstance(out.get("minItems"), int) and out["minItems"] > 0:
        out["items"] = {}
    if isinstance(out.get("minProperties"), int) and out["minProperties"] > len(out.get("properties") or {}) \
            and "additionalProperties" not in out:
        out["additionalProperties"] = True
    return out


def _merged_all_of(schema: dict) -> dict:
    """`schema` with its `allOf` branches merged into it where they do not conflict:
    xgrammar takes an allOf of two or more branches for any JSON value, so
    `{"allOf": [{"type": "integer"}, {"minimum": 5}]}` let "zz" through. Properties are
    merged by name, `required` names joined; a key two branches give different values
    (other than those) leaves the allOf as it was, for the output guard."""
    branches = schema.get("allOf")
    if not isinstance(branches, list) or not all(isinstance(b, dict) for b in branches):
        return schema
    merged = {k: v for k, v in schema.items() if k != "allOf"}
    for branch in branches:
        for key, value in branch.items():
            if key == "properties" and isinstance(value, dict):
                properties = dict(merged.get("properties") or {})
                for name, sub in value.items():
                    if properties.get(name, sub) != sub:
                        return schema
                    properties[name] = sub
                merged["properties"] = properties
            elif key == "required" and isinstance(value, list):
                merged["required"] = list(dict.fromkeys([*(merged.get("required") or []), *value]))
            elif key in _ANNOTATIONS:
                merged.setdefault(key, value)
            elif merged.get(key, value) != value:
                return schema
            else:
                merged[key] = value
    return merged


def output_violation(schema: str, output: str) -> str | None:
    """Why `output`, the whole text of a sequence constrained by `schema` (JSON text),
    does not match it; None if it does, or if it cannot be checked (nesting or numbers
    past what the validator reads)."""
    try:
        value = json.loads(output, object_pairs_hook=_no_repeated_keys, parse_float=_finite, parse_int=_readable_int)
    except json.JSONDecodeError as exc:
        return f"the output is not JSON ({exc.msg} at character {exc.pos})"
    except _Repeated as exc:
        return f"the output names {str(exc)[:80]} twice in one object"
    except (RecursionError, ValueError):
        return None
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"the output holds an unpaired UTF-16 surrogate (U+{ord(exc.object[exc.start]):04X}), no character"
    try:
        error = next(jsonschema_rs.validator_for(json.loads(schema), **_OPTIONS).iter_errors(value), None)
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError, RecursionError):
        return None
    if error is None:
        return None
    where = "/" + "/".join(str(p) for p in error.instance_path)
    return f"at {where}: {_first_line(error)}"[:MAX_MESSAGE]


class _Repeated(ValueError):
    """An object of the output names a key twice (JSON allows it; one value would be lost)."""


def _no_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _Repeated(json.dumps(key))
        out[key] = value
    return out


def _finite(text: str) -> float:
    """A JSON number as the validator can read it: one past a double's range (1e400) is
    not checked (ValueError), where Python would read it as infinity, which the validator
    takes for null."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is past a double's range")
    return value


def _readable_int(text: str) -> int | float:
    """A JSON integer as the validator can read it: past 64 bits, as the nearest double
    (it reads no larger integers, and the answer went unchecked)."""
    value = int(text)
    return value if -2**63 <= value < 2**64 else float(value)


def _first_line(exc: Exception) -> str:
    text = getattr(exc, "message", None) or str(exc)
    return (text.splitlines() or [type(exc).__name__])[0][:MAX_MESSAGE]


def _pointer(path: str, *keys) -> str:
    return path + "".join("/" + str(k).replace("~", "~0").replace("/", "~1") for k in keys)


def _where(path: str) -> str:
    return path or "the schema"


def _kinds(type_) -> set[str]:
    names = type_ if isinstance(type_, list) else [type_]
    return set().union(*(_KINDS.get(n, set()) for n in names if isinstance(n, str)))


def _canonical(value):
    """A hashable form of a JSON value under JSON's equality (1 == 1.0, true != 1)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return type(value).__name__, value
    if isinstance(value, (int, float)):
        return "number", value
    if isinstance(value, list):
        return "array", tuple(_canonical(v) for v in value)
    if isinstance(value, dict):
        return "object", frozenset((k, _canonical(v)) for k, v in value.items())
    return "other", repr(value)


def _number(value) -> float | None:
    """A finite JSON number, or None (Python's json reads Infinity and NaN too)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if isinstance(value, int) or math.isfinite(value) else None


class _Satisfiability:
    """Which subschemas of one schema no value can meet. Each subschema is decided once
    (`_memo`); one met again while it is being decided (recursion) counts as satisfiable."""

    def __init__(self, root: dict | bool) -> None:
        self.root = root
        schema_uri = root.get("$schema", "") if isinstance(root, dict) else ""
        self.ref_hides_siblings = isinstance(schema_uri, str) and any(d in schema_uri for d in _OLD_DRAFTS)
        self._memo: dict[int, str | None] = {}
        self._registry = None
        self._pinned_checks = 0
        self._pinned_until = time.monotonic() + PINNED_SECONDS

    def unmet(self, node, path: str, depth: int) -> str | None:
        """Why no value meets `node` (found at JSON pointer `path`), or None."""
        if node is False:
            return f"{_where(path)} is false"
        if not isinstance(node, dict) or depth > MAX_DEPTH:
            return None
        key = id(node)
        if key in self._memo:
            return self._memo[key]
        self._memo[key] = None
        self._memo[key] = reason = self._decide(node, path, depth)
        return reason

    def _decide(self, node: dict, path: str, depth: int) -> str | None:
        members = self._conjuncts(node, path)
        for m, p in members:
            if m is False:
                return f"{_where(p)} is false"
        members = [(m, p) for m, p in members if isinstance(m, dict)]
        for m, p in members:
            reason = self._negated(m, p) or self._branches(m, p, depth)
            if reason:
                return reason
        kinds = set(_ALL_KINDS)
        for m, p in members:
            if "type" in m:
                kinds &= _kinds(m["type"])
            excluded = m.get("not")
            if isinstance(excluded, dict) and "type" in excluded and set(excluded) <= _ANNOTATIONS | {"type"}:
                kinds -= _kinds(excluded["type"])
        if not kinds:
            return f"{_where(path)} allows no JSON type (its `type` keywords and `not` exclude each other)"
        pinned = self._pinned(members)
        if pinned is not None:
            return self._no_pinned_value(pinned, path)
        generated = self._generated_kinds(members)
        if generated is not None:
            reason = self._kinds_unmet(members, kinds & generated, depth)
            return reason and (f"{reason} ({_where(path)} has no `type`, and xgrammar generates it as "
                               f"{'an object' if 'object' in generated else 'an array'} only)")
        return self._kinds_unmet(members, kinds, depth)

    @staticmethod
    def _generated_kinds(members) -> set[str] | None:
        """What xgrammar generates for a subschema without `type`: an object when it has
        `properties` or `additionalProperties`, an array when it has `items` or
        `prefixItems` (None: no such narrowing). JSON Schema lets any other value meet
        such a schema, but the grammar never produces one."""
        if any("type" in m or "anyOf" in m or "oneOf" in m for m, _ in members):
            return None
        objects = any(k in m for m, _ in members for k in ("properties", "additionalProperties"))
        arrays = any(k in m for m, _ in members for k in ("items", "prefixItems"))
        return {"object"} if objects and not arrays else {"array"} if arrays and not objects else None

    def _kinds_unmet(self, members, kinds: set[str], depth: int) -> str | None:
        """Why no value of any of `kinds` meets every one of `members`, or None."""
        reasons = []
        for family, rule in ((("null", "boolean"), None), (("integer", "fraction"), self._numbers),
                             (("string",), self._strings), (("array",), self._arrays), (("object",), self._objects)):
            allowed = kinds.intersection(family)
            if not allowed:
                continue
            reason = rule(members, allowed, depth) if rule else None
            if reason is None:
                return None
            reasons.append(reason)
        return "; ".join(reasons) or "it allows no JSON type"

    # ---- the pieces of one subschema ----
    def _conjuncts(self, node: dict, path: str) -> list[tuple[object, str]]:
        """`node` and every subschema a value must also meet: its `allOf` members and
        local `$ref` targets, transitively (a bounded number of them)."""
        out, seen, todo = [], set(), [(node, path)]
        while todo and len(out) < MAX_CONJUNCTS:
            m, p = todo.pop(0)
            if id(m) in seen:
                continue
            seen.add(id(m))
            if isinstance(m, dict) and isinstance(m.get("$ref"), str) and self.ref_hides_siblings:
                target = self._resolve(m["$ref"])
                if target is not None:
                    todo.append(target)
                continue
            out.append((m, p))
            if not isinstance(m, dict):
                continue
            if isinstance(m.get("allOf"), list):
                todo.extend((s, _pointer(p, "allOf", i)) for i, s in enumerate(m["allOf"]))
            if isinstance(m.get("$ref"), str):
                target = self._resolve(m["$ref"])
                if target is not None:
                    todo.append(target)
        return out

    def _resolve(self, ref: str) -> tuple[object, str] | None:
        """A `$ref` that points into this schema ("#/..."); None for any other kind."""
        if not ref.startswith("#") or (len(ref) > 1 and not ref.startswith("#/")):
            return None
        node = self.root
        for part in ref[2:].split("/") if len(ref) > 1 else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node, ref[1:]

    @staticmethod
    def _negated(m: dict, path: str) -> str | None:
        if "not" not in m:
            return None
        excluded = m["not"]
        if excluded is True or (isinstance(excluded, dict) and set(excluded) <= _ANNOTATIONS):
            return f"{_pointer(path, 'not')} is {json.dumps(excluded)[:80]}, which every value matches"
        return None

    def _branches(self, m: dict, path: str, depth: int) -> str | None:
        for key in ("anyOf", "oneOf"):
            branches = m.get(key)
            if not isinstance(branches, list) or not branches:
                continue
            reasons = [self.unmet(b, _pointer(path, key, i), depth + 1) for i, b in enumerate(branches)]
            if all(reasons):
                return f"no branch of {_pointer(path, key)} can match ({reasons[0]})"
        return None

    @staticmethod
    def _pinned(members) -> list | None:
        """The values `const` and `enum` leave (None: they do not pin the value)."""
        pinned = None
        for m, _ in members:
            if "const" in m:
                values = [m["const"]]
            elif isinstance(m.get("enum"), list):
                values = m["enum"]
            else:
                continue
            if pinned is None:
                pinned = values
            else:
                allowed = {_canonical(v) for v in values}
                pinned = [v for v in pinned if _canonical(v) in allowed]
        return pinned

    def _no_pinned_value(self, pinned: list, path: str) -> str | None:
        if not pinned:
            return f"the const and enum values of {_where(path)} have none in common"
        if self._pinned_checks >= MAX_PINNED_CHECKS or time.monotonic() > self._pinned_until:
            return None
        self._pinned_checks += 1
        try:
            if self._registry is None:
                self._registry = jsonschema_rs.Registry([(_ROOT, self.root)])
            ref = f"{_ROOT}#{quote(path, safe='/~')}"
            validator = jsonschema_rs.validator_for({"$ref": ref}, registry=self._registry, **_OPTIONS)
            if any(validator.is_valid(v) for v in pinned):
                return None
        except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError):
            return None
        shown = json.dumps(pinned[:3])[:80] + ("..." if len(pinned) > 3 else "")
        return f"none of the values {_where(path)} allows ({shown}) matches the rest of it"

    # ---- one kind of value at a time: a reason when no value of that kind fits ----
    @staticmethod
    def _bound(members, key: str, pick):
        values = [v for m, _ in members if (v := _number(m.get(key))) is not None]
        return pick(values) if values else None

    def _numbers(self, members, allowed: set[str], depth: int) -> str | None:
        low, low_strict, high, high_strict = -math.inf, False, math.inf, False
        for m, _ in members:
            # draft 4 spells an exclusive bound as a boolean beside minimum / maximum
            for key, strict in (("minimum", m.get("exclusiveMinimum") is True), ("exclusiveMinimum", True)):
                v = _number(m.get(key))
                if v is not None and (v > low or (v == low and strict)):
                    low, low_strict = v, strict
            for key, strict in (("maximum", m.get("exclusiveMaximum") is True), ("exclusiveMaximum", True)):
                v = _number(m.get(key))
                if v is not None and (v < high or (v == high and strict)):
                    high, high_strict = v, strict
        if "integer" in allowed:
            first = low if low == -math.inf else math.floor(low) + 1 if low_strict else math.ceil(low)
            last = high if high == math.inf else math.ceil(high) - 1 if high_strict else math.floor(high)
            if first <= last:
                return None
        if "fraction" in allowed and (low < high or (low == high and not (low_strict or high_strict)
                                                     and isinstance(low, float) and not low.is_integer())):
            return None
        return (f"no {'integer' if 'fraction' not in allowed else 'number'} is {'>' if low_strict else '>='} "
                f"{low} and {'<' if high_strict else '<='} {high}")

    def _strings(self, members, allowed, depth: int) -> str | None:
        low = self._bound(members, "minLength", max) or 0
        high = self._bound(members, "maxLength", min)
        if high is not None and low > high:
            return f"a string cannot be at least {low} and at most {high} characters long"
        return None

    def _arrays(self, members, allowed, depth: int) -> str | None:
        low = self._bound(members, "minItems", max) or 0
        high = self._bound(members, "maxItems", min)
        if high is not None and low > high:
            return f"an array cannot have at least {low} and at most {high} items"
        for m, p in members:
            prefix_key = "prefixItems" if "prefixItems" in m else "items"
            prefix = m.get(prefix_key) if isinstance(m.get(prefix_key), list) else []
            rest_key = "additionalItems" if prefix_key == "items" and prefix else "items"
            for i in range(min(int(low), len(prefix))):
                reason = self.unmet(prefix[i], _pointer(p, prefix_key, i), depth + 1)
                if reason:
                    return f"the array needs item {i}, and {reason}"
            if low > len(prefix) and rest_key in m and not isinstance(m[rest_key], list):
                reason = self.unmet(m[rest_key], _pointer(p, rest_key), depth + 1)
                if reason:
                    return f"the array needs at least {int(low)} items, and {reason}"
            if "contains" in m and m.get("minContains", 1) != 0:
                reason = self.unmet(m["contains"], _pointer(p, "contains"), depth + 1)
                if reason:
                    return f"the array must contain an item matching {_pointer(p, 'contains')}, and {reason}"
                if high == 0:
                    return f"the array must contain an item matching {_pointer(p, 'contains')}, and maxItems is 0"
        return None

    def _objects(self, members, allowed, depth: int) -> str | None:
        low = self._bound(members, "minProperties", max) or 0
        high = self._bound(members, "maxProperties", min)
        required = list(dict.fromkeys(n for m, _ in members if isinstance(m.get("required"), list)
                                      for n in m["required"] if isinstance(n, str)))
        if high is not None and max(low, len(required)) > high:
            what = f"{len(required)} required properties" if len(required) > low else f"minProperties {low}"
            return f"an object cannot have {what} and at most {high} properties"
        for name in required:
            for m, p in members:
                props = m.get("properties") if isinstance(m.get("properties"), dict) else {}
                if name in props:
                    reason = self.unmet(props[name], _pointer(p, "properties", name), depth + 1)
                    if reason:
                        return f"required property {name!r} cannot be given: {reason}"
                elif m.get("patternProperties"):
                    continue                    # a pattern may admit the name; patterns are not run here
                elif "additionalProperties" in m:
                    reason = self.unmet(m["additionalProperties"], _pointer(p, "additionalProperties"), depth + 1)
                    if reason:
                        return (f"property {name!r} is required, but {_where(p)} does not list it among its "
                                f"properties and its additionalProperties is {json.dumps(m['additionalProperties'])}")
        return None
