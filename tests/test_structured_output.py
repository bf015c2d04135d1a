"""Structured output beyond JSON schemas: vLLM's `structured_outputs` (regex, choice,
grammar, json, json_object, structural_tag) and its earlier `guided_*` fields, over the
chat and completions APIs and gRPC, and tools called "auto" beside a JSON format. The
constraints alone first (xgrammar with the real tokenizer), then through the real
cluster."""
from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest

from services.engine.structured import MAX_CHARS, Grammars, SchemaError
from services.router.structured import calls_in_text, choice_grammar, first_form, with_calls
from services.router.tool_syntax import SYNTAXES
from services.rpc import generate_pb2, generate_pb2_grpc

MODEL = "SmolLM2-135M-Instruct"
CITIES = ["Paris", "London", "Rome", 'a "quoted" \\ city']
PHONE = r"[0-9]{3}-[0-9]{4}"
YES_NO = 'root ::= ("yes" | "no") "."'
ANSWER = {"type": "tag", "begin": "<answer>", "content": {"type": "json_schema", "json_schema": {"enum": ["yes", "no"]}},
          "end": "</answer>"}
CALL_F = {"structures": [{"begin": "<function=f>", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                               "required": ["a"]}, "end": "</function>"}],
          "triggers": ["<function="]}


@pytest.fixture(scope="module")
def grammars(model_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer, Grammars(lambda: tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))


def _allows(grammars, text: str, kind: str, sentence: str) -> bool:
    """Whether `sentence`, whole, is output the constraint allows (and may end there)."""
    tokenizer, compiled = grammars
    constraint = compiled.constraint(text, kind)
    return all(constraint.accept(t) for t in tokenizer.encode(sentence, add_special_tokens=False)) \
        and constraint.accept(tokenizer.eos_token_id)


def test_each_kind_allows_its_sentences_and_no_other(grammars):
    choice = choice_grammar(CITIES, "choice")
    assert all(_allows(grammars, choice, "grammar", c) for c in CITIES)
    assert not _allows(grammars, choice, "grammar", "Berlin") and not _allows(grammars, choice, "grammar", "Pari")
    assert _allows(grammars, PHONE, "regex", "555-1234") and not _allows(grammars, PHONE, "regex", "5551234")
    assert _allows(grammars, YES_NO, "grammar", "no.") and not _allows(grammars, YES_NO, "grammar", "maybe.")
    legacy = json.dumps(first_form(CALL_F, "structural_tag"))           # vLLM's first form: free text and calls
    assert _allows(grammars, legacy, "structural_tag", 'so <function=f>{"a": 1}</function> then')
    assert _allows(grammars, legacy, "structural_tag", "no call at all")
    assert not _allows(grammars, legacy, "structural_tag", "<function=g>{}")


def test_schemas_xgrammar_would_close_too_far_allow_what_they_require(grammars):
    """xgrammar closes objects that say nothing of additional properties, so a required
    name missing from `properties` could only give output without it (`{}` for
    `{"required": ["x"]}`: every answer a 500 after the whole generation), and it refused
    an array's minItems without items: those are stated for it. An object that names its
    properties stays closed to others, as before."""
    required = '{"type": "object", "required": ["x"]}'
    assert _allows(grammars, required, "json_schema", '{"x": 1}') and not _allows(grammars, required, "json_schema", "{}")
    partly = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}'
    assert _allows(grammars, partly, "json_schema", '{"a": 1, "b": "q"}')
    assert _allows(grammars, '{"type": "array", "minItems": 1}', "json_schema", "[1]")
    assert _allows(grammars, '{"type": "object", "minProperties": 1}', "json_schema", '{"k": 2}')
    closed = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    assert not _allows(grammars, closed, "json_schema", '{"a": 1, "b": 2}')
    # xgrammar takes an allOf of two or more branches for any value: they are merged first
    described = '{"allOf": [{"type": "integer"}, {"description": "a count"}]}'
    assert _allows(grammars, described, "json_schema", "12") and not _allows(grammars, described, "json_schema", '"zz"')
    both = ('{"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '
            '{"properties": {"b": {"type": "string"}}, "required": ["b"]}]}')
    assert _allows(grammars, both, "json_schema", '{"a": 1, "b": "x"}')
    assert not _allows(grammars, both, "json_schema", '{"a": 1}')


def test_a_draft_stops_short_of_the_grammars_end(grammars):
    """Speculative decoding drafts what the grammar allows, but not the stop token that
    ends it: the verify step's row after that token would ask a finished matcher for a
    next mask (xgrammar raises, and the step failed). The target's own row gives the end."""
    import xgrammar as xgr
    tokenizer, compiled = grammars
    constraint = compiled.constraint(YES_NO, "grammar")
    said = tokenizer.encode("no.", add_special_tokens=False)
    draft = constraint.fitting([*said, tokenizer.eos_token_id, *said])
    assert draft == said
    bitmask = xgr.allocate_token_bitmask(1, constraint.vocab_size)
    constraint.fill(bitmask, 0, tuple(draft))             # the draft's last row: only the end fits
    allowed = [t for t in range(constraint.vocab_size) if int(bitmask[0, t // 32]) >> (t % 32) & 1]
    assert allowed == [tokenizer.eos_token_id]
    assert all(constraint.accept(t) for t in said) and constraint.accept(tokenizer.eos_token_id)
    assert constraint.fitting(said) == []                 # a finished grammar drafts nothing


def test_a_grammar_after_the_end_of_thinking_holds_only_the_answer(grammars):
    """`structure_after` (a reasoning model's </think>, as the router sends it): the output
    is free, masks included, until it has made those tokens in a row; the grammar holds
    what follows, drafts included, and the sequence ends only once the answer ends."""
    import xgrammar as xgr
    tokenizer, compiled = grammars
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    assert len(end) > 1                                   # SmolLM2 has no single token for it
    constraint = compiled.constraint(YES_NO, "grammar", after=end)
    thought = tokenizer.encode("maybe yes, maybe </think no", add_special_tokens=False)
    answer = tokenizer.encode("no.", add_special_tokens=False)
    bitmask = xgr.allocate_token_bitmask(1, constraint.vocab_size)

    def allowed() -> list[int]:
        return [t for t in range(constraint.vocab_size) if int(bitmask[0, t // 32]) >> (t % 32) & 1]
    # free while thinking: no mask (the row untouched), whatever comes, a tag half made included
    assert not constraint.fill(bitmask, 0) and all(constraint.accept(t) for t in thought)
    assert not constraint.terminated and not constraint.fill(bitmask, 0, end[:-1])
    # a draft that closes the block and answers: only what the grammar allows after the end
    assert constraint.fitting([*end, *answer, tokenizer.eos_token_id]) == [*end, *answer]
    assert constraint.fitting([*end, *tokenizer.encode("maybe", add_special_tokens=False)]) == list(end)
    assert constraint.fill(bitmask, 0, end)
    assert answer[0] in allowed() and all("yes".startswith(w) or "no".startswith(w)
                                          for w in tokenizer.batch_decode([[t] for t in allowed()]))
    assert all(constraint.accept(t) for t in end) and not constraint.terminated
    assert not constraint.accept(tokenizer.encode(" maybe", add_special_tokens=False)[0]) and constraint.terminated
    held = compiled.constraint(YES_NO, "grammar", after=end)          # the same, answered as asked
    assert all(held.accept(t) for t in [*thought, *end, *answer, tokenizer.eos_token_id]) and held.terminated


def test_where_the_prompt_leaves_thinking_to_the_model_its_first_token_may_open_it(grammars):
    """`structure_opens` as well (the start of thinking, where the prompt neither opened
    nor closed the block, as a hybrid model's template leaves it): the first token's mask
    is the grammar's and the opening token; an output that begins with it thinks, free
    until the end tag, then answers as the grammar says; one that begins otherwise is
    held from its first token, and may not open a block later. Drafts likewise."""
    import xgrammar as xgr
    tokenizer, compiled = grammars
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False))
    opens = tuple(tokenizer.encode("<think>", add_special_tokens=False))
    thought = tokenizer.encode("Let me see.", add_special_tokens=False)
    answer = tokenizer.encode("no.", add_special_tokens=False)
    eos = tokenizer.eos_token_id
    bitmask = xgr.allocate_token_bitmask(1, compiled.vocab_size)

    def allowed() -> list[int]:
        return [t for t in range(compiled.vocab_size) if int(bitmask[0, t // 32]) >> (t % 32) & 1]
    thinks = compiled.constraint(YES_NO, "grammar", after=end, opens=opens)
    assert thinks.fill(bitmask, 0)
    first = allowed()
    assert opens[0] in first and answer[0] in first
    assert all(t == opens[0] or "yes".startswith(w) or "no".startswith(w)
               for t, w in zip(first, tokenizer.batch_decode([[t] for t in first])))
    assert thinks.fitting([*opens, *thought, *end, *answer, eos]) == [*opens, *thought, *end, *answer]
    assert thinks.fitting([*answer, eos]) == answer and thinks.fitting([*thought]) == []
    assert not thinks.fill(bitmask, 0, (opens[0],)) and thinks.fill(bitmask, 0, (*opens, *thought, *end))
    assert all(thinks.accept(t) for t in [*opens, *thought]) and not thinks.terminated
    assert not thinks.fill(bitmask, 0)                                # free while thinking
    assert all(thinks.accept(t) for t in [*end, *answer, eos]) and thinks.terminated
    answers = compiled.constraint(YES_NO, "grammar", after=end, opens=opens)
    assert answers.accept(answer[0]) and answers.fill(bitmask, 0) and opens[0] not in allowed()
    assert not answers.accept(opens[0]) and answers.terminated       # no block once the answer began

def test_the_router_starts_a_reasoning_models_grammar_where_its_prompt_says(model_dir):
    """FrontEnd.grammar_start with --reasoning-parser deepseek_r1: a prompt that opens the
    block waits for its end; one that closed it (a hybrid model told not to think) holds
    from the first token; one that did neither lets the first token open it, where the
    start tag is one token (SmolLM2's tokenizer, given the tags as reasoning models'
    vocabularies have them), and holds from the first token where it is several."""
    from services.engine.text.tokenizer import load_tokenizer
    from services.router.frontend import FrontEnd
    several = load_tokenizer(model_dir)
    one = load_tokenizer(model_dir)
    one.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    start, end = one.convert_tokens_to_ids(["<think>", "</think>"])
    schema = ("json_schema", '{"type": "object"}')
    for tokenizer, neither in ((one, ((end,), (start,))), (several, ((), ()))):
        fe = FrontEnd(None, None, tokenizer, "m", 100, 100, reasoning_parser="deepseek_r1")
        ask = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
        opened, closed = (tokenizer.encode(f"<|im_start|>assistant\n{text}", add_special_tokens=False)
                          for text in ("<think>\n", "<think>\n\n</think>\n\n"))
        tag = tuple(tokenizer.encode("</think>", add_special_tokens=False))
        assert fe.grammar_start(opened, schema) == (tag, ())
        assert fe.grammar_start(closed, schema) == ((), ())
        assert fe.grammar_start(ask, schema) == neither
        assert fe.grammar_start(opened, None) == ((), ())                # no structure: nothing to start
    assert FrontEnd(None, None, one, "m", 100, 100).grammar_start(ask, schema) == ((), ())    # no parser


def test_the_schema_guard_checks_the_answer_the_grammar_held():
    """Where the output may open its thinking with its first token (structure_opens): one
    that did is checked after </think> (and has nothing to check if it never got there);
    one that did not was held whole, and the whole is checked, a </think> inside a
    string included."""
    import asyncio
    from services.engine.core.sampling import SamplingParams
    from services.router.protocol import APIError
    from services.router.schema_guard import SchemaGuard
    params = SamplingParams(max_tokens=16, json_schema='{"type": "object", "required": ["a"]}', structure_after=(9,),
                            structure_opens=(7,))

    def ends(first: int, text: str) -> None:
        asyncio.run(SchemaGuard("r", 0, params, "</think>").feed(text, [first, 5], "stop", False))
    ends(7, '<think>hm</think>{"a": 1}')
    ends(7, "<think>hm")
    with pytest.raises(APIError, match="does not match the JSON schema"):
        ends(7, '<think>hm</think>{"b": 1}')
    ends(3, '{"a": "</think>"}')
    with pytest.raises(APIError, match="does not match the JSON schema"):
        ends(3, '{"b": 1}')


def test_a_json_format_beside_auto_tools_allows_the_format_or_the_calls(grammars):
    answer = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    kind, text = with_calls(("json_schema", json.dumps(answer)), tools, HERMES)
    assert _allows(grammars, text, kind, '{"city": "Paris"}') and _allows(grammars, text, kind, call)
    assert _allows(grammars, text, kind, call + "\n" + call)
    assert not _allows(grammars, text, kind, '{"town": "Paris"}') and not _allows(grammars, text, kind, "Paris")
    assert not _allows(grammars, text, kind, call.replace("get_weather", "get_time"))
    kind, one = with_calls(("json_schema", json.dumps(answer)), tools, HERMES, one_call=True)
    assert _allows(grammars, one, kind, call) and not _allows(grammars, one, kind, call + "\n" + call)


HERMES = SYNTAXES["hermes"]


def test_strict_auto_calls_are_free_text_and_calls_of_the_tools(grammars):
    """tool_choice auto with a strict tool (OpenAI's `strict`): text is free; from a
    call's tag on, the call names one of the tools, a strict tool's arguments follow its
    parameters and another's are any JSON object; text may follow a call, unless one call
    was asked (parallel_tool_calls false). --tool-strict-level parameter holds them all."""
    weather = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}}
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
    kind, text = calls_in_text([weather, clock], HERMES)

    def call(name: str, arguments: str, nl: str = "\n") -> str:
        return f'<tool_call>{nl}{{"name": "{name}", "arguments": {arguments}}}{nl}</tool_call>'
    assert _allows(grammars, text, kind, "Let me see. " + call("get_weather", '{"city": "Paris"}') + " Done.")
    assert _allows(grammars, text, kind, "No call at all.")
    assert _allows(grammars, text, kind, call("get_time", '{"zone": 1}', nl=""))      # not strict: any object
    assert not _allows(grammars, text, kind, call("get_weather", '{"town": "Paris"}'))
    assert not _allows(grammars, text, kind, call("get_date", "{}"))
    assert not _allows(grammars, text, kind, call("get_time", '"utc"'))
    kind, every = calls_in_text([weather, clock], HERMES, every_tool_strict=True)
    assert not _allows(grammars, every, kind, call("get_time", '{"zone": 1}'))
    kind, one = calls_in_text([weather, clock], HERMES, one_call=True)
    two = call("get_weather", '{"city": "Paris"}') + call("get_time", '{"tz": "CET"}')
    assert _allows(grammars, one, kind, "Sure. " + call("get_weather", '{"city": "Paris"}'))
    assert not _allows(grammars, one, kind, two) and _allows(grammars, text, kind, two)


@pytest.mark.parametrize("parser, call", [
    ("qwen3_coder", "<tool_call>\n<function={name}>\n<parameter=city>\n{city}\n</parameter>\n<parameter=days>\n{days}"
                    "\n</parameter>\n</function>\n</tool_call>"),
    ("glm45", "<tool_call>{name}<arg_key>city</arg_key><arg_value>{city}</arg_value><arg_key>days</arg_key>"
              "<arg_value>{days}</arg_value></tool_call>")])
def test_xml_calls_a_grammar_holds_are_calls_of_the_tools_typed_by_them(grammars, parser, call):
    """Qwen3-Coder's and GLM's calls, held as xgrammar's qwen_xml and glm_xml styles hold
    them: free text, then a call of one of the tools whose values fit a strict tool's
    parameters; what the router then reads back is those values, typed by the schema."""
    from services.router.tools import ToolPlan, parse_calls
    weather = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"]}}}
    syntax = SYNTAXES[parser]
    kind, text = calls_in_text([weather], syntax)
    good = call.format(name="get_weather", city="Paris", days=3)
    assert _allows(grammars, text, kind, "Let me see. " + good)
    assert not _allows(grammars, text, kind, call.format(name="get_weather", city="Paris", days="soon"))
    assert not _allows(grammars, text, kind, call.format(name="get_time", city="Paris", days=3))
    kind, one = calls_in_text([weather], syntax, one_call=True)
    assert _allows(grammars, one, kind, good) and not _allows(grammars, one, kind, good + good)
    assert parse_calls(ToolPlan([weather], "auto", syntax=syntax), "Let me see. " + good)[1][0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}


@pytest.mark.parametrize("kind, text, code", [
    ("regex", "(", "invalid_regex"),
    ("grammar", 'root ::= "a" |', "invalid_grammar"),
    ("structural_tag", '{"type": "structural_tag", "format": {"type": "nonesuch"}}', "invalid_structural_tag"),
])
def test_a_constraint_that_cannot_compile_is_refused_by_its_code(grammars, kind, text, code):
    """The worker's code for it, one the router names the asking field by."""
    from services.router.structured import STRUCTURE_CODES
    with pytest.raises(SchemaError) as exc:
        grammars[1].compile(text, kind)
    assert exc.value.code == code and "cannot be compiled" in str(exc.value) and code in STRUCTURE_CODES


def test_a_long_compile_delays_only_its_own_request(grammars):
    """xgrammar takes seconds over a long bounded repetition; another constraint compiled
    meanwhile does not wait for it, and one past the size bound is refused unread."""
    compiled = grammars[1]
    slow_done, failed = threading.Event(), []

    def slow():
        try:
            compiled.compile(".{0,1500}", "regex")         # ~2 s here
        except Exception as exc:
            failed.append(exc)
        slow_done.set()
    worker = threading.Thread(target=slow)
    worker.start()
    time.sleep(0.2)
    compiled.compile("[0-9]+", "regex")
    assert not slow_done.is_set()
    worker.join()
    assert not failed, failed
    with pytest.raises(SchemaError, match="longer than"):
        compiled.compile("a" * (MAX_CHARS + 1), "regex")


def test_one_constraint_compiles_once_however_many_ask_and_the_cache_is_bounded_in_bytes(grammars, monkeypatch):
    """Requests that bring one new schema at once share its compile (four compiled it
    four times, each a thread of the worker's); compiled grammars are kept within
    CACHE_BYTES (xgrammar's own cache kept every one: 3.8 GB for 400 schemas)."""
    from services.engine import structured
    tokenizer = grammars[0]
    compiled = Grammars(lambda: tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
    compiles = []
    original = compiled._compile

    def counted(*args):
        compiles.append(args[0])
        time.sleep(0.3)
        return original(*args)
    monkeypatch.setattr(compiled, "_compile", counted)
    with ThreadPoolExecutor(4) as pool:
        found = list(pool.map(lambda _: compiled.compile("[a-z]{3}[0-9]", "regex"), range(4)))
    assert len(compiles) == 1 and all(f is found[0] for f in found)
    monkeypatch.setattr(structured, "CACHE_BYTES", found[0].memory_size_bytes * 2)
    for i in range(6):
        compiled.compile(f"[a-z]{{{i + 1}}}", "regex")
    assert 1 <= len(compiled._cache) <= 3                # the newest is kept, whatever its size
    assert compiled._cached_bytes <= structured.CACHE_BYTES or len(compiled._cache) == 1


def test_a_grammar_too_costly_to_follow_ends_its_sequence_with_its_error(grammars, monkeypatch):
    """An ambiguous grammar costs more with every token (1.1 s a token after 125 of
    this one), and every sequence of a step waits for its mask: past TOKEN_SECONDS for a
    token the grammar's rows allow none (the sequence ends: sampler.NO_TOKEN), and the
    worker answers with this error, the grammar's code."""
    import torch
    import xgrammar as xgr

    from services.engine import structured
    from services.worker.main import no_token_error
    from services.engine.core.sampling import SamplingParams
    tokenizer, compiled = grammars
    ambiguous = 'root ::= s\ns ::= s s | "a" | ""'
    constraint = compiled.constraint(ambiguous, "grammar")
    mask = xgr.allocate_token_bitmask(1, len(tokenizer))
    assert constraint.fill(mask, 0) and int(mask.count_nonzero()) > 0 and constraint.failure is None
    monkeypatch.setattr(structured, "TOKEN_SECONDS", 0.0)          # each token now over the budget
    assert constraint.fill(mask, 0) and int(mask.count_nonzero()) == 0
    error = no_token_error(SamplingParams(max_tokens=4, grammar=ambiguous), constraint, 3)
    assert isinstance(error, SchemaError) and error.code == "invalid_grammar" and "too costly" in str(error)
    assert torch.equal(mask, torch.zeros_like(mask))


def _client(http: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http}/v1", api_key="unused", max_retries=0, timeout=120)


def test_vllms_structured_outputs_over_chat_and_completions(cluster):
    """Each kind, asked at once through the official client's extra_body, in vLLM's
    current spelling and its earlier one: every output is what its constraint allows."""
    client = _client(cluster.http)
    ask = [{"role": "user", "content": "Which city is the capital of France?"}]
    chat = lambda body, **kw: client.chat.completions.create(  # noqa: E731
        model=MODEL, messages=ask, max_tokens=20, temperature=0, extra_body=body, **kw)
    complete = lambda body: client.completions.create(  # noqa: E731
        model=MODEL, prompt="My phone number is", max_tokens=20, temperature=0, extra_body=body)
    with ThreadPoolExecutor(12) as pool:
        asked = [pool.submit(chat, {"structured_outputs": {"choice": CITIES}}),
                 pool.submit(chat, {"guided_choice": CITIES}, stream=True),
                 pool.submit(complete, {"structured_outputs": {"regex": PHONE}}),
                 pool.submit(complete, {"guided_regex": PHONE, "guided_decoding_backend": "xgrammar"}),
                 pool.submit(chat, {"structured_outputs": {"grammar": YES_NO}}),
                 pool.submit(chat, {"guided_json": {"type": "object", "properties": {"city": {"enum": CITIES}},
                                                    "required": ["city"]}}),
                 pool.submit(chat, {"structured_outputs": {"json_object": True}}),
                 pool.submit(complete, {"structured_outputs": {"json": json.dumps({"type": "integer"})}}),
                 pool.submit(complete, {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
                     "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                     "required": ["a"], "additionalProperties": False}}}}),
                 pool.submit(chat, {"response_format": {"type": "structural_tag", "format": ANSWER}}),
                 pool.submit(chat, {"response_format": {"type": "structural_tag", **CALL_F}}),
                 pool.submit(chat, {"structured_outputs": {"structural_tag": json.dumps(CALL_F)}})]
        choice, streamed, phone, guided_phone, yes_no, city, obj, number, completed_obj, answer, *calls = \
            (f.result() for f in asked)
    assert choice.choices[0].message.content in CITIES and choice.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) in CITIES
    for r in (phone, guided_phone):
        assert re.fullmatch(PHONE, r.choices[0].text) and r.choices[0].finish_reason == "stop", r
    assert yes_no.choices[0].message.content in ("yes.", "no.")
    assert json.loads(city.choices[0].message.content)["city"] in CITIES
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    assert isinstance(json.loads(number.choices[0].text), int)
    assert json.loads(completed_obj.choices[0].text)["a"] in range(10)
    assert answer.choices[0].message.content in ('<answer>"yes"</answer>', '<answer>"no"</answer>')
    for said in calls:                          # free text, and a call once the trigger comes
        text = said.choices[0].message.content
        assert "<function=" not in text or re.search(r'<function=f>\{"a": -?[0-9]+\}</function>', text), text


@pytest.mark.parametrize("body, param, code", [
    # refused by the worker, which compiles them: named by the field all the same
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex", "invalid_regex"),
    ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar", "invalid_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {   # met by {}; no grammar
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}}}}},
     "response_format.json_schema.schema", "invalid_json_schema"),
    ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs.structural_tag",
     "invalid_structural_tag"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", None),
    ({"guided_choice": ["a", ""]}, "guided_choice", None),
    ({"guided_choice": [f"choice {i:05}" for i in range(6000)]}, "guided_choice", None),   # past 64 KiB
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice", None),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", None),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "invalid_json_schema"),
    ({"structured_outputs": {"whitespace_pattern": " *"}}, "structured_outputs.whitespace_pattern", None),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", None),
    ({"response_format": {"type": "structural_tag"}}, "response_format", None),
    ({"structured_outputs": {"structural_tag": '{"structures": [{"begin": "<"}], "triggers": ["<"]}'}},
     "structured_outputs.structural_tag", "invalid_structural_tag"),
])
def test_structured_outputs_that_cannot_be_met_are_400s(cluster, body, param, code):
    r = httpx.post(f"{cluster.http}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param is None or err["param"] == param, err
    assert code is None or err["code"] == code, err


def test_grpc_takes_each_kind(cluster):
    def generate(**sampling) -> list:
        request = generate_pb2.GenerateRequest(prompt="My phone number is", sampling=generate_pb2.SamplingParams(
            max_tokens=20, temperature=0, **sampling))
        with grpc.insecure_channel(cluster.grpc.removeprefix("http://")) as ch:
            return list(generate_pb2_grpc.GeneratorStub(ch).Generate(request, timeout=120))
    assert re.fullmatch(PHONE, "".join(m.text for m in generate(regex=PHONE)))
    assert "".join(m.text for m in generate(choice=CITIES)) in CITIES
    assert "".join(m.text for m in generate(grammar=YES_NO)) in ("yes.", "no.")
    for wrong in ({"grammar": 'root ::= "a" |'}, {"regex": "a", "choice": ["a"]}):
        with pytest.raises(grpc.RpcError) as exc:
            generate(**wrong)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details()
