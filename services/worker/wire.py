"""Conversions between wire messages and engine dataclasses, in one place."""
from __future__ import annotations

from services.engine.sampling import SamplingParams
from services.rpc import generate_pb2


def sampling_to_proto(p: SamplingParams) -> generate_pb2.SamplingParams:
    return generate_pb2.SamplingParams(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
        seed=p.seed, stop=list(p.stop), ignore_eos=p.ignore_eos, min_tokens=p.min_tokens)


def sampling_from_proto(m: generate_pb2.SamplingParams) -> SamplingParams:
    """For messages the router built (every field resolved)."""
    return SamplingParams(
        max_tokens=m.max_tokens, temperature=m.temperature, top_p=m.top_p, top_k=m.top_k,
        seed=m.seed, stop=tuple(m.stop), ignore_eos=m.ignore_eos, min_tokens=m.min_tokens)


def check_tokens(token_ids, vocab_size: int, what: str = "prompt") -> list[int]:
    """Token ids from the wire as a list, each one the model can embed; ValueError otherwise
    (an id past the embedding table would fail the whole batch's forward pass)."""
    ids = list(token_ids)
    if not ids:
        raise ValueError(f"the {what} is empty")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{what} token id {bad} is outside the model's vocabulary [0, {vocab_size})")
    return ids


def check_request_id(request_id: str) -> str:
    if not request_id or len(request_id) > MAX_REQUEST_ID:
        raise ValueError(f"request_id must be 1 to {MAX_REQUEST_ID} characters")
    return request_id


MAX_REQUEST_ID = 256
