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
