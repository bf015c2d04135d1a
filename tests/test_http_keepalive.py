"""A kept-alive connection answers as fast as a new one: the router's connections have
Nagle's algorithm off. With it on, a response's body, written after its head, waits for
the client to acknowledge the head, and clients delay that ACK by ~40 ms: every request
after a connection's first (lm-eval's /tokenize calls, a load generator's pooled
requests) took 40 ms longer, and small streamed chunks were held the same way."""
from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

REQUEST = b"GET /v1/models HTTP/1.1\r\nhost: pdserve\r\n\r\n"


def _body_delay(conn: socket.socket) -> float:
    """Seconds between a response's first bytes and its last."""
    conn.sendall(REQUEST)
    data, first = b"", None
    while True:
        data += conn.recv(65536)
        first = first or time.monotonic()
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            if len(body) >= length:
                return time.monotonic() - first


def test_a_kept_alive_connections_response_comes_whole(cluster):
    url = urlsplit(cluster.http)
    with socket.create_connection((url.hostname, url.port), timeout=10) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _body_delay(conn)                       # a connection's first answer is never held
        delays = [_body_delay(conn) for _ in range(5)]
    assert min(delays) < 0.02, delays           # held for the ACK: 40 ms or more, every time
