"""Structured output as the APIs ask for it, resolved to the one constraint the workers
compile (services/engine/structured.py): a JSON schema, a regular expression, an EBNF
grammar or an xgrammar structural tag.

The HTTP APIs take OpenAI's `response_format` (JSON, or vLLM's structural tag), vLLM's
`structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`,
`structural_tag`) and vLLM's earlier `guided_json`, `guided_regex`, `guided_choice` and
`guided_grammar`; gRPC takes the same kinds as fields of its SamplingParams. A request
asks for one kind at most. The router checks a JSON schema itself (text/json_schema.py);
the other kinds need xgrammar, which the router does not load, so a worker refuses one
it cannot compile with INVALID_ARGUMENT and a code the router answers with
(`invalid_regex`, `invalid_grammar`, ...).

A choice becomes a grammar of its strings, and a structural tag in vLLM's first form
(structures and triggers) xgrammar's `format`, as vLLM's xgrammar backend has them. With
tools called "auto" and a JSON format beside them, the output is a structural tag that
allows either the format or the calls (`with_calls`): OpenAI's behaviour, which lets an
agent call tools and still give its final answer in its format.
"""
from __future__ import annotations

import json

from services.engine.text.json_schema import JSON_OBJECT, MAX_SCHEMA_CHARS
from services.router.protocol import CommonRequest, bad_request

# A constraint the workers compile: (kind, text), kind one of sampling.STRUCTURE_KINDS.
Structure = tuple[str, str]
# The codes of a worker's refusal of a constraint it cannot compile (engine/structured.py).
STRUCTURE_CODES = frozenset({"invalid_json_schema", "invalid_regex", "invalid_grammar", "invalid_structural_tag"})


def asked(req: CommonRequest) -> list[tuple[str, str, object]]:
    """Every structured-output request in `req`: (the field that asked, kind, value), where
    kind is json, json_object, regex, choice, grammar or structural_tag."""
    out: list[tuple[str, str, object]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        out.append(("response_format", "json_object", True))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise bad_request("response_format json_schema needs its json_schema",
                              param="response_format.json_schema")
        out.append(("response_format.json_schema.schema", "json", fmt.json_schema.schema_))
    elif fmt is not None and fmt.type == "structural_tag":
        if fmt.format is not None:
            tag = {"type": "structural_tag", "format": fmt.format}
        elif fmt.structures is not None and fmt.triggers is not None:
            tag = {"structures": [s.model_dump(by_alias=True) for s in fmt.structures], "triggers": fmt.triggers}
        else:
            raise bad_request("response_format structural_tag needs its format, or structures and triggers",
                              param="response_format")
        out.append(("response_format", "structural_tag", json.dumps(tag)))
    so = req.structured_outputs
    if so is not None:
        for kind, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice), ("grammar", so.grammar),
                            ("json_object", so.json_object or None), ("structural_tag", so.structural_tag)):
            if value is not None:
                out.append((f"structured_outputs.{kind}", kind, value))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            out.append((f"guided_{kind}", kind, value))
    return out


async def resolve(fe, wanted: list[tuple[str, str, object]]) -> Structure | None:
    """The one constraint `wanted` (`asked`'s list, or gRPC's fields in its form) asks
    for, checked as far as the router can; None for free text."""
    if not wanted:
        return None
    if len(wanted) > 1:
        raise bad_request(f"only one kind of structured output may be asked for; {wanted[0][0]} and "
                          f"{wanted[1][0]} both were", param=wanted[1][0])
    param, kind, value = wanted[0]
    return await check(fe, kind, value, param)


async def check(fe, kind: str, value, param: str) -> Structure:
    if kind == "json_object":
        return "json_schema", JSON_OBJECT
    if kind == "json":
        if isinstance(value, str):
            try:
                json.loads(value)
            except json.JSONDecodeError as exc:
                raise bad_request(f"the JSON schema is not JSON: {exc}", param=param,
                                  code="invalid_json_schema") from None
            except RecursionError:
                raise bad_request("the JSON schema is nested too deeply", param=param,
                                  code="invalid_json_schema") from None
            text = value
        else:
            text = json.dumps(value)
        return "json_schema", await fe.check_schema(text, param)
    text = choice_grammar(value, param) if kind == "choice" else value
    if len(text) > MAX_SCHEMA_CHARS:          # as a schema's: its size bounds its compile time on the workers
        raise bad_request(f"{param} is longer than {MAX_SCHEMA_CHARS} characters", param=param)
    if kind == "choice":
        return "grammar", text
    if not value:
        raise bad_request(f"{param} must not be empty", param=param)
    if kind == "structural_tag":
        try:
            tag = json.loads(value)
        except json.JSONDecodeError as exc:
            raise bad_request(f"the structural tag is not JSON: {exc}", param=param,
                              code="invalid_structural_tag") from None
        except RecursionError:
            raise bad_request("the structural tag is nested too deeply", param=param,
                              code="invalid_structural_tag") from None
        if isinstance(tag, dict) and "structures" in tag and "format" not in tag:
            return kind, json.dumps(first_form(tag, param))
    return kind, value


def first_form(tag: dict, param: str) -> dict:
    """vLLM's first structural tag form ({"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}: free text in which a trigger starts one of the structures) in
    xgrammar's `format` terms, as vLLM's xgrammar backend converts it."""
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list) or not all(
            isinstance(s, dict) and {"begin", "schema", "end"} <= set(s) for s in structures):
        raise bad_request("a structural tag's structures need begin, schema and end, and its triggers a list",
                          param=param, code="invalid_structural_tag")
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": [
        {"type": "tag", "begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]},
         "end": s["end"]} for s in structures]}}


def choice_grammar(choices: list[str], param: str) -> str:
    """An EBNF grammar whose only sentences are `choices` (xgrammar's string literals take
    JSON's escapes)."""
    if not choices or not all(choices):
        raise bad_request("choice needs one or more non-empty strings", param=param)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))


def with_calls(structure: Structure, tools: list[dict], syntax, one_call: bool = False) -> Structure:
    """The JSON `structure` or calls of `tools` as `syntax` writes them (its grammar_tags:
    chatml-tools.jinja's `<tool_call>` JSON for hermes), one or more (one with
    `one_call`), as one structural tag. Every call's arguments are held to its tool's
    parameters."""
    kind, schema = structure
    either = {"type": "or", "elements": [
        {"type": "json_schema", "json_schema": json.loads(schema)},
        {"type": "tags_with_separator", "tags": call_tags(tools, syntax, every_tool_strict=True), "separator": "\n",
         "at_least_one": True, **({"stop_after_first": True} if one_call else {})}]}
    return "structural_tag", json.dumps({"type": "structural_tag", "format": either})


def calls_in_text(tools: list[dict], syntax, every_tool_strict: bool = False, one_call: bool = False) -> Structure:
    """Free text in which a call, from `syntax`'s opening tag on, is a call of one of
    `tools` (tool_choice auto with strict tools, one call asked, or --tool-strict-level):
    its name one of theirs, its arguments held to the tool's parameters where the tool is
    strict (or `every_tool_strict`), any object where not. After `one_call`, the output
    ends with the call."""
    found = {"type": "triggered_tags", "triggers": [syntax.OPEN], "tags": call_tags(tools, syntax, every_tool_strict),
             **({"stop_after_first": True} if one_call else {})}
    return "structural_tag", json.dumps({"type": "structural_tag", "format": found})


def call_tags(tools: list[dict], syntax, every_tool_strict: bool) -> list[dict]:
    """The xgrammar tags of a call of each of `tools`, as `syntax` writes calls."""
    return [tag for t in tools
            for tag in syntax.grammar_tags(t["function"]["name"], _arguments(t["function"], every_tool_strict))]


def _arguments(function: dict, strict: bool) -> dict:
    """What a call's arguments are held to: the tool's parameters where it is strict, any
    JSON object where not."""
    if strict or function.get("strict") is True:
        return function.get("parameters") or {"type": "object"}
    return {"type": "object"}
