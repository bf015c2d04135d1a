"""What a benchmark sends: seeded workloads of prompts whose text is exactly N tokens.

A prompt is drawn as random ids of word tokens (" river", " stone", ...), decoded to
text and re-encoded; if the text does not come back as exactly N tokens it is trimmed
or extended until it does, so the length a run reports is the length the tokenizer
sees. A server may still add its own special tokens (a BOS) on top.

Presets:
- chat: 256 tokens in, 16-256 out.
- mixed: 80 % 256 in / 128 out, 20 % 2,048 in / 32 out (exact proportions, shuffled).
- shared-prefix: a 1,024-token prefix common to every request + 64 unique tokens,
  32 out unless --output-len says otherwise.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

PRESETS = ("chat", "mixed", "shared-prefix")
WORKLOADS = ("fixed", *PRESETS)

_WORD = re.compile(r"[a-z]{3,12}")
_MAX_FIXUPS = 64


@dataclass(frozen=True)
class LengthRange:
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if self.lo < 1 or self.hi < self.lo:
            raise ValueError(f"length range {self.lo}-{self.hi} must be 1 <= lo <= hi")

    @classmethod
    def parse(cls, text: str) -> "LengthRange":
        """"256" or "16-256" (inclusive)."""
        lo, _, hi = str(text).partition("-")
        try:
            return cls(int(lo), int(hi or lo))
        except ValueError as exc:
            raise ValueError(f"bad length {text!r}: {exc}") from None

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}-{self.hi}"


@dataclass(frozen=True)
class RequestClass:
    weight: float
    input_len: LengthRange              # prompt tokens after the shared prefix
    output_len: LengthRange
    prefix_len: int = 0                 # tokens of a prefix common to the whole class

    def __str__(self) -> str:
        prefix = f"{self.prefix_len}+" if self.prefix_len else ""
        return f"{prefix}{self.input_len} in / {self.output_len} out"


@dataclass(frozen=True)
class Workload:
    name: str
    classes: tuple[RequestClass, ...]

    def __str__(self) -> str:
        if len(self.classes) == 1:
            return f"{self.name} ({self.classes[0]})"
        total = sum(c.weight for c in self.classes)
        parts = ", ".join(f"{c.weight / total:.0%} {c}" for c in self.classes)
        return f"{self.name} ({parts})"


def make_workload(name: str, input_len: str | None = None, output_len: str | None = None) -> Workload:
    """A preset, or `fixed` with the given lengths (each a number or a range LO-HI)."""
    if name == "fixed":
        return Workload(name, (RequestClass(1.0, LengthRange.parse(input_len or "256"),
                                            LengthRange.parse(output_len or "128")),))
    if name not in PRESETS:
        raise ValueError(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}")
    if input_len is not None:
        raise ValueError(f"the {name} preset fixes its input lengths; use --workload fixed --input-len")
    if name == "mixed":
        if output_len is not None:
            raise ValueError("the mixed preset fixes its output lengths; use --workload fixed --output-len")
        return Workload(name, (RequestClass(0.8, LengthRange(256, 256), LengthRange(128, 128)),
                               RequestClass(0.2, LengthRange(2048, 2048), LengthRange(32, 32))))
    if name == "chat":
        out = LengthRange.parse(output_len or "16-256")
        return Workload(name, (RequestClass(1.0, LengthRange(256, 256), out),))
    out = LengthRange.parse(output_len or "32")
    return Workload(name, (RequestClass(1.0, LengthRange(64, 64), out, prefix_len=1024),))


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int                     # tokens of `prompt`, checked by re-encoding it
    output_len: int                     # max_tokens (and min_tokens with ignore_eos)


def word_token_ids(tokenizer) -> list[int]:
    """Ids of tokens that are one ordinary lowercase word with a leading space and
    encode back to themselves; concatenated, such words keep one token each."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in ids])
    cands = [(i, t) for i, t in zip(ids, texts) if t.startswith(" ") and _WORD.fullmatch(t[1:])]
    encoded = tokenizer([t for _, t in cands], add_special_tokens=False)["input_ids"] if cands else []
    pool = [i for (i, _), enc in zip(cands, encoded) if list(enc) == [i]]
    if len(pool) < 100:
        # Tokenizers that mark word starts differently: any word token will do, the
        # re-encoding check in PromptBuilder still makes lengths exact.
        pool = [i for i, t in zip(ids, texts) if _WORD.fullmatch(t.strip())]
    if not pool:
        raise ValueError("this tokenizer has no plain word tokens to build prompts from")
    return pool


class PromptBuilder:
    """Prompt texts of exact token lengths from one tokenizer."""

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self._pool = word_token_ids(tokenizer)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def text(self, n: int, rng: random.Random, prefix: str = "") -> str:
        """`prefix` + words, together exactly n tokens, with `prefix`'s tokens intact."""
        head = self.encode(prefix) if prefix else []
        if n <= len(head):
            raise ValueError(f"a {n}-token prompt cannot hold a {len(head)}-token prefix")
        ids = [rng.choice(self._pool) for _ in range(n - len(head))]
        for _ in range(_MAX_FIXUPS):
            text = prefix + self._tok.decode(ids)
            got = self.encode(text)
            if got[:len(head)] != head:         # the words merged into the prefix: draw anew
                ids = [rng.choice(self._pool) for _ in range(n - len(head))]
            elif len(got) > n:
                del ids[max(1, len(ids) - (len(got) - n)):]
            elif len(got) < n:
                ids += [rng.choice(self._pool) for _ in range(n - len(got))]
            else:
                return text
        raise ValueError(f"could not build a prompt of exactly {n} tokens with this tokenizer")


def class_counts(weights: list[float], n: int) -> list[int]:
    """Split n requests by weight, exactly (largest remainder)."""
    total = sum(weights)
    shares = [w * n / total for w in weights]
    counts = [int(s) for s in shares]
    by_remainder = sorted(range(len(weights)), key=lambda i: shares[i] - counts[i], reverse=True)
    for i in by_remainder[:n - sum(counts)]:
        counts[i] += 1
    return counts


def build_requests(workload: Workload, builder: PromptBuilder, n: int, seed: int,
                   stream: str = "run") -> list[BenchRequest]:
    """n requests, the same for the same (workload, tokenizer, n, seed, stream). Warm-up
    requests use another `stream`, so the measured set does not depend on them; shared
    prefixes come from the seed alone, so warm-up and run share them."""
    rng = random.Random(f"{seed}/{stream}")
    prefixes = [builder.text(c.prefix_len, random.Random(f"{seed}/prefix/{k}")) if c.prefix_len else ""
                for k, c in enumerate(workload.classes)]
    kinds = [k for k, count in enumerate(class_counts([c.weight for c in workload.classes], n))
             for _ in range(count)]
    rng.shuffle(kinds)
    requests = []
    for k in kinds:
        c = workload.classes[k]
        prompt_len = c.prefix_len + c.input_len.draw(rng)
        requests.append(BenchRequest(builder.text(prompt_len, rng, prefixes[k]), prompt_len, c.output_len.draw(rng)))
    return requests
