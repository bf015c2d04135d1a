"""The router's HTTP connections: uvicorn's h11 protocol with the limits uvicorn lacks.

  - A request head (request line and headers) must arrive whole within
    --header-timeout of the connection opening, or of the previous response ending. A
    connection that trickles a header byte a second (slowloris) is closed, with a 408
    if part of a head came; one that sent nothing is closed silently, as an idle
    keep-alive connection is.
  - A request's body must arrive whole within --body-timeout of its head: one that
    trickles in (slow POST) gets a 408 and the connection closes. Responses are not
    bounded here (a stream lasts as long as its generation).
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
# How long a TLS connection this side closes waits for the client's close_notify, once
# everything it was sent has left the process, before it is dropped. asyncio waits 30 s,
# and a client idle on a kept-alive connection (httpx, the openai client) does not read
# it until its next request: the router's stop, and the slot of a connection cut at
# --header-timeout, waited that long.
TLS_GOODBYE_SECONDS = 1.0


def _unsent(transport) -> int:
    """Bytes a TLS transport holds that have not gone to the socket yet: its own, and its
    TCP transport's (asyncio's SSL transport counts only the first)."""
    inner = getattr(getattr(transport, "_ssl_protocol", None), "_transport", None)
    return transport.get_write_buffer_size() + (inner.get_write_buffer_size() if inner is not None else 0)


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

    def __init__(self, *args, clients: ClientConnections, header_timeout: float, body_timeout: float = 0.0,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.clients = clients
        self.timeouts = {"head": header_timeout, "body": body_timeout}
        self._host: str | None = None              # set once counted
        self._deadline = None
        self._waiting_for: str | None = None      # "head" or "body": what the deadline runs for
        self._refused = None                       # the linger timer of a refused connection
        self._goodbye = None                       # the timer that drops a closing TLS connection

    def connection_made(self, transport) -> None:
        host = (get_remote_addr(transport) or ("",))[0]
        if not self.clients.open(host):
            self._refuse(transport, host)
            return
        self._host = host
        super().connection_made(transport)
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._host is None:                    # refused: uvicorn never saw it
            if self._refused is not None:
                self._refused.cancel()
            return
        self._stop_deadline()
        if self._goodbye is not None:
            self._goodbye.cancel()
        self.clients.close(self._host)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._host is None:                    # refused: what it sends is dropped
            return
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()
        self._bound_goodbye()

    def shutdown(self) -> None:
        super().shutdown()
        self._bound_goodbye()

    def timeout_keep_alive_handler(self) -> None:
        super().timeout_keep_alive_handler()
        self._bound_goodbye()

    def _bound_goodbye(self) -> None:
        """Once this side has closed a TLS connection, drop it TLS_GOODBYE_SECONDS after
        the last of its response left, if the client has not answered the close by then.
        A response still going out to a slow reader is not cut (asyncio's own 30 s
        bound it, as before)."""
        if (self._goodbye is None and self.transport.is_closing()
                and self.transport.get_extra_info("sslcontext") is not None):
            self._goodbye = self.loop.call_later(TLS_GOODBYE_SECONDS, self._drop_if_sent)

    def _drop_if_sent(self) -> None:
        if _unsent(self.transport):
            self._goodbye = self.loop.call_later(TLS_GOODBYE_SECONDS, self._drop_if_sent)
        else:
            self._goodbye = None
            self.transport.abort()

    def _follow(self) -> None:
        """Run the deadline of what the connection waits for: a request head, or the
        rest of a request's body. It starts when the wait does (bytes that trickle in
        do not extend it) and stops once that part is in."""
        waiting_for = None
        if not self.transport.is_closing():
            waiting_for = {h11.IDLE: "head", h11.SEND_BODY: "body"}.get(self.conn.their_state)
        if waiting_for == self._waiting_for:
            return
        self._stop_deadline()
        self._waiting_for = waiting_for
        if waiting_for is not None and self.timeouts[waiting_for] > 0:
            self._deadline = self.loop.call_later(self.timeouts[waiting_for], self._late, waiting_for)

    def _stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _late(self, part: str) -> None:
        self._deadline = None
        state = {"head": h11.IDLE, "body": h11.SEND_BODY}[part]
        if self.transport.is_closing() or self.conn.their_state is not state:
            return
        timeout = self.timeouts[part]
        started = getattr(self.cycle, "response_started", False) if part == "body" else False
        # Say why it ends where part of the request came and no response has begun.
        if (part == "body" or self.conn.trailing_data[0]) and not started:
            log.debug("%s: no whole request %s within %g s; closing", self._host, part, timeout)
            what = "headers" if part == "head" else "body"
            self.transport.write(_response("408 Request Timeout", "invalid_request_error", "request_timeout",
                                           f"the request's {what} did not arrive within {timeout:g} s"))
        self.transport.close()
        self._bound_goodbye()

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


def http_protocol(header_timeout: float, body_timeout: float, max_connections_per_client: int):
    """uvicorn's `http` argument: the protocol factory for one server (one count of
    connections per address, shared by all of its connections)."""
    return functools.partial(LimitedH11Protocol, clients=ClientConnections(max_connections_per_client),
                             header_timeout=header_timeout, body_timeout=body_timeout)
