"""What real clients send, through the real cluster (float32, greedy): every OpenAI
shape of a completions prompt (batches and token ids, as evaluation harnesses send
them), vLLM's request extensions checked against their definitions, /tokenizer_info,
and the Responses API with the official `openai` client (and the Agents SDK where it is
installed)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from services.engine.text.tokenizer import encode_chat, token_bytes

MODEL = "SmolLM2-135M-Instruct"
EOS = 2                                         # <|im_end|>
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time, in a land far"]


def _client(http: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http}/v1", api_key="unused", max_retries=0, timeout=120)


def _post(http: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{http}{path}", json=body, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from services.engine.text.tokenizer import load_tokenizer
    return load_tokenizer(model_dir)


def _complete(http: str, **body) -> dict:
    r = _post(http, "/v1/completions", {"max_tokens": 6, "temperature": 0, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _streamed(http: str, **body) -> dict[int, dict]:
    """Each choice of a streamed completion: its text, token ids and finish reason."""
    out: dict[int, dict] = {}
    body = {"max_tokens": 6, "temperature": 0, "return_token_ids": True, "stream": True, **body}
    with httpx.stream("POST", f"{http}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                got = out.setdefault(c["index"], {"text": "", "token_ids": [], "finish_reason": None})
                got["text"] += c["text"]
                got["token_ids"] += c.get("token_ids") or []
                got["finish_reason"] = got["finish_reason"] or c["finish_reason"]
                if c["finish_reason"]:
                    got["stop_reason"] = c["stop_reason"]
    return out


# ---- prompt shapes ----

def test_every_prompt_shape_answers_as_its_prompts_sent_one_at_a_time(cluster):
    """A string, a list of strings (n 1), a list of token ids and a list of token-id
    lists (n 2), streamed and not: choice index = prompt x n + choice, usage summed, and
    every choice token for token what its prompt alone gives."""
    http = cluster.http
    with ThreadPoolExecutor(6) as pool:             # each batch at once: each answer is checked on its own
        alone = list(pool.map(lambda p: _complete(http, prompt=p), PROMPTS))
        ids = [a["choices"][0]["prompt_token_ids"] for a in alone]
        want = [(a["choices"][0]["text"], a["choices"][0]["token_ids"]) for a in alone]
        shapes = ((PROMPTS, 1), (ids, 2))                   # strings one choice each, ids two
        asked = [(n, pool.submit(_complete, http, prompt=prompt, n=n), pool.submit(_streamed, http, prompt=prompt, n=n))
                 for prompt, n in shapes]
        one, listed = pool.submit(_complete, http, prompt=ids[1]), pool.submit(_complete, http, prompt=[PROMPTS[2]])
        for n, whole, streamed in asked:
            r, streamed = whole.result(), streamed.result()
            assert [c["index"] for c in r["choices"]] == list(range(len(PROMPTS) * n))
            assert [(c["text"], c["token_ids"]) for c in r["choices"]] == [w for w in want for _ in range(n)]
            assert [c["prompt_token_ids"] for c in r["choices"]] == [i for i in ids for _ in range(n)]
            assert r["usage"]["prompt_tokens"] == sum(map(len, ids))
            assert r["usage"]["completion_tokens"] == n * sum(len(t) for _, t in want)
            assert [(streamed[i]["text"], streamed[i]["token_ids"]) for i in sorted(streamed)] == \
                [w for w in want for _ in range(n)]
        one = one.result()                                   # a list of ids is one prompt
        assert (one["choices"][0]["text"], one["choices"][0]["token_ids"]) == want[1]
        assert one["prompt_token_ids"] == ids[1]
        assert listed.result()["choices"][0]["token_ids"] == want[2][1]


def test_a_batch_scores_prompts_as_evaluation_harnesses_ask(cluster):
    """lm-eval's loglikelihood request: token-id lists, echo, logprobs 1, max_tokens 1;
    each prompt's logprobs those of the prompt sent alone."""
    http = cluster.http
    ids = [_complete(http, prompt=p)["choices"][0]["prompt_token_ids"] for p in PROMPTS]
    body = {"echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}
    batch = _post(http, "/v1/completions", {"prompt": ids, **body}).json()["choices"]
    for i, prompt in enumerate(ids):
        alone = _post(http, "/v1/completions", {"prompt": [prompt], **body}).json()["choices"][0]
        got = batch[i]["logprobs"]
        assert got["tokens"] == alone["logprobs"]["tokens"] and len(got["tokens"]) == len(prompt) + 1
        assert got["token_logprobs"][0] is None
        assert got["token_logprobs"][1:] == pytest.approx(alone["logprobs"]["token_logprobs"][1:], abs=1e-4)
        assert batch[i]["text"] == alone["text"]


@pytest.mark.parametrize("prompt, message", [
    (5, "prompt: must be a string, a list of strings, a list of token ids, or a list of token-id lists"),
    (["a", 1], "prompt: must be a string, a list of strings"),
    ([[1], ["a"]], "prompt: must be a string"),
    ([True], "prompt: must be a string"),
    ([], "prompt: must not be empty"),
    (["a", ""], "prompt: the list's prompt 1 is empty"),
    ([[1], []], "prompt: the list's prompt 1 is empty"),
])
def test_a_bad_prompt_is_told_the_shapes_accepted(cluster, prompt, message):
    r = _post(cluster.http, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), r.text
    assert r.json()["error"]["param"] == "prompt"


def test_a_batchs_bad_prompt_is_named_by_its_place(cluster):
    r = _post(cluster.http, "/v1/completions", {"prompt": [[1, 2], [3, 49152]], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt.1", r.text


# ---- vLLM's extensions ----

CHAT = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a planet."}]


def _chat(http: str, **body) -> dict:
    r = _post(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 24, "temperature": 0,
                                             "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_continuous_usage_counts_the_tokens_sent_so_far(cluster):
    """stream_options.continuous_usage_stats (vLLM's): every chunk's usage counts its own
    choice's prompt and the output tokens it sent up to and with it, as vLLM's does
    (n > 1, several prompts): none on the role chunk before the first token (guidellm
    sends the option), then one more a token; the last usage is the request's total."""
    for path, body in (("/v1/chat/completions", {"messages": CHAT, "n": 2}),
                       ("/v1/completions", {"prompt": ["Count: 1,", "Say"]})):
        body = {**body, "max_tokens": 5, "ignore_eos": True, "temperature": 0.5, "seed": 1, "return_token_ids": True,
                "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        sent, seen, prompts, total = {0: 0, 1: 0}, [], {0: set(), 1: set()}, None
        with httpx.stream("POST", f"{cluster.http}{path}", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if not event["choices"]:
                    total = event["usage"]
                    continue
                (choice,) = event["choices"]
                i = choice["index"]
                sent[i] += len(choice.get("token_ids") or [])
                seen.append((i, event["usage"]["completion_tokens"], sent[i]))
                prompts[i].add(event["usage"]["prompt_tokens"])
        assert all(counted == sent for _, counted, sent in seen), (path, seen)
        assert sent == {0: 5, 1: 5} and total["completion_tokens"] == 10, (path, seen, total)
        assert all(len(p) == 1 for p in prompts.values()), prompts
        assert total["prompt_tokens"] == sum(min(p) for p in prompts.values()) // (2 if "n" in body else 1)
        if path == "/v1/chat/completions":
            assert [s for s in seen if s[0] == 0][0][1:] == (0, 0) and prompts[0] == prompts[1]
        else:
            assert prompts[0] != prompts[1]


def test_an_answer_sent_back_as_the_client_dumps_it_and_openais_null_fields(cluster):
    """`message.model_dump()` of an answer carries OpenAI's fields pdserve does not make
    (`refusal`, `audio`, `function_call`, `annotations`, null): sent back as history, it
    reads as the message itself. OpenAI's options that ask nothing of a text model
    (`store: false`, `modalities: ["text"]`, `metadata`, `service_tier`), null
    `suffix`, and `reasoning_effort` (a variable of the template, as vLLM passes it,
    which SmolLM2's does not read) answer as without them."""
    client = _client(cluster.http)
    history = [{"role": "user", "content": "Name a colour."}]
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=5, temperature=0)
    dumped = first.choices[0].message.model_dump()
    assert {"refusal", "audio", "function_call", "annotations"} <= set(dumped)
    turn = [*history, dumped, {"role": "user", "content": "Another one."}]
    plain = [*history, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Another one."}]
    asked = dict(model=MODEL, max_tokens=5, temperature=0)
    again = client.chat.completions.create(messages=turn, store=False, modalities=["text"],
                                           metadata={"team": "a"}, service_tier="auto", reasoning_effort="low",
                                           **asked)
    assert again.choices[0].message.content == client.chat.completions.create(messages=plain, **asked) \
        .choices[0].message.content
    assert _complete(cluster.http, prompt=PROMPTS[0], suffix=None)["choices"][0]["text"] == \
        _complete(cluster.http, prompt=PROMPTS[0])["choices"][0]["text"]
    from services.router.protocol import ChatCompletionRequest
    req = ChatCompletionRequest(messages=history, reasoning_effort="high", chat_template_kwargs={"x": 1})
    assert req.template_kwargs() == {"reasoning_effort": "high", "x": 1}
    wrong = _post(cluster.http, "/v1/chat/completions", {"messages": history, "reasoning_effort": "extreme"})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "reasoning_effort", wrong.text


def test_text_parts_of_every_kind_a_client_sends_back_read_as_text(cluster):
    """Parts the SDKs' types allow in a conversation sent back: a `refusal` part of an
    assistant's, `input_text` and `output_text` parts in chat messages, a refusal in a
    Responses output message. Each reads as its text, as vLLM reads them, where they
    were refused as not text; a conversation with nothing left in it names the field
    the caller sent."""
    refused = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
               {"role": "user", "content": [{"type": "input_text", "text": "ok"}]}]
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "I can't."},
             {"role": "user", "content": "ok"}]
    answers = [_post(cluster.http, "/v1/chat/completions", {"messages": m, "max_tokens": 4, "temperature": 0})
               for m in (refused, plain)]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    assert answers[0].json()["choices"][0]["message"] == answers[1].json()["choices"][0]["message"]
    # several text parts of a message read as one text, a part a line, as vLLM joins them
    parts = [{"role": "user", "content": [{"type": "text", "text": "Summarize this:"},
                                          {"type": "text", "text": "The cat sat."}]}]
    lines = [{"role": "user", "content": "Summarize this:\nThe cat sat."}]
    tokens = [_post(cluster.http, "/tokenize", {"messages": m}).json()["tokens"] for m in (parts, lines)]
    assert tokens[0] == tokens[1]
    back = _post(cluster.http, "/v1/responses", {"max_output_tokens": 2, "input": [
        {"role": "user", "content": "Hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        {"role": "user", "content": "ok"}]})
    assert back.status_code == 200, back.text
    empty = _post(cluster.http, "/v1/responses", {"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]})
    assert empty.status_code == 400 and empty.json()["error"]["message"] == "input: must not be empty", empty.text

def test_chat_logprobs_bytes_of_a_split_character_are_its_own(cluster, tokenizer):
    """日 is three tokens, each a piece of its UTF-8 that shows as U+FFFD alone (as in
    vLLM); each piece's `bytes` are its own, not U+FFFD's, so a client can join them
    (what OpenAI's `bytes` are for)."""
    pieces = tokenizer.encode("日", add_special_tokens=False)
    assert len(pieces) > 1 and all("\ufffd" in tokenizer.decode([t]) for t in pieces)
    r = _post(cluster.http, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Write 日."}], "max_tokens": len(pieces), "temperature": 0,
        "logprobs": True, "top_logprobs": 2, "allowed_token_ids": pieces, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"]) == len(pieces)
    for entry, token in zip(content, choice["token_ids"]):
        assert entry["token"] == "\ufffd" and bytes(entry["bytes"]) == token_bytes(tokenizer, token, "\ufffd")
        for top in entry["top_logprobs"]:
            assert bytes(top["bytes"]) != "\ufffd".encode(), top


def test_ignore_eos_and_min_tokens_as_vllm_defines_them(cluster):
    """ignore_eos: EOS is sampled like any token and the output goes on to max_tokens;
    min_tokens: EOS cannot come before that many tokens."""
    base = _chat(cluster.http)["choices"][0]
    k = len(base["token_ids"]) - 1
    assert base["finish_reason"] == "stop" and base["token_ids"][-1] == EOS and k < 16
    ignored = _chat(cluster.http, ignore_eos=True)["choices"][0]
    assert ignored["finish_reason"] == "length" and len(ignored["token_ids"]) == 24
    assert ignored["token_ids"][:k + 1] == base["token_ids"]         # the EOS itself, then more
    held = _chat(cluster.http, min_tokens=k + 3)["choices"][0]
    assert held["token_ids"][:k] == base["token_ids"][:k] and EOS not in held["token_ids"][:k + 3]
    assert len(held["token_ids"]) >= k + 4 or held["finish_reason"] == "length"


def test_stop_strings_wait_for_min_tokens_as_vllm_does(cluster, tokenizer):
    """vLLM looks for stop strings only once min_tokens tokens are out: a stop string in
    the first tokens passes, and the output goes on to the next one after them."""
    ids = _chat(cluster.http, ignore_eos=True)["choices"][0]["token_ids"]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    word = next(w for w in text.split() if w.isalpha() and len(w) > 2)         # in its first words
    early = _chat(cluster.http, ignore_eos=True, stop=[word])["choices"][0]
    assert early["finish_reason"] == "stop" and word not in early["message"]["content"]
    late = _chat(cluster.http, ignore_eos=True, stop=[word], min_tokens=len(early["token_ids"]) + 1)["choices"][0]
    assert late["message"]["content"].startswith(early["message"]["content"] + word)
    assert len(late["token_ids"]) > len(early["token_ids"])


def test_special_tokens_in_the_text_and_the_stop_string_kept(cluster, tokenizer):
    """skip_special_tokens: false writes special tokens out; a stop token ends the text
    before it unless include_stop_str_in_output (vLLM's detokenizer);
    spaces_between_special_tokens reaches the decode (a fast tokenizer ignores it)."""
    http = cluster.http
    prompt = {"prompt": "Count with me: 1, 2, 3,", "max_tokens": 12, "stop": [","]}
    with ThreadPoolExecutor(9) as pool:             # all at once: each is checked on its own
        asked = [pool.submit(_chat, http, ignore_eos=True, max_tokens=14),
                 *(pool.submit(_chat, http, ignore_eos=True, skip_special_tokens=False, max_tokens=14,
                               spaces_between_special_tokens=spaces) for spaces in (True, False)),
                 pool.submit(_chat, http, skip_special_tokens=False),
                 pool.submit(_chat, http, skip_special_tokens=False, include_stop_str_in_output=True),
                 pool.submit(_complete, http, **prompt),
                 pool.submit(_complete, http, **prompt, include_stop_str_in_output=True),
                 pool.submit(_streamed, http, **prompt, include_stop_str_in_output=True),
                 pool.submit(_complete, http, prompt=prompt["prompt"], max_tokens=6)]
        plain, *shown, ended, kept, cut, with_stop, streamed, free = (f.result() for f in asked)
    ids = plain["choices"][0]["token_ids"]
    for spaces, answer in zip((True, False), shown):
        choice = answer["choices"][0]
        assert choice["token_ids"] == ids
        assert choice["message"]["content"] == tokenizer.decode(ids, skip_special_tokens=False,
                                                                spaces_between_special_tokens=spaces)
        assert "<|im_end|>" in choice["message"]["content"]
    ended, kept = ended["choices"][0], kept["choices"][0]
    assert ended["token_ids"][-1] == EOS and "<|im_end|>" not in ended["message"]["content"]
    assert kept["message"]["content"] == ended["message"]["content"] + "<|im_end|>"
    # a stop string: left out, or kept with include_stop_str_in_output, streamed or not
    cut, with_stop, streamed = cut["choices"][0], with_stop["choices"][0], streamed[0]
    assert cut["finish_reason"] == with_stop["finish_reason"] == "stop" and "," not in cut["text"]
    assert cut["stop_reason"] == "," and ended["stop_reason"] is None        # vLLM's: what stopped it; EOS: null
    assert with_stop["text"] == cut["text"] + "," and with_stop["token_ids"] == cut["token_ids"]
    assert streamed["text"] == with_stop["text"] and streamed["stop_reason"] == ","
    # a stop token that is no special token: in token_ids, its text only with include_stop_str_in_output
    free = free["choices"][0]
    comma = free["token_ids"][next(i for i, t in enumerate(free["token_ids"]) if "," in tokenizer.decode([t]))]
    by_token = _complete(http, prompt=prompt["prompt"], max_tokens=6, stop_token_ids=[comma])["choices"][0]
    assert by_token["token_ids"][-1] == comma and by_token["finish_reason"] == "stop"
    assert by_token["stop_reason"] == comma
    assert by_token["text"] == tokenizer.decode(by_token["token_ids"][:-1])
    kept_token = _complete(http, prompt=prompt["prompt"], max_tokens=6, stop_token_ids=[comma],
                           include_stop_str_in_output=True)["choices"][0]
    assert kept_token["text"] == tokenizer.decode(by_token["token_ids"])
    assert _streamed(http, prompt=prompt["prompt"], max_tokens=6, stop_token_ids=[comma])[0]["text"] == \
        by_token["text"]


def test_chat_template_options(cluster, tokenizer):
    """add_generation_prompt, continue_final_message, add_special_tokens and
    chat_template_kwargs, as the template renders them; vLLM's echo puts the assistant
    message continued before the answer, whole and streamed."""
    http = cluster.http
    start = [*CHAT, {"role": "assistant", "content": "The planet is"}]
    r = _chat(http, messages=start, add_generation_prompt=False, continue_final_message=True, max_tokens=3)
    assert r["prompt_token_ids"] == encode_chat(tokenizer, start, add_generation_prompt=False,
                                                continue_final_message=True)
    assert tokenizer.decode(r["prompt_token_ids"]).endswith("The planet is")
    continued = r["choices"][0]["message"]["content"]
    echoed = _chat(http, messages=start, add_generation_prompt=False, continue_final_message=True, max_tokens=3,
                   echo=True)
    assert echoed["choices"][0]["message"]["content"] == "The planet is" + continued
    assert echoed["usage"]["completion_tokens"] == r["usage"]["completion_tokens"]    # the echo is no output
    with httpx.stream("POST", f"{http}/v1/chat/completions", timeout=120, json={
            "messages": start, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 3,
            "temperature": 0, "echo": True, "stream": True}) as s:
        deltas = [json.loads(line[6:])["choices"] for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(c[0]["delta"].get("content") or "" for c in deltas if c) == "The planet is" + continued
    assert _chat(http, max_tokens=1, echo=True)["choices"][0]["message"]["content"] == \
        _chat(http, max_tokens=1)["choices"][0]["message"]["content"]     # the last message is the user's
    assert _chat(http, max_tokens=1, add_special_tokens=True)["prompt_token_ids"] == \
        encode_chat(tokenizer, CHAT, add_special_tokens=True)
    for special in (True, False):                              # completions' (default true)
        assert _complete(http, prompt="Hello", add_special_tokens=special)["choices"][0]["prompt_token_ids"] == \
            tokenizer.encode("Hello", add_special_tokens=special)
    bare = _chat(http, add_generation_prompt=False, max_tokens=1)["prompt_token_ids"]
    assert bare == encode_chat(tokenizer, CHAT, add_generation_prompt=False)
    # kwargs are the template's variables; this template reads none of them (as vLLM,
    # one it does not read changes nothing), and they may set the two options above
    assert _chat(http, max_tokens=1, chat_template_kwargs={"enable_thinking": False})["prompt_token_ids"] == \
        _chat(http, max_tokens=1)["prompt_token_ids"]
    assert _chat(http, max_tokens=1, chat_template_kwargs={"add_generation_prompt": False})["prompt_token_ids"] \
        == bare
    tokenized = _post(http, "/tokenize", {"messages": start, "add_generation_prompt": False,
                                          "continue_final_message": True}).json()["tokens"]
    assert tokenized == r["prompt_token_ids"]
    for body, param in [({"messages": start, "continue_final_message": True}, "continue_final_message"),
                        ({"messages": CHAT, "chat_template_kwargs": {"tokenize": True}},
                         "chat_template_kwargs.tokenize"),
                        ({"messages": CHAT, "chat_template_kwargs": {"conversation": []}},
                         "chat_template_kwargs.conversation"),
                        ({"messages": CHAT, "chat_template_kwargs": []}, "chat_template_kwargs")]:
        refused = _post(http, "/v1/chat/completions", body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text


def test_a_developer_message_is_a_system_message_to_a_template_without_the_role(cluster, tokenizer):
    """OpenAI's `developer` role is its `system` role renamed; the default template has
    no such role (it would write a `developer` turn and add its default system prompt)."""
    def ids(role: str) -> list[int]:
        r = _post(cluster.http, "/tokenize", {"messages": [{"role": role, "content": "Answer in French."},
                                                           {"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]
    assert "developer" not in tokenizer.chat_template
    assert ids("developer") == ids("system")


def test_a_template_variable_from_chat_template_kwargs(tokenizer):
    import copy
    tok = copy.copy(tokenizer)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}")
    text = tok.decode(encode_chat(tok, CHAT, template_kwargs={"enable_thinking": False}))
    assert text.endswith("/no_think") and not tok.decode(encode_chat(tok, CHAT)).endswith("/no_think")


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(cluster):
    http = cluster.http
    full = _complete(http, prompt=PROMPTS[2])
    ids = full["choices"][0]["prompt_token_ids"]
    cut = _complete(http, prompt=PROMPTS[2], truncate_prompt_tokens=4)
    assert cut["prompt_token_ids"] == ids[-4:] and cut["usage"]["prompt_tokens"] == 4
    assert cut["choices"][0]["token_ids"] == _complete(http, prompt=ids[-4:])["choices"][0]["token_ids"]
    assert _complete(http, prompt=PROMPTS[2], truncate_prompt_tokens=-1)["choices"][0]["token_ids"] == \
        full["choices"][0]["token_ids"]
    chat = _chat(http, truncate_prompt_tokens=5, max_tokens=1)
    assert chat["prompt_token_ids"] == _chat(http, max_tokens=1)["prompt_token_ids"][-5:]
    for value in (0, -2, 10**6):
        r = _post(http, "/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_prompt_logprobs_as_vllm_returns_them(cluster):
    """Per prompt token after the first: the token's log probability (the one echo with
    logprobs gives, checked against transformers in test_api_features) and the k likeliest,
    by token id, with rank and text; on each completions choice, at the top of a chat
    response; not when streamed."""
    http = cluster.http
    echoed = _post(http, "/v1/completions", {"prompt": PROMPTS[0], "echo": True, "logprobs": 3, "max_tokens": 1,
                                             "temperature": 0}).json()["choices"][0]["logprobs"]
    r = _complete(http, prompt=PROMPTS[0], prompt_logprobs=2, max_tokens=1)
    ids = r["choices"][0]["prompt_token_ids"]
    got = r["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for i, (token, entry) in enumerate(zip(ids[1:], got[1:]), 1):
        assert entry[str(token)]["logprob"] == pytest.approx(echoed["token_logprobs"][i], abs=1e-4)
        tops = sorted(((v["rank"], v["logprob"]) for v in entry.values() if v["rank"] is not None))
        assert [rank for rank, _ in tops] == [1, 2]
        assert [lp for _, lp in tops] == pytest.approx(sorted(echoed["top_logprobs"][i].values(),
                                                              reverse=True)[:2], abs=1e-4)
        assert all(v["decoded_token"] for v in entry.values()) and 2 <= len(entry) <= 3
    chat = _chat(http, prompt_logprobs=0, max_tokens=1)
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(chat["prompt_token_ids"])
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    for body in ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, {"prompt": "hi", "prompt_logprobs": 21}):
        refused = _post(http, "/v1/completions", body)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    # gRPC: the same figures in choice 0's first message (and no other), n = 2 too.
    import grpc
    from services.rpc import generate_pb2, generate_pb2_grpc
    with grpc.insecure_channel(cluster.grpc) as ch:
        replies = list(generate_pb2_grpc.GeneratorStub(ch).Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=generate_pb2.TokenIds(ids=ids), n=2,
            sampling=generate_pb2.SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)), timeout=60))
    scored = [m for m in replies if m.prompt_logprobs]
    assert len(scored) == 1 and scored[0].index == 0 and scored[0] is next(m for m in replies if m.index == 0)
    assert [p.token_id for p in scored[0].prompt_logprobs] == ids[1:]
    for p, entry in zip(scored[0].prompt_logprobs, got[1:]):
        assert p.logprob == pytest.approx(entry[str(p.token_id)]["logprob"], abs=1e-4) and len(p.top_ids) == 2


def test_allowed_token_ids_and_bad_words(cluster, tokenizer):
    """allowed_token_ids: only those are sampled, the likeliest of them when greedy;
    bad_words: the output never holds a word's tokens (with or without its leading
    space), whatever it would have said."""
    http = cluster.http
    base = _complete(http, prompt=PROMPTS[0], max_tokens=8, logprobs=20)["choices"][0]
    # The greedy tokens allowed (and some others): the same output.
    allowed = sorted(set(base["token_ids"]) | {100, 200, 300})
    assert _complete(http, prompt=PROMPTS[0], max_tokens=8, allowed_token_ids=allowed)["choices"][0]["token_ids"] \
        == base["token_ids"]
    # The second likeliest first token and two others: that token first, then only those.
    tops = _complete(http, prompt=PROMPTS[0], max_tokens=1, logprobs=2,
                     return_tokens_as_token_ids=True)["choices"][0]["logprobs"]["top_logprobs"][0]
    runner_up = int(sorted(tops, key=tops.get)[0].removeprefix("token_id:"))
    narrow = [runner_up, 100, 200]
    assert base["token_ids"][0] not in narrow
    out = _complete(http, prompt=PROMPTS[0], max_tokens=5, allowed_token_ids=narrow)["choices"][0]["token_ids"]
    assert out[0] == runner_up and set(out) <= set(narrow)
    for bad in ({"allowed_token_ids": []}, {"allowed_token_ids": [49152]}, {"allowed_token_ids": ["1"]}):
        r = _post(http, "/v1/completions", {"prompt": "hi", **bad})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("allowed_token_ids"), r.text
    word = base["text"].split()[0]                          # the greedy output's first word
    banned = [tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    free = _complete(http, prompt=PROMPTS[0], max_tokens=8, bad_words=[word])["choices"][0]
    assert free["token_ids"] != base["token_ids"]
    for seq in banned:
        assert not any(free["token_ids"][i:i + len(seq)] == seq for i in range(len(free["token_ids"])))
    assert _post(http, "/v1/completions", {"prompt": "hi", "bad_words": "x"}).json()["error"]["param"] == "bad_words"


def test_constraints_that_leave_no_token_are_refused_by_name(cluster, tokenizer):
    """allowed_token_ids that min_tokens or a structured output also rules out leave no
    token to sample: a 400 naming allowed_token_ids, whether the token left without one
    is the first (the prefill worker's) or a later one (the decode worker's), never a
    token none of them allows; the cluster serves on."""
    http = cluster.http
    first = _post(http, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, "min_tokens": 2,
                                            "allowed_token_ids": [EOS]})
    yes, no = tokenizer.encode("yes", add_special_tokens=False), tokenizer.encode(" no", add_special_tokens=False)
    later = _post(http, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
                                            "structured_outputs": {"choice": [tokenizer.decode(yes + no)]},
                                            "allowed_token_ids": yes})
    for r, position in ((first, 0), (later, len(yes))):
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "allowed_token_ids" and f"output token {position}" in error["message"], error
    assert _complete(http, prompt=PROMPTS[0], max_tokens=2, min_tokens=1, allowed_token_ids=[EOS, 100]
                     )["choices"][0]["token_ids"][0] == 100


def test_return_tokens_as_token_ids_names_tokens_by_id(cluster):
    http = cluster.http
    r = _complete(http, prompt=PROMPTS[0], logprobs=2, return_tokens_as_token_ids=True)["choices"][0]
    assert r["logprobs"]["tokens"] == [f"token_id:{t}" for t in r["token_ids"]]
    assert all(k.startswith("token_id:") for top in r["logprobs"]["top_logprobs"] for k in top)
    chat = _chat(http, logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True, max_tokens=4)["choices"][0]
    assert [c["token"] for c in chat["logprobs"]["content"]] == [f"token_id:{t}" for t in chat["token_ids"]]


def test_grpc_takes_allowed_token_ids_and_bad_words(cluster):
    import grpc
    from services.rpc import generate_pb2, generate_pb2_grpc
    with grpc.insecure_channel(cluster.grpc) as ch:
        stub = generate_pb2_grpc.GeneratorStub(ch)
        sampling = generate_pb2.SamplingParams(max_tokens=4, temperature=0, allowed_token_ids=[100, 200],
                                               bad_words=[generate_pb2.TokenIds(ids=[100])])
        ids = [t for m in stub.Generate(generate_pb2.GenerateRequest(prompt="Hello", sampling=sampling), timeout=60)
               for t in m.token_ids]
    assert ids == [200] * 4


# ---- /tokenizer_info ----

def test_tokenizer_info_as_vllm_serves_it(cluster, tokenizer, model_dir):
    info = httpx.get(f"{cluster.http}/tokenizer_info", timeout=30).json()
    max_model_len = httpx.get(f"{cluster.http}/v1/models").json()["data"][0]["max_model_len"]
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("<|im_end|>", "<|im_start|>", "<|im_end|>")
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] == max_model_len
    assert info["added_tokens_decoder"]["2"] == "<|im_end|>" and info["name_or_path"] == MODEL
    assert str(model_dir) not in json.dumps(info)          # the server's paths stay on it


# ---- the Responses API ----

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"], "additionalProperties": False}}
ASK = "What is the weather like in Paris today?"


def test_responses_text_is_the_chat_completions(cluster):
    """Text in, text out, whole and streamed: the same tokens as the chat API given the
    same conversation (instructions as its system message); cut by max_output_tokens,
    the response is incomplete. `reasoning.effort` goes to the chat template as the chat
    API's reasoning_effort (SmolLM2's reads none), and comes back on the response."""
    client = _client(cluster.http)
    kw = dict(model=MODEL, instructions=CHAT[0]["content"], input=CHAT[1]["content"], max_output_tokens=24,
              temperature=0)

    def streamed(**kw):
        with client.responses.stream(**kw) as stream:
            return [e for e in stream], stream.get_final_response()

    def cut_streamed():
        with client.responses.stream(model=MODEL, input=ASK, max_output_tokens=5, temperature=0) as stream:
            return [e for e in stream]
    with ThreadPoolExecutor(6) as pool:             # all at once: each is checked on its own
        asked = [pool.submit(client.chat.completions.create, model=MODEL, messages=CHAT, max_tokens=24,
                             temperature=0),
                 pool.submit(client.responses.create, **kw),
                 pool.submit(client.responses.create, model=MODEL, max_output_tokens=24, temperature=0,
                             input=[{"role": m["role"], "content": m["content"]} for m in CHAT],
                             reasoning={"effort": "low", "summary": "auto"}),
                 pool.submit(streamed, **kw),
                 pool.submit(client.responses.create, model=MODEL, input=ASK, max_output_tokens=5, temperature=0),
                 pool.submit(cut_streamed)]
        chat, r, as_items, (events, final), cut, cut_events = (f.result() for f in asked)
    assert r.status == "completed" and r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert as_items.output_text == r.output_text and as_items.reasoning.effort == "low" and r.reasoning is None
    assert not [item for item in as_items.output if item.type == "reasoning"]
    from services.router.responses import ResponsesRequest
    assert ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "xhigh"}}).to_chat() \
        .template_kwargs() == {"reasoning_effort": "xhigh"}
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * (len(events) - 8), "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == r.output_text == "".join(e.delta for e in events[4:-4])
    assert final.usage.output_tokens == r.usage.output_tokens and final.id == events[0].response.id
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut_events[-1].type == "response.incomplete" and cut_events[-1].response.status == "incomplete"
    assert "".join(e.delta for e in cut_events if e.type == "response.output_text.delta") == cut.output_text


def test_responses_function_tools(tools_router):
    """A forced call (named or required), streamed and not, with arguments that meet the
    tool's schema; then the conversation with its output goes on."""
    client = _client(tools_router)
    params = WEATHER["parameters"]

    def forced(choice):
        """Whole and streamed, at once."""
        kw = dict(model=MODEL, input=ASK, tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False,
                  max_output_tokens=60, temperature=0)

        def stream():
            with client.responses.stream(**kw) as events:
                deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
                return deltas, events.get_final_response()
        with ThreadPoolExecutor(2) as pool:
            whole, streamed = pool.submit(client.responses.create, **kw), pool.submit(stream)
            return whole.result(), *streamed.result()
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(forced, ({"type": "function", "name": "get_weather"}, "required")))
    for r, deltas, final in answers:
        (call,) = [o for o in r.output if o.type == "function_call"]
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), params)
        (streamed,) = [o for o in final.output if o.type == "function_call"]
        assert streamed.arguments == deltas == call.arguments
    # Required calls cut short before the first began: no call, and not their syntax as text.
    cut = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="required",
                                  max_output_tokens=3, temperature=0)
    assert cut.status == "incomplete" and cut.output_text == "" and not [
        o for o in cut.output if o.type == "function_call"]
    follow = client.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear", "celsius": 21}'}])
    assert follow.status in ("completed", "incomplete") and follow.output


def test_responses_take_vllms_ignore_eos(cluster):
    """`vllm bench serve --backend openai-responses` sends ignore_eos with its datasets."""
    r = _post(cluster.http, "/v1/responses", {"input": "Say hi.", "max_output_tokens": 40, "ignore_eos": True,
                                              "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["output_tokens"] == 40 and r.json()["status"] == "incomplete"


def test_responses_json_schema(cluster):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    client = _client(cluster.http)
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}}
    r = client.responses.create(model=MODEL, input="Describe a person as JSON.", text=fmt, max_output_tokens=60,
                                temperature=0)
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    with client.responses.stream(model=MODEL, input="Describe a person as JSON.", text=fmt, max_output_tokens=60,
                                 temperature=0) as stream:
        final = stream.get_final_response()
    assert final.output_text == r.output_text


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"reasoning": {"mode": "pro"}}, "reasoning.mode"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, "input"),               # prompt and output past the context
    ({"input": 5}, "input"),
])
def test_responses_refuse_by_name_what_they_cannot_do(cluster, body, param):
    r = _post(cluster.http, "/v1/responses", {"model": MODEL, "input": "hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.text
    if param == "max_output_tokens":                        # the message names this API's field too
        assert r.json()["error"]["message"].startswith("max_output_tokens must be"), r.text
    for store in (False, True):     # true, OpenAI's default, is answered unstored, as vLLM answers it
        r = _post(cluster.http, "/v1/responses", {"input": "hi", "store": store, "max_output_tokens": 1})
        assert r.status_code == 200 and r.json()["store"] is False, r.text


def test_an_agent_runs_a_tool(tools_router):
    """The OpenAI Agents SDK, one run: the model calls the tool, the agent stops on it."""
    agents = pytest.importorskip("agents")
    from agents.models.openai_responses import OpenAIResponsesModel
    agents.set_tracing_disabled(True)                       # no export to any remote service
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    model = OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=f"{tools_router}/v1", api_key="unused", max_retries=0))
    agent = agents.Agent(name="weather", instructions="Answer with the tool.", model=model, tools=[get_weather],
                         tool_use_behavior="stop_on_first_tool",
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=60, temperature=0))
    result = agents.Runner.run_sync(agent, ASK)
    assert len(calls) == 1 and result.final_output == f"sunny in {calls[0]}"


# ---- Anthropic's Messages API, with its own SDK ----

def _anthropic(http: str):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=http, api_key="unused", max_retries=0, timeout=120)


GREEDY = {"temperature": 0}                 # the SDK's newest create() names no sampling fields
PREFILL = {"role": "assistant", "content": "The planet I name is"}


def test_messages_text_is_the_chat_completions(cluster):
    """Text in, text out, whole and streamed, with Anthropic's SDK: the same tokens as the
    chat API given the same conversation (system as its system message), the prompt's
    cached tokens apart from the rest as Anthropic counts them; cut by max_tokens, or
    ended by a stop sequence, the stop reason says which; count_tokens counts the prompt;
    a last assistant message is continued, as chat's continue_final_message does; vLLM's
    ignore_eos is taken."""
    client, openai_client = _anthropic(cluster.http), _client(cluster.http)
    kw = dict(model=MODEL, system=CHAT[0]["content"], messages=[CHAT[1]], max_tokens=24, extra_body=GREEDY)

    def streamed():
        with client.messages.stream(**kw) as stream:
            return [e for e in stream], stream.get_final_message()
    with ThreadPoolExecutor(6) as pool:             # all at once: each is checked on its own
        asked = [pool.submit(openai_client.chat.completions.create, model=MODEL, messages=CHAT, max_tokens=24,
                             temperature=0),
                 pool.submit(client.messages.create, **kw),
                 pool.submit(streamed),
                 pool.submit(client.messages.create, model=MODEL, messages=[{"role": "user", "content": ASK}],
                             max_tokens=3, extra_body=GREEDY),
                 pool.submit(client.messages.create, model=MODEL, messages=[{"role": "user", "content": ASK}],
                             max_tokens=24, extra_body=GREEDY),
                 pool.submit(client.messages.count_tokens, model=MODEL, system=CHAT[0]["content"],
                             messages=[CHAT[1]]),
                 # a last assistant message is the answer's start, continued (Anthropic's prefill)
                 pool.submit(openai_client.chat.completions.create, model=MODEL, max_tokens=8, temperature=0,
                             messages=[*CHAT, PREFILL], extra_body={"add_generation_prompt": False,
                                                                     "continue_final_message": True}),
                 pool.submit(client.messages.create, **{**kw, "max_tokens": 8, "messages": [CHAT[1], PREFILL]}),
                 pool.submit(client.messages.count_tokens, model=MODEL, system=CHAT[0]["content"],
                             messages=[CHAT[1], PREFILL]),
                 # what Claude Code sends: a system message among the turns, context editing (beta)
                 pool.submit(client.messages.create, model=MODEL, max_tokens=2, messages=[
                     CHAT[1], {"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}],
                     extra_body={**GREEDY, "context_management": {"edits": [{"type": "clear_thinking_20251015"}]}}),
                 # vLLM's ignore_eos, as benchmark clients add it to every API's requests
                 pool.submit(client.messages.create, model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                             max_tokens=40, extra_body={**GREEDY, "ignore_eos": True})]
        chat, m, (events, final), cut, long, counted, chat_prefilled, prefilled, counted_prefilled, beta, endless = (
            f.result() for f in asked)
    assert endless.stop_reason == "max_tokens" and endless.usage.output_tokens == 40
    assert beta.stop_reason == "max_tokens" and m._request_id       # the SDK's request id (request-id)
    assert prefilled.content[0].text == chat_prefilled.choices[0].message.content
    assert counted_prefilled.input_tokens == chat_prefilled.usage.prompt_tokens \
        == prefilled.usage.input_tokens + prefilled.usage.cache_read_input_tokens
    text = chat.choices[0].message.content
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == text
    assert m.id.startswith("msg_") and m.role == "assistant" and m.model == MODEL
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens == counted.input_tokens
    assert m.usage.output_tokens == chat.usage.completion_tokens
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"text"} | {"content_block_delta"}     # the helper's text events beside the deltas
    assert final.content[0].text == text and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens and final.id == events[0].message.id
    # message_start comes with the first token, the prompt's cached tokens known by then
    assert events[0].message.usage.cache_read_input_tokens == final.usage.cache_read_input_tokens
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    # A stop sequence from the middle of the answer: the text before it, and which one it was.
    words = long.content[0].text.split()
    stop = words[len(words) // 2]
    ended = client.messages.create(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=24,
                                   stop_sequences=["\u00a7never", stop], extra_body=GREEDY)
    assert ended.stop_reason == "stop_sequence" and ended.stop_sequence == stop
    assert long.content[0].text.startswith(ended.content[0].text) and stop not in ended.content[0].text


def test_messages_tool_use(tools_router):
    """A forced call (one tool, or any), whole and streamed: a tool_use block whose input
    meets the tool's schema, stop reason tool_use, the stream's message_start with the
    first token (not once the call is whole); cut short by max_tokens, no block at all
    (not the calls' own syntax as text); then the conversation goes on with its
    tool_result."""
    client = _anthropic(tools_router)
    tool = {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
    kw = dict(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=[tool], max_tokens=60,
              extra_body=GREEDY)

    def forced(choice):
        def stream():
            with client.messages.stream(**kw, tool_choice=choice) as stream:
                events = list(stream)
                deltas = "".join(e.delta.partial_json for e in events
                                 if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
                final = stream.get_final_message()
                assert events[0].type == "message_start"
                assert events[0].message.usage.output_tokens <= 4 < final.usage.output_tokens, events[0]
                return deltas, final
        with ThreadPoolExecutor(2) as pool:
            whole, streamed = pool.submit(client.messages.create, **kw, tool_choice=choice), pool.submit(stream)
            return whole.result(), *streamed.result()
    with ThreadPoolExecutor(3) as pool:
        cut = pool.submit(client.messages.create, **{**kw, "max_tokens": 3}, tool_choice={"type": "any"})
        answers = list(pool.map(forced, ({"type": "tool", "name": "get_weather"},
                                         {"type": "any", "disable_parallel_tool_use": True})))
        cut = cut.result()
    assert cut.stop_reason == "max_tokens" and cut.content == []
    for m, deltas, final in answers:
        (call,) = [b for b in m.content if b.type == "tool_use"]
        assert call.name == "get_weather" and call.id.startswith("toolu_") and m.stop_reason == "tool_use"
        jsonschema.validate(call.input, WEATHER["parameters"])
        (streamed,) = [b for b in final.content if b.type == "tool_use"]
        assert streamed.input == json.loads(deltas) == call.input and final.stop_reason == "tool_use"
    follow = client.messages.create(model=MODEL, tools=[tool], max_tokens=8, extra_body=GREEDY, messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": call.id, "name": call.name,
                                           "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": '{"sky": "clear", "celsius": 21}'}]},
                                     {"type": "text", "text": "And tomorrow?"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use") and follow.content


@pytest.mark.parametrize("body, status, kind, words", [
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 10**6}, 400, "invalid_request_error", "exceed context limit"),
    ({"messages": []}, 400, "invalid_request_error", "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "'image'"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error",
     "Anthropic's own tools"),
    ({"thread": {"type": "create"}}, 400, "invalid_request_error", "whole history"),
    ({"tool_choice": {"type": "tool"}}, 400, "invalid_request_error", "tool_choice"),
    ({"mcp_servers": [{"type": "url", "url": "https://example.com"}]}, 400, "invalid_request_error", "mcp_servers"),
    ({"stop_sequences": ["x"] * 100}, 400, "invalid_request_error", "stop_sequences"),
    ({"model": "claude-opus-4"}, 404, "not_found_error", "claude-opus-4"),
])
def test_messages_errors_are_anthropics(cluster, body, status, kind, words):
    """Each refusal is Anthropic's error object, its type by status, naming what is wrong;
    the SDK raises its own error class for it."""
    anthropic = pytest.importorskip("anthropic")
    request = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **body}
    request = {k: v for k, v in request.items() if v is not None}
    r = _post(cluster.http, "/v1/messages", request)
    assert r.status_code == status, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind and words in r.json()["error"]["message"]
    if "thread" in body:            # what the SDK's tool runner reads to send the whole history instead
        assert r.json()["error"]["details"] == {"error_code": "thread_unsupported_request", "unsupported": ["thread"]}
    if "max_tokens" not in request:                 # the SDK itself requires it
        return
    named = {k: request.pop(k) for k in ("model", "max_tokens", "messages")}
    with pytest.raises(anthropic.APIStatusError) as e:
        _anthropic(cluster.http).messages.create(**named, extra_body=request)
    assert e.value.status_code == status and e.value.body["error"]["type"] == kind


def test_a_first_token_that_ends_the_output_goes_out_with_its_end(cluster):
    """The prefill worker's first token is sent ahead of the decode stream; one that
    ends the output (a stop token id) went out as text of its own, before the end that
    said it was a stop: its text reached the client and stop_reason was null. It now
    goes out with the end: no text, stop_reason its id, streamed or not."""
    first = _complete(cluster.http, prompt=PROMPTS[0], max_tokens=1)["choices"][0]["token_ids"][0]
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stop_token_ids": [first]}
    whole = _complete(cluster.http, **body)["choices"][0]
    assert whole["finish_reason"] == "stop" and whole["stop_reason"] == first and whole["text"] == "", whole
    streamed = _streamed(cluster.http, **body)[0]
    assert (streamed["text"], streamed["finish_reason"], streamed["stop_reason"]) == ("", "stop", first), streamed
