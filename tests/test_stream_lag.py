"""A stream whose reader falls behind: tokens that queued up while the last message was
being written go out together, in the decode worker's gRPC stream and in the router's
SSE stream (as vLLM's output collector merges them), never across choices, never past
a choice's end or a failure, and with every token, logprob and finish kept. A reader
that keeps up still gets a message per token, and a keep-alive only after a quiet
spell."""
from __future__ import annotations

import asyncio
import random

from services.decode.worker import _joined, _joins
from services.engine.core.sampling import TokenLogprob
from services.engine.engine import EngineOutput
from services.engine.text.tokenizer import IncrementalDetokenizer, load_tokenizer
from services.router.frontend import RunningRequest
from services.router.generation import Delta


def _lp(token: int) -> TokenLogprob:
    return TokenLogprob(token, -0.5, [])


def _bare() -> RunningRequest:
    """A RunningRequest of one prompt with nothing queued yet (no cluster behind it)."""
    r = RunningRequest.__new__(RunningRequest)
    r.queue = asyncio.Queue()
    r.tasks = [asyncio.ensure_future(asyncio.sleep(0))]
    return r


def _request(items: list) -> RunningRequest:
    """One whose queue holds `items` already, then its prompt's end."""
    r = _bare()
    for item in [*items, None]:
        r.queue.put_nowait(item)
    return r


def _read(items: list) -> list[Delta]:
    async def run():
        return [d async for d in _request(items).deltas()]
    return asyncio.run(run())


def test_queued_deltas_of_a_choice_go_out_as_one_and_never_past_its_end():
    out = _read([Delta("Hel", [1], None, [_lp(1)], 0), Delta("lo", [2], None, [_lp(2)], 0),
                 Delta(" x", [9], None, [_lp(9)], 1),                         # another choice: apart
                 Delta(",", [3], None, [_lp(3)], 0), Delta("!", [4], "length", [_lp(4)], 0),
                 Delta(" y", [8], "stop", [_lp(8)], 1)])
    assert [(d.text, d.token_ids, d.finish_reason, d.index) for d in out] == [
        ("Hello", [1, 2], None, 0), (" x", [9], None, 1), (",!", [3, 4], "length", 0), (" y", [8], "stop", 1)]
    assert [lp.token_id for lp in out[0].logprobs] == [1, 2]
    ended = _read([Delta("a", [1], "stop", None, 0), Delta("b", [2], None, None, 1),
                   Delta("c", [3], "length", None, 1)])
    assert [(d.text, d.finish_reason) for d in ended] == [("a", "stop"), ("bc", "length")]


def test_a_reader_that_keeps_up_gets_a_delta_per_token():
    async def run():
        r, got = _bare(), []

        async def feed():
            for k in range(5):
                await r.queue.put(Delta(str(k), [k], "length" if k == 4 else None, None, 0))
                await asyncio.sleep(0.01)
            await r.queue.put(None)
        feeder = asyncio.ensure_future(feed())
        async for d in r.deltas():
            got.append(d.token_ids)
        await feeder
        return got
    assert asyncio.run(run()) == [[0], [1], [2], [3], [4]]


def test_a_keepalive_comes_after_a_quiet_spell_and_never_between_quick_tokens():
    async def run():
        r, got = _bare(), []

        async def feed():
            for k in range(8):
                await r.queue.put(Delta(str(k), [k], None, None, 0))
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.25)                   # quiet: keep-alives
            await r.queue.put(Delta("end", [8], "length", None, 0))
            await r.queue.put(None)
        feeder = asyncio.ensure_future(feed())
        async for d in r.deltas(keepalive=0.08):
            got.append(None if d is None else d.token_ids)
        await feeder
        return got
    got = asyncio.run(run())
    assert got[:8] == [[k] for k in range(8)] and got[-1] == [8]
    assert 1 <= got[8:-1].count(None) == len(got[8:-1]) <= 3, got


def test_a_failure_after_queued_deltas_still_raises_after_them():
    from services.router.protocol import APIError

    async def run():
        got = []
        try:
            async for d in _request([Delta("a", [1], None, None, 0), Delta("b", [2], None, None, 0),
                                     APIError(500, "worker lost")]).deltas():
                got.append(d.token_ids)
        except APIError as exc:
            return got, exc.status
    assert asyncio.run(run()) == ([[1, 2]], 500)


def test_the_decode_worker_joins_a_choices_queued_outputs_but_not_its_first_or_an_error():
    first = EngineOutput("r", [5], None, [_lp(5)], prompt_logprobs=[None, _lp(7)], cached_tokens=16)
    step = EngineOutput("r", [6], None, [_lp(6)])
    assert _joins(0, first, (0, step))
    joined = _joined(first, EngineOutput("r", [6], "length", [_lp(6)]))
    assert joined.token_ids == [5, 6] and joined.finish_reason == "length"
    assert [lp.token_id for lp in joined.logprobs] == [5, 6]
    assert joined.prompt_logprobs == first.prompt_logprobs and joined.cached_tokens == 16
    assert not _joins(0, step, (1, step))                                   # another choice
    assert not _joins(0, step, (0, first))                                  # a prompt's figures
    assert not _joins(0, step, (0, EngineOutput("r", [], "error")))         # tokens go out first
    assert not _joins(0, step, (0, EngineOutput("r", [6], None)))           # logprobs or not, alike


def test_the_rust_decode_gives_what_transformers_decode_gives(model_dir):
    """The detokenizer calls the tokenizers library directly for a fast tokenizer: the
    same deltas as through transformers' decode, special tokens included or skipped."""
    tok = load_tokenizer(model_dir)
    rng = random.Random(7)
    for _ in range(100):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            fast = IncrementalDetokenizer(tok, ids[:3], skip_special_tokens=skip)
            slow = IncrementalDetokenizer(tok, ids[:3], skip_special_tokens=skip)
            slow._rust = None
            assert fast._rust is not None
            assert [fast.push([i]) for i in ids] + [fast.flush()] == [slow.push([i]) for i in ids] + [slow.flush()]


def test_a_request_that_times_out_under_a_reader_that_stopped_reading_still_ends():
    """The request's deadline passes while its queue is full (the reader stopped taking
    deltas): the task ends at once with the 504 on the queue, instead of waiting for room
    that never comes."""
    from types import SimpleNamespace

    from services.router.protocol import APIError

    async def run():
        r = _bare()
        r.queue = asyncio.Queue(maxsize=4)
        r.timeout, r._deadlines, r._draining = 0.05, [], None

        async def generate(*_):
            for k in range(10):
                await r.queue.put(Delta(str(k), [k], None, None, 0))
        r._generate = generate
        await asyncio.wait_for(r._run(None, None, [SimpleNamespace(request_id="r")], 0, None), 5)
        items = [r.queue.get_nowait() for _ in range(r.queue.qsize())]
        return items[-1]
    last = asyncio.run(run())
    assert isinstance(last, APIError) and last.status == 504
