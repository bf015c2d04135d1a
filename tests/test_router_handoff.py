"""A request's way through the workers (services/router/handoff.py) at the moments a
worker leaves: the workers' gRPC stubs are test doubles here, because the interleavings
under test (a prefill worker lost while the request waits for its blocks, a worker that
departs with a release still to send) cannot be made to happen on demand with real
processes; the cluster tests cover the same paths with real workers where they can."""
import asyncio
from contextlib import aclosing

import grpc

from services.common.metrics import RouterMetrics
from services.common.settings import RouterSettings
from services.engine.core.sampling import SamplingParams
from services.router.generation import Generation
from services.router.handoff import Handoff
from services.router.latency import LatencyLedger
from services.router.policy import CostModel
from services.router.workers import Worker, WorkerSet
from services.rpc import worker_pb2


class Decode:
    """A decode worker's stub: reservations, releases and one-token decode streams."""

    def __init__(self, reserving=None):
        self.reserved, self.released, self.decodes = [], [], []
        self.reserving = reserving              # called as a Reserve is answered

    async def Reserve(self, req, timeout=None):
        await asyncio.sleep(0.01)
        if self.reserving:
            self.reserving()
        self.reserved.append(req.request_id)
        return worker_pb2.KVHandle(request_id=req.request_id, epoch="D1", block_ids=[1],
                                   num_tokens=req.num_prompt_tokens)

    async def Release(self, req, timeout=None):
        self.released.append(req.request_id)
        return worker_pb2.ReleaseResponse(released=True)

    def Decode(self, req, timeout=None):
        self.decodes.append(req)

        class Stream:
            def cancel(self):
                pass

            async def __aiter__(self):
                yield worker_pb2.DecodeChunk(token_ids=[5], finish_reason="length", index=0)
        return Stream()


class Prefill:
    def __init__(self):
        self.calls = []

    async def Prefill(self, req, timeout=None):
        self.calls.append(req.request_id)
        return worker_pb2.PrefillResponse(first_token_id=7, kv_bytes=10, transport="test")


def workers(decode: Decode) -> tuple[WorkerSet, Worker, Worker]:
    settings = RouterSettings(decode=["d:1"], prefill=["p:1"], local_prefill_max_tokens=0)
    ws = WorkerSet(settings, RouterMetrics("handoff_test"), LatencyLedger(), CostModel())
    d, p = ws.decode[0], ws.prefill[0]
    d.stub, p.stub = decode, Prefill()
    for w, epoch in ((d, "D1"), (p, "P1")):
        w.seen(worker_pb2.WorkerInfo(epoch=epoch, free_blocks=1000, block_size=16, compat_hash="h"))
    return ws, d, p


async def run(ws: WorkerSet, gen: Generation) -> list:
    h = Handoff(gen, 1, ws, ws.settings, ws.metrics, ws.cost)
    async with aclosing(h.tokens()) as tokens:
        return [item async for item in tokens]


def test_a_prefill_worker_lost_while_the_blocks_are_reserved_leaves_the_prompt_to_the_decode_worker():
    """The prefill worker stops answering its Info poll while the request waits for its
    blocks (a full pool makes that wait long): the reservation goes back and the decode
    worker prefills the prompt itself, where the request used to fail with a 500."""
    async def main():
        decode = Decode()
        ws, d, p = workers(decode)
        decode.reserving = lambda: setattr(p, "info", None)      # what a failed Info poll does
        gen = Generation("req", list(range(1, 41)), SamplingParams(max_tokens=4, temperature=0.0))
        items = await run(ws, gen)
        await asyncio.sleep(0)
        return items, gen, decode, d, p
    items, gen, decode, d, p = asyncio.run(main())
    assert [ids for _, ids, _, _ in items] == [[5]] and gen.decision == "local_fallback"
    assert decode.reserved == decode.released == ["req.1"] and not p.stub.calls
    assert decode.decodes[0].local_prefill and (p.inflight, p.inflight_tokens, d.inflight) == (0, 0, 0)


def test_a_departed_workers_channel_stays_open_for_what_is_still_planned_or_to_release():
    """A worker that leaves (a restart at its address) closes its channel once nothing of
    this router's is on it: not while a prompt is planned for it (its blocks still being
    reserved), nor while a request that ended early has its release to send."""
    class Channel:
        closed = False

        async def close(self):
            Channel.closed = True

    async def main():
        ws, d, p = workers(Decode())
        p.chan = Channel()
        p.prompt_planned(40)
        closing = asyncio.ensure_future(ws._close_when_idle(p))
        await asyncio.sleep(0.6)
        planned_open = not Channel.closed
        p.prompt_dropped(40)
        await asyncio.wait_for(closing, 2)
        # a release still to send counts the request on its decode worker until it is sent
        d.request_routed()
        handle = worker_pb2.KVHandle(request_id="r.1", epoch="D1")
        writer = asyncio.get_running_loop().create_future()
        h = Handoff(Generation("r", [1, 2], SamplingParams(max_tokens=1)), 1, ws, ws.settings, ws.metrics, ws.cost)
        release = asyncio.ensure_future(h._release_after(writer, d, handle, "test", then=d.request_ended))
        await asyncio.sleep(0.05)
        counted = d.inflight
        writer.set_result(None)
        await release
        return planned_open, counted, d.inflight, d.stub.released
    planned_open, counted, after, released = asyncio.run(main())
    assert planned_open and Channel.closed
    assert (counted, after, released) == (1, 0, ["r.1"])


def rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details, None)


def test_a_decode_worker_that_no_longer_holds_the_blocks_gets_the_request_again_elsewhere():
    """The decode worker restarted between Reserve and Decode (or the lease ran out): it
    refuses the attempt (FAILED_PRECONDITION). Nothing was decoded, so the request tries
    again, where it used to end with a 502."""
    class Restarted(Decode):
        def Decode(self, req, timeout=None):
            if not self.decodes:
                self.decodes.append(req)

                class Refused:
                    def cancel(self):
                        pass

                    async def __aiter__(self):
                        raise rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "stale epoch")
                        yield
                return Refused()
            return super().Decode(req, timeout)

    async def main():
        ws, d, p = workers(Restarted())
        gen = Generation("req", list(range(1, 41)), SamplingParams(max_tokens=4, temperature=0.0))
        return await run(ws, gen), d.stub
    items, decode = asyncio.run(main())
    assert [ids for _, ids, _, _ in items][-1] == [5]
    assert [r.request_id for r in decode.decodes] == ["req.1", "req.2"]


def test_a_worker_that_stops_answering_its_polls_lets_go_of_the_calls_waiting_on_it():
    """Without a registry, the router polls each worker's Info: one that stops answering
    (frozen: its connection stays open) interrupts the calls still waiting for its first
    answer, so their requests try another worker rather than wait out their deadline;
    once it answers again, calls wait on it as before."""
    class Stub:
        answer = False

        async def Info(self, req, timeout=None):
            if not Stub.answer:
                raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)
            return worker_pb2.WorkerInfo(epoch="D1", free_blocks=10, block_size=16, compat_hash="h")

    async def main():
        ws, d, p = workers(Decode())
        d.stub = p.stub = Stub()
        waiting = d.unreachable
        await ws._poll_info()
        frozen = waiting.is_set() and d.info is None
        Stub.answer = True
        await ws._poll_info()
        return frozen, d.unreachable.is_set(), d.info is not None
    assert asyncio.run(main()) == (True, False, True)


def test_a_prefill_call_lost_while_its_worker_lives_leaves_the_blocks_to_their_lease():
    """The prefill call fails with UNAVAILABLE. If the worker still answers, the call's
    connection failed and not the worker, which may still be writing into the reserved
    blocks: they are not released (their lease ends its writes, then the decode worker
    takes them back) and the decode worker prefills under an id of its own. A worker
    that does not answer writes nothing more: its blocks go back at once."""
    class Lost(Prefill):
        def __init__(self, alive):
            super().__init__()
            self.alive = alive

        async def Prefill(self, req, timeout=None):
            self.calls.append(req.request_id)
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed")

        async def Info(self, req, timeout=None):
            if not self.alive:
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, "Connection refused")
            return worker_pb2.WorkerInfo(epoch="P1")

    async def main(alive):
        decode = Decode()
        ws, d, p = workers(decode)
        p.stub = Lost(alive)
        gen = Generation("req", list(range(1, 41)), SamplingParams(max_tokens=4, temperature=0.0))
        items = await run(ws, gen)
        return items, gen, decode
    for alive, released, local_id in ((True, [], "req.1-local"), (False, ["req.1"], "req.1")):
        items, gen, decode = asyncio.run(main(alive))
        assert [ids for _, ids, _, _ in items] == [[5]] and gen.decision == "local_fallback"
        assert decode.released == released and [(r.request_id, r.local_prefill) for r in decode.decodes] == [
            (local_id, True)]
