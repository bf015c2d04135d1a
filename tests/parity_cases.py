"""Prompts for the parity tests and their expected output from `model.generate`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.text.tokenizer import encode_chat

MAX_TOKENS = 40


def _long_document() -> str:
    facts = [f"Fact {i}: the river number {i} flows {i * 3 % 17} kilometres east of the hill called "
             f"{['Ash', 'Birch', 'Cedar', 'Dune'][i % 4]}." for i in range(60)]
    return " ".join(facts) + "\nWhich hill appears most often above? Answer briefly."


@dataclass
class Case:
    name: str
    messages: list[dict]
    max_tokens: int = MAX_TOKENS
    stop: list[str] | None = None


def chat_body(case: Case, **kw) -> dict:
    """The /v1/chat/completions body that asks for `case` greedily, with its token ids."""
    body = {"messages": case.messages, "max_tokens": case.max_tokens, "temperature": 0, "return_token_ids": True}
    if case.stop:
        body["stop"] = case.stop
    return {**body, **kw}


def grpc_generate(address: str, case: Case) -> list:
    """`case` asked greedily through the gRPC Generate API at `address`: every reply."""
    import grpc

    from services.rpc import generate_pb2, generate_pb2_grpc
    req = generate_pb2.GenerateRequest(
        chat=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(**m) for m in case.messages]),
        sampling=generate_pb2.SamplingParams(max_tokens=case.max_tokens, temperature=0, stop=case.stop or []))
    with grpc.insecure_channel(address) as ch:
        return list(generate_pb2_grpc.GeneratorStub(ch).Generate(req, timeout=120))


CASES = [
    Case("short", [{"role": "user", "content": "What is the capital of France?"}]),
    Case("long", [{"role": "user", "content": _long_document()}]),
    Case("multi_turn", [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Now name a fruit of that colour."}]),
    Case("non_ascii", [{"role": "user", "content": "Traduis en français et en japonais : « Bonjour, ça va ? » 日本語 ✓"}]),
    Case("hits_max_tokens", [{"role": "user", "content": "Write a long story about a dragon and a knight."}],
         max_tokens=17),
    Case("stop_string", [{"role": "user", "content": "Count from 1 to 20, separated by commas."}], stop=["7"]),
]


@dataclass
class Expected:
    prompt_ids: list[int]
    token_ids: list[int]           # what the cluster must return
    text: str
    finish_reason: str


def generate_expected(model_dir) -> dict[str, Expected]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {}
    for case in CASES:
        ids = encode_chat(tok, case.messages)
        with torch.inference_mode():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=case.max_tokens, do_sample=False)
        toks = gen[0, len(ids):].tolist()
        finish = "stop" if toks[-1] == tok.eos_token_id else "length"
        text = tok.decode(toks, skip_special_tokens=True)
        if case.stop and any(s in text for s in case.stop):
            cut = min(text.index(s) for s in case.stop if s in text)
            text, finish = text[:cut], "stop"
            # the cluster stops at the token that completes the stop string
            n = next(k for k in range(1, len(toks) + 1)
                     if any(s in tok.decode(toks[:k], skip_special_tokens=True) for s in case.stop))
            toks = toks[:n]
        out[case.name] = Expected(ids, toks, text, finish)
    return out


