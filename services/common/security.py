"""Credentials and TLS: who may call what.

    API keys         clients -> router (HTTP `Authorization: Bearer <key>`, gRPC metadata
                     `authorization`); several keys, compared in constant time
    cluster secret   one random secret per cluster, known to the router, the workers and
                     the autoscaler. Two keys are derived from it, never the secret itself
                     on the wire:
                       record key  signs every record written to the registry; a reader
                                   drops records that are unsigned or signed otherwise,
                                   so whoever can write to Redis cannot register a worker
                       call token  a bearer credential on every router -> worker RPC; a
                                   worker refuses calls without it (UNAUTHENTICATED)
    TLS              files in PEM: a server's certificate and key; a CA to verify the peer
                     with (on a worker: clients must then present a certificate, mutual TLS)

The gRPC health and reflection services stay open: probes and tools need them, and they
carry nothing a caller could misuse.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable

import grpc

log = logging.getLogger(__name__)

MIN_SECRET_BYTES = 16
RECORD_MAGIC = b"PDS1"
_DIGEST = hashlib.sha256().digest_size
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def read_secret_file(path: str, what: str) -> bytes:
    """A secret from a file, stripped; refused when short. A file others can read is
    only warned about: Kubernetes mounts Secrets with whatever mode the chart set."""
    p = Path(path)
    try:
        data = p.read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} file {path}: {exc.strerror}") from None
    if len(data) < MIN_SECRET_BYTES:
        raise ValueError(f"the {what} in {path} is shorter than {MIN_SECRET_BYTES} bytes")
    if p.stat().st_mode & stat.S_IROTH:
        log.warning("the %s file %s is readable by every user on this host", what, path)
    return data


API_KEY_OPTIONS = ("name", "weight", "max_concurrency", "tokens_per_minute")


@dataclass(frozen=True)
class ApiKey:
    """An accepted API key and what its line in the key file says of it:
    `KEY [name=N] [weight=W] [max_concurrency=C] [tokens_per_minute=T]` (the router's
    fair share among keys, services/router/fairness.py). Its tenant names it in metrics
    and logs: `name`, or its place among the keys (`key-2`), never the key nor anything
    computed from it (an open /metrics showed a 48-bit hash of each unnamed key: a guessed
    weak key could be checked offline)."""
    key: str
    options: tuple[tuple[str, str], ...] = ()
    number: int = 0                     # its place among the accepted keys, from 1

    @property
    def tenant(self) -> str:
        return dict(self.options).get("name") or f"key-{self.number}"

    def line(self) -> str:
        return " ".join([self.key, *(f"{k}={v}" for k, v in self.options)])

    @classmethod
    def parse(cls, line: str) -> "ApiKey":
        key, *rest = line.split()
        options = []
        for item in rest:
            name, eq, value = item.partition("=")
            if not eq or name not in API_KEY_OPTIONS or not value:
                raise ValueError(f"unknown API key option {item!r} (known: {', '.join(API_KEY_OPTIONS)}=VALUE)")
            options.append((name, value))
        return cls(key, tuple(options))


def read_api_keys(keys: Iterable[str], key_file: str | None) -> list[ApiKey]:
    """Keys given on the command line and one per line in `key_file`, each optionally
    followed by its options (blank lines and lines starting with # skipped)."""
    out = [ApiKey(k.strip()) for k in keys if k.strip()]
    if key_file:
        try:
            text = Path(key_file).read_text()
        except OSError as exc:
            raise ValueError(f"cannot read the API key file {key_file}: {exc.strerror}") from None
        if Path(key_file).stat().st_mode & stat.S_IROTH:       # as the cluster secret's is
            log.warning("the API key file %s is readable by every user on this host", key_file)
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip() and not line.lstrip().startswith("#"):
                try:
                    out.append(ApiKey.parse(line))
                except ValueError as exc:
                    raise ValueError(f"{key_file} line {number}: {exc}") from None
        if not out:
            raise ValueError(f"the API key file {key_file} holds no key")
    return [replace(k, number=i) for i, k in enumerate(out, 1)]


class KeyCheck:
    """Does a presented bearer credential match one of the accepted ones, and which?
    Every accepted key is compared, each in constant time, so the answer's timing tells
    nothing."""

    def __init__(self, keys: Iterable[ApiKey | str]) -> None:
        self._keys = [k if isinstance(k, ApiKey) else ApiKey(k) for k in keys]
        self._keys = [k if k.number else replace(k, number=i) for i, k in enumerate(self._keys, 1)]
        self._digests = [hashlib.sha256(k.key.encode()).digest() for k in self._keys]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def match(self, presented: str | None) -> ApiKey | None:
        digest = hashlib.sha256((presented or "").encode()).digest()
        found = None
        for key, accepted in zip(self._keys, self._digests):
            if hmac.compare_digest(accepted, digest):
                found = key
        return found if presented is not None else None

    def accepts(self, presented: str | None) -> bool:
        return self.match(presented) is not None

    def accepts_header(self, authorization: str | None) -> bool:
        return self.accepts(bearer(authorization))

    def tenant_of_header(self, authorization: str | None) -> str:
        """The tenant of the key in an Authorization value; "" where none matches."""
        key = self.match(bearer(authorization))
        return key.tenant if key is not None else ""


def bearer(authorization: str | None) -> str | None:
    scheme, _, value = (authorization or "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


@dataclass(frozen=True)
class ClusterSecret:
    """The two keys derived from the cluster secret."""
    record_key: bytes
    call_token: str

    @classmethod
    def from_bytes(cls, secret: bytes) -> "ClusterSecret":
        derive = lambda label: hmac.new(secret, label, hashlib.sha256).digest()  # noqa: E731
        return cls(derive(b"pdserve registry record v1"), derive(b"pdserve worker call v1").hex())

    @classmethod
    def from_file(cls, path: str | None) -> "ClusterSecret | None":
        return cls.from_bytes(read_secret_file(path, "cluster secret")) if path else None

    def sign(self, payload: bytes) -> bytes:
        return RECORD_MAGIC + hmac.new(self.record_key, payload, hashlib.sha256).digest() + payload

    def open(self, blob: bytes) -> bytes | None:
        """The payload of a record this cluster signed; None for any other."""
        if not blob.startswith(RECORD_MAGIC) or len(blob) < len(RECORD_MAGIC) + _DIGEST:
            return None
        mac, payload = blob[len(RECORD_MAGIC):len(RECORD_MAGIC) + _DIGEST], blob[len(RECORD_MAGIC) + _DIGEST:]
        expected = hmac.new(self.record_key, payload, hashlib.sha256).digest()
        return payload if hmac.compare_digest(mac, expected) else None

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.call_token}"),)


def redact_url(url: str) -> str:
    """A URL without the credentials it may carry (redis://:password@host, or a
    `password=` in its query, which redis-py takes too), for logs and announcements."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    rest = rest.rpartition("@")[2]
    where, mark, query = rest.partition("?")
    if mark:
        query = "&".join("password=***" if p.split("=", 1)[0].lower() == "password" else p for p in query.split("&"))
    return f"{scheme}{sep}{where}{mark}{query}"


def new_secret_file(path: Path) -> Path:
    """A fresh random cluster secret, readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(os.urandom(32).hex())
    return path


# ---- gRPC ----

class RequireBearer(grpc.aio.ServerInterceptor):
    """Refuses every call but health and reflection unless its `authorization` metadata
    carries an accepted bearer credential."""

    def __init__(self, check: KeyCheck, what: str) -> None:
        self.check = check
        self.what = what

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_SERVICES):
            return await continuation(details)
        presented = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        if self.check.accepts_header(presented if isinstance(presented, str) else None):
            return await continuation(details)
        handler = await continuation(details)
        return _refusal(handler, "missing authorization metadata" if presented is None else f"invalid {self.what}")


def _refusal(handler, message: str):
    """A handler of the same shape as `handler` that fails the call UNAUTHENTICATED."""
    if handler is None:
        return None

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield                                   # pragma: no cover - makes this a generator

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.stream_stream_rpc_method_handler(stream, **kw)


class _AddMetadata:
    """Puts the cluster's call token on every call a router makes to a worker."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def _details(self, details):
        md = grpc.aio.Metadata(*(details.metadata or ()), *self.metadata)
        return details._replace(metadata=md)


class _AddToUnary(_AddMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AddToStream(_AddMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


def call_interceptors(secret: ClusterSecret | None) -> list:
    """One interceptor per call shape: grpc.aio files each interceptor under one shape only."""
    if secret is None:
        return []
    metadata = secret.call_metadata()
    return [_AddToUnary(metadata), _AddToStream(metadata)]


@dataclass(frozen=True)
class TLSFiles:
    """PEM files: this side's certificate and key, and the CA it verifies its peer with."""
    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("a TLS certificate needs its key, and a key its certificate")
        for path in (self.cert, self.key, self.ca):
            if path and not Path(path).is_file():
                raise ValueError(f"TLS file {path} does not exist")

    @staticmethod
    def _read(path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """None: plaintext. With a CA, clients must present a certificate it signed."""
        if not self.cert:
            return None
        ca = self._read(self.ca)
        return grpc.ssl_server_credentials([(self._read(self.key), self._read(self.cert))],
                                           root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self._read(self.ca), private_key=self._read(self.key),
                                            certificate_chain=self._read(self.cert))
