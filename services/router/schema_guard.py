"""The router's last check on structured output: a choice constrained by a JSON schema
that ends on its own is validated against the schema before its end is reported.

xgrammar does not enforce every keyword (`not`, an `allOf` of several branches), so a
schema the satisfiability check lets through can still yield output that breaks it.
Such an answer is an error (HTTP 500 `json_schema_violation`, gRPC INTERNAL), never a
`stop` that claims the schema held. A choice cut by `max_tokens` ("length"), or by a
stop string or stop token the request named, is not checked: the client asked for the
cut, and the output is partial by design. A reasoning model's grammar holds its answer
after the end of its thinking (`structure_after`): that answer is what is checked, and
an output that never ends its thinking has none to check. Where the output could open
its thinking with its first token (`structure_opens`) and did not, the grammar held it
whole, and the whole is checked.
"""
from __future__ import annotations

import asyncio
import logging

from services.engine.text.json_schema import output_violation
from services.engine.core.sampling import SamplingParams
from services.router.protocol import APIError

log = logging.getLogger(__name__)


class SchemaGuard:
    """One constrained choice's text, checked when the choice ends."""

    def __init__(self, request_id: str, index: int, params: SamplingParams, after: str = "") -> None:
        self.request_id = request_id
        self.index = index
        self.schema = params.json_schema
        self.after = after                      # the text the answer follows (structure_after's)
        self.opens = params.structure_opens[:1]     # the first token that would have opened thinking
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.parts: list[str] = []
        self.first_token: int | None = None
        self.last_token: int | None = None

    async def feed(self, text: str, token_ids: list[int], finish: str | None, stop_string: bool) -> None:
        """Take a delta; at the choice's own end, raise APIError if its text breaks the schema."""
        self.parts.append(text)
        if token_ids:
            self.first_token = token_ids[0] if self.first_token is None else self.first_token
            self.last_token = token_ids[-1]
        if finish != "stop" or stop_string or self.last_token in self.stop_token_ids:
            return
        text = "".join(self.parts)
        if self.after and (not self.opens or (self.first_token,) == self.opens):     # it thought first
            at = text.find(self.after)
            if at < 0:
                return
            text = text[at + len(self.after):]
        # Off the event loop: the schema is the client's, up to 64 KiB.
        reason = await asyncio.to_thread(output_violation, self.schema, text)
        if reason is None:
            return
        log.warning("request %s: choice %d ended outside its JSON schema: %s", self.request_id, self.index, reason)
        raise APIError(500, f"the output of choice {self.index} does not match the JSON schema ({reason}); the "
                            "grammar does not enforce every keyword, and this schema relies on one it let through",
                       type_="server_error", code="json_schema_violation", grpc_code="INTERNAL")
