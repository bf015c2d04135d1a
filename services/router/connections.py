"""The router's HTTP connections: uvicorn's h11 protocol with two limits uvicorn lacks.

  - A request head (request line and headers) must arrive whole within
    --header-timeout of the connection opening, or of the previous response ending. A
    connection that trickles a header byte a second (slowloris) is closed, with a 408
    if part of a head came; one that sent nothing is closed silently, as an idle
    keep-alive connection is. Bodies and responses are not bounded here.
  - One client address holds at most --max-connections-per-client connections at
    once. The next one gets a 429 and is closed before anything is read from it.

The protocol is the pure-Python h11 one whether or not httptools is installed, so the
limits hold on every install. Behind a proxy every connection comes from the proxy's
address: raise the cap there, or turn it off (0).
"""
from __future__ import annotations

import functools
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.utils import get_remote_addr

log = logging.getLogger(__name__)

# How long a refused connection may linger, half-closed, for its request to drain: a
# close with unread bytes would reset the connection and could lose the 429.
REFUSED_LINGER_SECONDS = 2.0


def _response(status: str, type_: str, code: str, message: str, extra: str = "") -> bytes:
    """A whole HTTP response with an OpenAI-style error, written before any request is read."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n{extra}\r\n").encode() + body


class ClientConnections:
    """Connections open per client address (all on the event loop's thread)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap                              # 0: no cap
        self._open: dict[str, int] = {}

    def open(self, host: str) -> bool:
        """Count one more connection from `host`; False (and nothing counted) at the cap."""
        held = self._open.get(host, 0)
        if self.cap and held >= self.cap:
            return False
        self._open[host] = held + 1
        return True

    def close(self, host: str) -> None:
        held = self._open.get(host, 0) - 1
        if held > 0:
            self._open[host] = held
        else:
            self._open.pop(host, None)

    def held(self, host: str) -> int:
        return self._open.get(host, 0)


class LimitedH11Protocol(H11Protocol):
    """One HTTP connection, under the header deadline and the per-address cap."""

    def __init__(self, *args, clients: ClientConnections, header_timeout: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.clients = clients
        self.header_timeout = header_timeout
        self._host: str | None = None              # set once counted
        self._head_deadline = None
        self._refused = None                       # the linger timer of a refused connection

    def connection_made(self, transport) -> None:
        host = (get_remote_addr(transport) or ("",))[0]
        if not self.clients.open(host):
            self._refuse(transport, host)
            return
        self._host = host
        super().connection_made(transport)
        self._follow_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._host is None:                    # refused: uvicorn never saw it
            if self._refused is not None:
                self._refused.cancel()
            return
        self._stop_deadline()
        self.clients.close(self._host)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._host is None:                    # refused: what it sends is dropped
            return
        super().data_received(data)
        self._follow_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_head()

    def _follow_head(self) -> None:
        """Start the head's deadline when the connection waits for a head (and none
        runs yet: bytes that trickle in do not extend it); stop it once a head is in."""
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if self._head_deadline is None and self.header_timeout > 0:
                self._head_deadline = self.loop.call_later(self.header_timeout, self._head_late)
        else:
            self._stop_deadline()

    def _stop_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_late(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:           # part of a head came: say why it ends
            log.debug("%s: no whole request head within %g s; closing", self._host, self.header_timeout)
            self.transport.write(_response(
                "408 Request Timeout", "invalid_request_error", "request_timeout",
                f"the request's headers did not arrive within {self.header_timeout:g} s"))
        self.transport.close()

    def _refuse(self, transport, host: str) -> None:
        log.debug("%s already holds %d connections; refusing another", host, self.clients.held(host))
        self.transport = transport
        transport.write(_response(
            "429 Too Many Requests", "rate_limit_error", "too_many_connections",
            f"this address already holds {self.clients.cap} connections, the most one client may open; "
            "close some and retry", extra="retry-after: 1\r\n"))
        if transport.can_write_eof():
            transport.write_eof()
            self._refused = self.loop.call_later(REFUSED_LINGER_SECONDS, transport.close)
        else:
            transport.close()


def http_protocol(header_timeout: float, max_connections_per_client: int):
    """uvicorn's `http` argument: the protocol factory for one server (one count of
    connections per address, shared by all of its connections)."""
    return functools.partial(LimitedH11Protocol, clients=ClientConnections(max_connections_per_client),
                             header_timeout=header_timeout)
