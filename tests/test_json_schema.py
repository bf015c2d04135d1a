"""JSON schemas no output can meet are refused (400 / INVALID_ARGUMENT) instead of
answered with output that breaks them, and output that still breaks its schema is an
error, never a `stop`. The satisfiability rules alone first, then through the real
cluster over HTTP and gRPC."""
from __future__ import annotations

import json
import time

import grpc
import httpx
import jsonschema
import openai
import pytest

from services.engine.text.json_schema import check, output_violation
from services.engine.structured import Grammars
from services.rpc import generate_pb2, generate_pb2_grpc

# What a hostile-client probe sent: each was answered 200, with output breaking it.
PROBES = {
    "not_anything": {"not": {}},
    "required_but_forbidden": {"type": "object", "required": ["x"], "additionalProperties": False},
    "required_but_forbidden_untyped": {"required": ["x"], "additionalProperties": False},
    "two_different_consts": {"allOf": [{"const": 1}, {"const": 2}]},
}
UNSATISFIABLE = {
    **PROBES,
    "false": False,
    "const_of_the_wrong_type": {"type": "string", "const": 3},
    "enum_values_too_short": {"enum": ["a", "bb"], "minLength": 3},
    "const_and_true_are_not_one": {"allOf": [{"const": 1}, {"const": True}]},
    "types_apart": {"allOf": [{"type": "string"}, {"type": "integer"}]},
    "type_negated": {"type": "string", "not": {"type": "string"}},
    "no_integer_between": {"type": "integer", "minimum": 1.2, "maximum": 1.8},
    "exclusive_bounds_meet": {"type": "number", "minimum": 2, "exclusiveMaximum": 2},
    "lengths_cross": {"type": "string", "minLength": 5, "maxLength": 1},
    "items_cross": {"type": "array", "minItems": 3, "maxItems": 1},
    "needed_item_forbidden": {"type": "array", "minItems": 1, "items": False},
    "needed_prefix_item_impossible": {"type": "array", "minItems": 2, "prefixItems": [{}, {"not": {}}]},
    "required_property_impossible": {"type": "object", "properties": {"a": {"not": {}}}, "required": ["a"]},
    "required_beyond_max_properties": {"type": "object", "required": ["a", "b"], "maxProperties": 1},
    "required_forbidden_by_an_allof_member": {"type": "object", "allOf": [
        {"required": ["x"]}, {"properties": {"y": {}}, "additionalProperties": False}]},
    "every_branch_impossible": {"anyOf": [{"not": {}}, {"type": "string", "maxLength": 1, "minLength": 2}]},
    "through_a_ref": {"$defs": {"never": {"not": {}}}, "$ref": "#/$defs/never"},
    "contains_with_no_items": {"type": "array", "contains": {"type": "string"}, "maxItems": 0},
    "no_schema": {"type": "nonsense"},
    "remote_ref": {"$ref": "https://example.com/schema.json"},
}
SATISFIABLE = {
    "anything": {},
    "true": True,
    "same_const_twice": {"allOf": [{"const": 1}, {"const": 1.0}]},
    "number_and_integer": {"allOf": [{"type": "number"}, {"type": "integer"}]},
    "some_branch_possible": {"anyOf": [{"not": {}}, {"type": "string"}]},
    "optional_property_impossible": {"type": "object", "properties": {"a": {"not": {}}}},
    "required_and_listed": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"],
                            "additionalProperties": False},
    "required_by_a_pattern": {"type": "object", "patternProperties": {"^x": {}}, "required": ["x"],
                              "additionalProperties": False},
    "required_but_null_allowed": {"type": ["object", "null"], "required": ["x"], "additionalProperties": False},
    "lengths_cross_but_not_for_null": {"type": ["string", "null"], "minLength": 3, "maxLength": 1},
    "one_number_left": {"type": "number", "minimum": 2, "maximum": 2},
    "fractions_between": {"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 2},
    "undecided_negation": {"type": "integer", "minimum": 0, "maximum": 9, "not": {"const": 3}},
    "recursive": {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},
    # draft 7: $ref hides its siblings, so "type": "integer" does not apply
    "draft7_ref_siblings": {"$schema": "http://json-schema.org/draft-07/schema#",
                            "definitions": {"a": {"type": "string"}}, "$ref": "#/definitions/a", "type": "integer"},
}


@pytest.mark.parametrize("name", UNSATISFIABLE)
def test_a_schema_no_output_can_meet_is_refused_with_the_reason(name):
    with pytest.raises(ValueError, match="the JSON schema") as exc:
        check(UNSATISFIABLE[name])
    assert len(str(exc.value)) < 500


@pytest.mark.parametrize("name", SATISFIABLE)
def test_a_schema_some_output_can_meet_passes(name):
    check(SATISFIABLE[name])


def test_a_clients_pattern_cannot_stall_the_check():
    """Python's `re` takes exponential time over this; the validator's engine does not."""
    started = time.monotonic()
    with pytest.raises(ValueError):
        check({"type": "string", "pattern": "^(a+)+$", "enum": ["a" * 50_000 + "!"]})
    assert time.monotonic() - started < 1.0
    assert output_violation('{"type": "string", "pattern": "^(a+)+$"}', json.dumps("a" * 50_000 + "!"))


def test_a_schema_nested_past_the_parser_is_refused_by_name():
    """Over gRPC a schema is a string, parsed on the router: nesting past Python's
    recursion limit is the caller's mistake, not an internal error."""
    grammars = Grammars(lambda: None, 0, frozenset())
    with pytest.raises(ValueError, match="too deeply"):
        grammars.compile('{"items": ' * 3000 + "{}" + "}" * 3000)
    with pytest.raises(ValueError, match="not valid"):
        grammars.compile('{"items": ' * 300 + "{}" + "}" * 300)


def test_output_violations_name_where_and_why():
    assert output_violation('{"type": "object"}', '{"a": 1}') is None
    assert "not JSON" in output_violation('{"type": "object"}', '{"a":')
    reason = output_violation('{"type": "object", "properties": {"a": {"maximum": 3}}}', '{"a": 7}')
    assert reason.startswith("at /a:") and "maximum" in reason


# ---- through the cluster ----
MSG = [{"role": "user", "content": "Answer in JSON."}]
OK_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}
# Passes the static check (`not` of a schema that is not plainly everything is not
# decided), but xgrammar ignores `not`: every integer it can write breaks the schema.
BROKEN_BY_ANY_OUTPUT = {"type": "integer", "minimum": 0, "maximum": 9, "not": {"minimum": 0}}


def _chat(cluster, schema, **extra) -> httpx.Response:
    return httpx.post(f"{cluster.http}/v1/chat/completions", timeout=120, json={
        "messages": MSG, "max_tokens": 12, "temperature": 0, **extra,
        "response_format": {"type": "json_schema", "json_schema": {"name": "probe", "schema": schema}}})


def _generate(cluster, schema, max_tokens: int = 12) -> list[generate_pb2.GenerateResponse]:
    with grpc.insecure_channel(cluster.grpc.removeprefix("http://")) as ch:
        request = generate_pb2.GenerateRequest(chat=generate_pb2.ChatMessages(messages=[
            generate_pb2.ChatMessage(role="user", content=MSG[0]["content"])]), sampling=generate_pb2.SamplingParams(
                max_tokens=max_tokens, temperature=0, json_schema=json.dumps(schema)))
        return list(generate_pb2_grpc.GeneratorStub(ch).Generate(request, timeout=120))


@pytest.mark.parametrize("name", PROBES)
def test_http_refuses_an_unsatisfiable_schema_naming_the_field(cluster, name):
    r = _chat(cluster, PROBES[name])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_json_schema" and err["param"] == "response_format.json_schema.schema", err
    assert err["type"] == "invalid_request_error" and "JSON schema" in err["message"], err


@pytest.mark.parametrize("name", PROBES)
def test_grpc_refuses_an_unsatisfiable_schema_as_invalid_argument(cluster, name):
    with pytest.raises(grpc.RpcError) as exc:
        _generate(cluster, PROBES[name])
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details()
    assert "JSON schema" in exc.value.details()


def test_a_satisfiable_schema_still_answers_over_http_and_grpc(cluster):
    r = _chat(cluster, OK_SCHEMA)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), OK_SCHEMA)
    out = _generate(cluster, OK_SCHEMA)
    assert out[-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(m.text for m in out)), OK_SCHEMA)


def test_output_that_breaks_its_schema_is_an_error_not_a_stop(cluster):
    r = _chat(cluster, BROKEN_BY_ANY_OUTPUT)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "json_schema_violation" and err["type"] == "server_error", err
    assert "does not match the JSON schema" in err["message"], err

    client = openai.OpenAI(base_url=f"{cluster.http}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=MSG, max_tokens=12, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "probe", "schema": BROKEN_BY_ANY_OUTPUT}})
    finishes = []
    with pytest.raises(openai.APIError, match="does not match the JSON schema"):
        for chunk in stream:
            finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
    assert finishes == []                       # no chunk claimed a stop

    with pytest.raises(grpc.RpcError) as exc:
        _generate(cluster, BROKEN_BY_ANY_OUTPUT)
    assert exc.value.code() == grpc.StatusCode.INTERNAL and "does not match" in exc.value.details()


def test_output_cut_by_max_tokens_is_not_checked(cluster):
    """A `length` ending is partial by design (as with OpenAI): it comes back as it is."""
    r = _chat(cluster, {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
              max_tokens=3)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


def test_the_checks_of_pinned_values_stop_at_their_time_budget(monkeypatch):
    """Each const or enum checked against the rest of its subschema builds a validator of
    all its references reach: a schema of hundreds took tens of seconds of the router's
    tokenizer threads. Past PINNED_SECONDS they stop, what is undecided counts as
    satisfiable (the output guard checks the answer)."""
    from services.engine.text import json_schema
    with pytest.raises(ValueError, match="none of the values"):
        json_schema.parse('{"const": 5, "maximum": 3}')
    monkeypatch.setattr(json_schema, "PINNED_SECONDS", -1.0)
    json_schema.parse('{"const": 5, "maximum": 3}')


def test_the_guard_reads_what_the_validator_cannot_and_catches_what_json_hides():
    """Integers past 64 bits are checked as doubles (they went unchecked: 10**33 passed a
    maximum of 5); a number past a double's range is not checked (it read as infinity,
    which the validator takes for null: a 500 for valid output); a key named twice in one
    object, and an unpaired surrogate (the grammar allows both), are violations."""
    from services.engine.text.json_schema import output_violation
    assert "maximum" in output_violation('{"allOf": [{"type": "integer"}, {"maximum": 5}]}', "1" + "0" * 33)
    assert output_violation('{"type": "number"}', "1e400") is None
    assert "twice" in output_violation('{"type": "object", "minProperties": 2}', '{"a": 1, "a": 2}')
    assert "surrogate" in output_violation('{"type": "object"}', '{"a": "\\ud800"}')
    assert output_violation('{"type": "object"}', '{"a": "\\ud83d\\ude00"}') is None


def test_a_bounds_name_in_a_schemas_data_bounds_nothing():
    from services.engine.text.json_schema import parse
    parse('{"enum": [{"maxItems": 1000000}], "default": {"maxLength": 200000}}')
    with pytest.raises(ValueError, match="maxItems"):
        parse('{"type": "array", "maxItems": 1000000}')
