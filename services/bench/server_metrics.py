"""What the servers counted during a run, from their Prometheus /metrics (`pdserve bench
--server-metrics`): read before and after, the difference is the run's. Speculative
decoding's acceptance is read from vLLM's counter names, which pdserve's decode workers
export too, so the same flag reports it for either.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

SPEC = "vllm:spec_decode_num_"
# name{labels} value, as Prometheus' text format writes a sample
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
POSITION = re.compile(r'position="(\d+)"')


def parse(text: str) -> dict[str, float]:
    """The speculative-decoding samples of one /metrics page, summed over models:
    `drafts`, `draft_tokens`, `accepted_tokens`, and `pos<i>` per draft position."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if not m or not m.group(1).startswith(SPEC) or not m.group(1).endswith("_total"):
            continue
        key = m.group(1)[len(SPEC):-len("_total")]
        if key == "accepted_tokens_per_pos":
            pos = POSITION.search(m.group(2) or "")
            if pos is None:
                continue
            key = f"pos{pos.group(1)}"
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


@dataclass(frozen=True)
class Acceptance:
    drafts: int                         # sequences verified with drafted tokens
    draft_tokens: int
    accepted_tokens: int
    per_position: list[float]           # share of drafts whose token at each position was kept

    @property
    def rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_length(self) -> float:
        """Tokens a verified sequence took per step: the accepted drafts and the one sampled."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 0.0

    def describe(self) -> str:
        if not self.drafts:
            return "  speculation    no drafts verified"
        positions = ", ".join(f"{100 * p:.0f}" for p in self.per_position)
        return (f"  speculation    {self.drafts} drafts, {self.accepted_tokens}/{self.draft_tokens} drafted tokens "
                f"accepted ({100 * self.rate:.1f} %), {self.mean_length:.2f} tokens a verified step; "
                f"by position (%): {positions}")


def acceptance(before: dict[str, float], after: dict[str, float]) -> Acceptance | None:
    """The run's speculative decoding, or None where the servers export none."""
    if not any(k in after for k in ("drafts", "draft_tokens")):
        return None
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    drafts = int(d.get("drafts", 0))
    positions = sorted((int(k[3:]), v) for k, v in d.items() if k.startswith("pos"))
    return Acceptance(drafts, int(d.get("draft_tokens", 0)), int(d.get("accepted_tokens", 0)),
                      [v / drafts if drafts else 0.0 for _, v in positions])


async def scrape(client, urls: list[str]) -> dict[str, float]:
    """The samples of every URL's page, added up (several decode workers)."""
    total: dict[str, float] = {}
    for url in urls:
        r = await client.get(url)
        r.raise_for_status()
        for k, v in parse(r.text).items():
            total[k] = total.get(k, 0.0) + v
    return total
