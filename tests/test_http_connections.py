"""The router's HTTP listener against slow and greedy clients, over raw sockets: a
request head that trickles in is cut off at --header-timeout, a body at --body-timeout,
one address cannot hold
more than --max-connections-per-client connections, and the router answers normally
afterwards. A router of its own (short limits) over the session cluster's workers."""
from __future__ import annotations

import socket
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from services.router.connections import ClientConnections
from tests.processes import terminate

HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 2.0
CAP = 4


@pytest.fixture(scope="module")
def router(cluster):
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-conns-"))
    proc, info = cluster.router(tmp, "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
                                "--max-connections-per-client", str(CAP))
    yield info["http_port"]
    terminate(proc)


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.settimeout(0.25)
    return s


def _trickle_until_closed(sockets: list[socket.socket], limit: float) -> dict[int, tuple[float, bytes]]:
    """Send each socket a header byte every 0.25 s until the server closes it (or
    `limit` passes): for each, when it closed and what the server sent."""
    started = time.monotonic()
    closed: dict[int, tuple[float, bytes]] = {}
    got = {i: b"" for i in range(len(sockets))}
    while len(closed) < len(sockets) and time.monotonic() - started < limit:
        for i, s in enumerate(sockets):
            if i in closed:
                continue
            try:
                s.sendall(b"a")
                chunk = s.recv(4096)
            except socket.timeout:
                continue
            except OSError:                     # reset: closed with our bytes unread
                chunk = b""
            got[i] += chunk
            if not chunk:
                closed[i] = (time.monotonic() - started, got[i])
    return closed


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def test_slow_request_heads_are_closed_within_the_header_timeout(router):
    sockets = [_connect(router) for _ in range(3)]
    for s in sockets:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    idle = _connect(router)                     # sends nothing at all
    try:
        closed = _trickle_until_closed(sockets, limit=HEADER_TIMEOUT + 8)
        assert len(closed) == 3, f"still open after {HEADER_TIMEOUT + 8} s: {set(range(3)) - set(closed)}"
        for after, sent in closed.values():
            assert after < HEADER_TIMEOUT + 1.5, after
            assert sent == b"" or _status(sent) == 408, sent[:200]
        idle.settimeout(HEADER_TIMEOUT + 2)
        assert idle.recv(100) == b""            # closed silently: nothing was asked
    finally:
        for s in sockets + [idle]:
            s.close()
    assert httpx.get(f"http://127.0.0.1:{router}/health", timeout=10).status_code == 200


def test_one_address_past_the_cap_gets_429_until_a_connection_closes(router):
    held = [_connect(router) for _ in range(CAP)]
    try:
        time.sleep(0.2)                         # all of them accepted and counted
        extra = _connect(router)
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        extra.settimeout(5)
        answer = b""
        while chunk := extra.recv(4096):
            answer += chunk
        extra.close()
        assert _status(answer) == 429, answer[:200]
        assert b'"code": "too_many_connections"' in answer and b"retry-after: 1" in answer.lower()
        held.pop().close()
        time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{router}/v1/completions", timeout=60,
                       json={"prompt": "Hello", "max_tokens": 2}, headers={"Connection": "close"})
        assert r.status_code == 200, r.text
    finally:
        for s in held:
            s.close()


def test_each_request_on_a_kept_alive_connection_has_its_own_head_deadline(router):
    """A fast first request does not buy the connection time: the next head is cut off
    too. A connection that keeps asking in time is never cut."""
    s = _connect(router)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(10)
        assert _status(s.recv(4096)) == 200
        s.settimeout(0.25)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        closed = _trickle_until_closed([s], limit=HEADER_TIMEOUT + 8)
        assert closed and closed[0][0] < HEADER_TIMEOUT + 1.5, closed
    finally:
        s.close()
    with httpx.Client(base_url=f"http://127.0.0.1:{router}", timeout=30) as client:
        for _ in range(3):                      # 3 s on one connection, each head in time
            assert client.get("/health").status_code == 200
            time.sleep(HEADER_TIMEOUT / 2)


def test_the_count_per_address_goes_down_with_each_close():
    clients = ClientConnections(2)
    assert clients.open("a") and clients.open("a") and not clients.open("a") and clients.open("b")
    clients.close("a")
    assert clients.open("a") and clients.held("a") == 2
    for _ in range(2):
        clients.close("a")
    assert clients.held("a") == 0 and ClientConnections(0).open("a")


def test_a_body_that_trickles_in_is_cut_off_with_a_408(router):
    """A whole head, then a body a byte at a time (slow POST): a 408 naming the body
    once --body-timeout has passed since the head, and the connection closes; the
    router serves the next request."""
    s = _connect(router)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: 400\r\n\r\n{")
    (closed,) = _trickle_until_closed([s], limit=BODY_TIMEOUT + 10).values()
    s.close()
    after, answer = closed
    assert BODY_TIMEOUT - 0.5 <= after <= BODY_TIMEOUT + 2, after
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer and b"body" in answer, answer
    ok = httpx.post(f"http://127.0.0.1:{router}/v1/completions", timeout=60,
                    json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200, ok.text


def test_a_public_grpc_port_closes_connections_that_run_no_call(monkeypatch):
    """Idle HTTP/2 connections to the router's gRPC port were held for ever (by the
    thousand, they took its file descriptors): with no call running one is closed after
    PUBLIC_IDLE_MS, and the client's channel reconnects for its next call."""
    import asyncio

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common import grpc_server

    monkeypatch.setattr(grpc_server, "PUBLIC_IDLE_MS", 300)

    async def run():
        host = grpc_server.ServiceHost([], public=True)
        port = host.bind("127.0.0.1", 0)
        await host.server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert ch.get_state() is grpc.ChannelConnectivity.READY
                await asyncio.sleep(1.5)
                gone = ch.get_state()
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
                return gone
        finally:
            await host.server.stop(0)
    assert asyncio.run(run()) is grpc.ChannelConnectivity.IDLE
