"""Who may call what: API keys on the router, the cluster credential on every worker call,
TLS and mutual TLS with certificates from a test CA (trustme), browsers kept out, and
responses that name workers by id.

One set of real processes for the module: a decode and a prefill worker that serve gRPC
over mutual TLS and demand the cluster credential, and a router that reaches them with
its client certificate and serves HTTPS and gRPC over TLS with two API keys.
"""
from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.security import ClusterSecret, KeyCheck, new_secret_file
from services.rpc import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.processes import Bearer, free_port, spawn_service, terminate

trustme = pytest.importorskip("trustme")

KEYS = ("sk-first-key-0123456789", "sk-from-the-file-9876543210")
WORKER_NAME = "workers.pdserve.internal"       # the workers' certificate names no IP: dialled by this name


class Secure:
    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="pdserve-sec-"))
        ca = trustme.CA()
        self.ca = self._write(ca.cert_pem.bytes(), "ca.pem")
        router_cert = ca.issue_cert("127.0.0.1", "localhost")
        worker_cert = ca.issue_cert(WORKER_NAME)
        client_cert = ca.issue_cert("pdserve-router")
        self.router_cert, self.router_key = self._pair(router_cert, "router")
        self.worker_cert, self.worker_key = self._pair(worker_cert, "worker")
        self.client_cert, self.client_key = self._pair(client_cert, "client")
        self.secret = str(new_secret_file(self.tmp / "cluster-secret"))
        self.key_file = self._write(f"# one key a line\n{KEYS[1]}\n".encode(), "api-keys")
        self.procs: dict[str, subprocess.Popen] = {}
        self.info: dict[str, dict] = {}
        self.ports = {"decode": free_port(), "prefill": free_port()}

    def _write(self, data: bytes, name: str) -> str:
        path = self.tmp / name
        path.write_bytes(data)
        return str(path)

    def _pair(self, cert, name: str) -> tuple[str, str]:
        chain = b"".join(c.bytes() for c in cert.cert_chain_pems)
        return self._write(chain, f"{name}.crt"), self._write(cert.private_key_pem.bytes(), f"{name}.key")

    def start(self) -> "Secure":
        tls = ["--tls-cert", self.worker_cert, "--tls-key", self.worker_key, "--tls-ca", self.ca]
        for role in ("decode", "prefill"):
            argv = ["--dtype", "float32", "--threads", "1", "--log-level", "warning", "--port",
                    str(self.ports[role]), "--cluster-secret-file", self.secret, *tls]
            if role == "decode":
                argv += ["--kv-cache-tokens", "4096", "--max-model-len", "2048", "--max-lease-seconds", "120"]
            self.procs[role], self.info[role] = spawn_service(self.tmp, role, role, argv)
        self.procs["router"], self.info["router"] = spawn_service(self.tmp, "router", "router", [
            "--http-port", "0", "--grpc-port", "0", "--log-level", "warning", "--local-prefill-max-tokens", "0",
            "--decode", self.addr("decode"), "--prefill", self.addr("prefill"), "--cluster-secret-file", self.secret,
            "--worker-tls-ca", self.ca, "--worker-tls-cert", self.client_cert, "--worker-tls-key", self.client_key,
            "--worker-tls-server-name", WORKER_NAME, "--tls-cert", self.router_cert, "--tls-key", self.router_key,
            "--api-key", KEYS[0], "--api-key-file", self.key_file, "--allowed-origins", "https://app.example"])
        deadline = time.monotonic() + 60
        while httpx.get(f"{self.http}/ready", verify=self.tls_context()).status_code != 200:
            assert time.monotonic() < deadline, "the router never reached its TLS workers"
            time.sleep(0.2)
        return self

    def addr(self, role: str) -> str:
        return f"127.0.0.1:{self.ports[role]}"

    @property
    def http(self) -> str:
        return f"https://127.0.0.1:{self.info['router']['http_port']}"

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.info['router']['grpc_port']}"

    def worker_channel(self, role: str, client_cert: bool = True, credential: bool = True) -> grpc.Channel:
        read = lambda p: Path(p).read_bytes()  # noqa: E731
        creds = grpc.ssl_channel_credentials(read(self.ca), *((read(self.client_key), read(self.client_cert))
                                                             if client_cert else (None, None)))
        ch = grpc.secure_channel(self.addr(role), creds, options=[("grpc.ssl_target_name_override", WORKER_NAME)])
        if credential:
            ch = grpc.intercept_channel(ch, Bearer(ClusterSecret.from_file(self.secret).call_metadata()))
        return ch

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.http}/v1", api_key=key, max_retries=0,
                             http_client=httpx.Client(verify=self.tls_context(), timeout=120))

    def tls_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=self.ca)

    def stop(self) -> None:
        for role in ("router", "prefill", "decode"):
            if role in self.procs:
                terminate(self.procs.pop(role))
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def secure(model_dir):
    s = Secure()
    try:
        yield s.start()
    finally:
        s.stop()


def _chat(client: openai.OpenAI) -> str:
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=4, temperature=0,
                                       messages=[{"role": "user", "content": "Say hi"}])
    return r.choices[0].finish_reason


def test_a_redis_password_is_never_announced_nor_printed():
    """The registry's URL as logs, the banner and the announce files give it: without a
    password, whether in its user part or its query (redis-py takes both)."""
    from services.common.security import redact_url
    assert redact_url("redis://:hunter2@10.0.0.5:6379/0") == "redis://10.0.0.5:6379/0"
    assert redact_url("rediss://user:hunter2@h:6380/1?ssl_cert_reqs=none") == "rediss://h:6380/1?ssl_cert_reqs=none"
    assert redact_url("redis://h:6379/0?db=1&PASSWORD=hunter2") == "redis://h:6379/0?db=1&password=***"
    assert redact_url("unix:///tmp/pdserve/redis.sock") == "unix:///tmp/pdserve/redis.sock"

def test_key_check_compares_every_key_and_refuses_what_is_not_one():
    check = KeyCheck(KEYS)
    assert check.accepts(KEYS[0]) and check.accepts(KEYS[1]) and check.accepts_header(f"Bearer {KEYS[1]}")
    for bad in (None, "", KEYS[0][:-1], KEYS[0] + "x", "Bearer", f"Basic {KEYS[0]}"):
        assert not check.accepts_header(bad) and not check.accepts(bad if bad != "Bearer" else None)
    assert not KeyCheck([])


def test_https_api_keys_with_the_official_client(secure):
    """HTTPS verified against the test CA: either key is served, as OpenAI's clients send
    it or as Anthropic's; a missing or wrong key gets a 401 (each client raises its
    AuthenticationError)."""
    assert _chat(secure.openai(KEYS[0])) in ("stop", "length")
    assert _chat(secure.openai(KEYS[1])) in ("stop", "length")            # the one from --api-key-file
    for key in ("sk-wrong", KEYS[0] + "x", KEYS[0][:-1]):
        with pytest.raises(openai.AuthenticationError) as e:
            _chat(secure.openai(key))
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    # Anthropic's SDK sends its key as x-api-key, and gets Anthropic's error object.
    anthropic = pytest.importorskip("anthropic")

    def message(key: str):
        client = anthropic.Anthropic(base_url=secure.http, api_key=key, max_retries=0,
                                     http_client=anthropic.DefaultHttpxClient(verify=secure.tls_context(), timeout=120))
        return client.messages.create(model="SmolLM2-135M-Instruct", max_tokens=2,
                                      messages=[{"role": "user", "content": "Hi"}])
    assert message(KEYS[1]).stop_reason in ("end_turn", "max_tokens")
    with pytest.raises(anthropic.AuthenticationError) as e:
        message("sk-wrong")
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.get(f"{secure.http}/v1/models", verify=secure.tls_context())         # no key at all
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert "didn't provide an API key" in r.json()["error"]["message"]
    for open_path in ("/health", "/ping", "/ready", "/metrics"):         # probes and scrapes need no key
        assert httpx.get(f"{secure.http}{open_path}", verify=secure.tls_context()).status_code == 200, open_path
    with pytest.raises((httpx.ConnectError, httpx.RemoteProtocolError)):  # no plaintext beside TLS
        httpx.get(secure.http.replace("https", "http") + "/health")


def test_tokenizer_routes_need_a_key_like_the_rest(secure):
    with httpx.Client(base_url=secure.http, verify=secure.tls_context(), timeout=60) as http:
        for path, body in [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [28120]})]:
            refused = http.post(path, json=body)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            assert http.post(path, json=body, headers={"authorization": f"Bearer {KEYS[1]}"}).status_code == 200


def test_grpc_api_keys_over_tls(secure):
    creds = grpc.ssl_channel_credentials(Path(secure.ca).read_bytes())
    req = generate_pb2.GenerateRequest(prompt="Hello", sampling=generate_pb2.SamplingParams(max_tokens=3))
    with grpc.secure_channel(secure.grpc_addr, creds) as ch:
        stub = generate_pb2_grpc.GeneratorStub(ch)
        for metadata in ((), (("authorization", "Bearer sk-wrong"),), (("authorization", KEYS[0]),)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, metadata=metadata, timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
        replies = list(stub.Generate(req, metadata=(("authorization", f"Bearer {KEYS[1]}"),), timeout=60))
        assert replies[-1].finish_reason in ("stop", "length")
        # A caller is authenticated before its bytes are decoded: a stranger's corrupt
        # message is refused as a stranger's; a key holder's is named as corrupt.
        raw = ch.unary_stream("/pdserve.v1.Generator/Generate")
        for metadata, code in (((), grpc.StatusCode.UNAUTHENTICATED),
                               ((("authorization", f"Bearer {KEYS[1]}"),), grpc.StatusCode.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as e:
                list(raw(b"\xff\xff\xff", metadata=metadata, timeout=30))
            assert e.value.code() == code, (metadata, e.value.details())
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_a_worker_refuses_callers_without_the_credential_or_a_client_certificate(secure):
    """Reserve straight to the decode worker: over mutual TLS with the router's certificate
    but no cluster credential, UNAUTHENTICATED and no block taken; without a client
    certificate the handshake itself fails; with both, served."""
    reserve = worker_pb2.ReserveRequest(request_id="intruder", num_prompt_tokens=64, lease_seconds=1e9)
    with secure.worker_channel("decode", credential=False) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        for call in (lambda: stub.Reserve(reserve, timeout=10), lambda: stub.Info(worker_pb2.InfoRequest(), timeout=10),
                     lambda: list(stub.Decode(worker_pb2.DecodeRequest(request_id="x"), timeout=10))):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING          # probes stay open
    with secure.worker_channel("decode", client_cert=False) as ch:
        with pytest.raises(grpc.RpcError) as e:
            worker_pb2_grpc.DecodeWorkerStub(ch).Reserve(reserve, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(secure.addr("decode")) as ch:
        with pytest.raises(grpc.RpcError) as e:
            worker_pb2_grpc.DecodeWorkerStub(ch).Info(worker_pb2.InfoRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with secure.worker_channel("decode") as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        info = stub.Info(worker_pb2.InfoRequest(), timeout=10)
        assert info.free_blocks == info.num_blocks
        handle = stub.Reserve(reserve, timeout=10)                  # a lease of 1e9 s is capped at 120 s
        assert handle.write_deadline - time.time() <= 121 and 110 < handle.write_seconds <= 120
        assert stub.Release(worker_pb2.ReleaseRequest(request_id="intruder", epoch=handle.epoch)).released


def test_json_routes_take_only_json_and_cors_only_for_allowed_origins(secure):
    headers = {"authorization": f"Bearer {KEYS[0]}"}
    body = json.dumps({"prompt": "hi", "max_tokens": 1})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        h = {**headers, **({"content-type": ctype} if ctype else {})}
        r = httpx.post(f"{secure.http}/v1/completions", content=body, headers=h, verify=secure.tls_context())
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", (ctype, r.text)
    r = httpx.post(f"{secure.http}/v1/completions", content=body, verify=secure.tls_context(),
                   headers={**headers, "content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text
    preflight = {"origin": "https://app.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization,content-type"}
    r = httpx.options(f"{secure.http}/v1/completions", headers=preflight, verify=secure.tls_context())
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.options(f"{secure.http}/v1/completions", headers={**preflight, "origin": "https://evil.example"},
                      verify=secure.tls_context())
    assert "access-control-allow-origin" not in r.headers
    for path in ("/v1/completions", "/v1/nope"):          # no preflight: the key check, as any method
        assert httpx.options(f"{secure.http}{path}", verify=secure.tls_context()).status_code == 401, path


def test_responses_name_workers_by_id_not_address(secure):
    r = httpx.post(f"{secure.http}/v1/completions", verify=secure.tls_context(), timeout=60,
                   headers={"authorization": f"Bearer {KEYS[0]}"}, json={"prompt": "hi", "max_tokens": 1})
    route = dict(p.split("=", 1) for p in r.headers["x-pdserve-route"].split(";"))
    with secure.worker_channel("decode") as ch:
        epoch = worker_pb2_grpc.DecodeWorkerStub(ch).Info(worker_pb2.InfoRequest(), timeout=10).epoch
    assert route["decode"] == f"decode-{epoch}" and route["prefill"].startswith("prefill-")
    assert "127.0.0.1" not in r.headers["x-pdserve-route"]


def test_no_cors_and_no_key_by_default(cluster):
    """`pdserve up` without --api-key or --allowed-origins: open to its callers (the
    loopback default), and no browser origin may read its answers."""
    r = httpx.options(f"{cluster.http}/v1/completions", headers={
        "origin": "https://app.example", "access-control-request-method": "POST"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.post(f"{cluster.http}/v1/completions", content=json.dumps({"prompt": "hi", "max_tokens": 1}),
                   headers={"content-type": "text/plain"})
    assert r.status_code == 415


def _listeners(pid: int) -> list[str]:
    """Local addresses of the TCP and UDP sockets `pid` listens on, as `ss` prints them."""
    out = subprocess.run(["ss", "-H", "-l", "-n", "-t", "-u", "-p"], capture_output=True, text=True, check=True).stdout
    return [line.split()[4] for line in out.splitlines() if f"pid={pid}," in line]


@pytest.mark.skipif(shutil.which("ss") is None, reason="ss (iproute2) is not installed")
def test_every_listener_binds_the_address_it_was_given(cluster):
    """After traffic has crossed every KV transport the cluster uses (NIXL/UCX included
    where it is installed), every socket the router and each worker listen on is bound
    to 127.0.0.1, the address `pdserve up` gives them: none to 0.0.0.0 or another
    interface."""
    r = httpx.post(f"{cluster.http}/v1/completions", timeout=120, json={"prompt": "Hello there", "max_tokens": 4})
    assert r.status_code == 200
    pids = {"router": cluster.info["router_pid"], **{f"prefill-{i}": w["pid"] for i, w in
            enumerate(cluster.info["prefills"])}, **{f"decode-{i}": w["pid"] for i, w in
            enumerate(cluster.info["decodes"])}}
    seen = {name: _listeners(pid) for name, pid in pids.items()}
    print(json.dumps(seen, indent=1))
    for name, addresses in seen.items():
        assert addresses, f"{name} listens on nothing?"
        for address in addresses:
            host = address.rpartition(":")[0].strip("[]")
            assert host in ("127.0.0.1", "::ffff:127.0.0.1"), (name, address, seen)


@pytest.mark.slow          # the bench against a cluster is test_bench_tool's; here, only its key
def test_bench_sends_its_api_key(secure, tmp_path):
    """`pdserve bench --api-key` against the HTTPS router (the test CA trusted through
    SSL_CERT_FILE, as for any client): served; without the key it stops at once."""
    import os
    import sys
    env = {**os.environ, "SSL_CERT_FILE": secure.ca}
    cmd = [sys.executable, "-m", "services.cli", "bench", "--base-url", secure.http, "--num-prompts", "2",
           "--input-len", "8", "--output-len", "2", "--no-progress"]
    ok = subprocess.run([*cmd, "--api-key", KEYS[1], "--json", str(tmp_path / "run.json")], env=env,
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["summary"]["completed"] == 2 and KEYS[1] not in (tmp_path / "run.json").read_text()
    refused = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "401" in refused.stdout + refused.stderr


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed (make test does)")
def test_a_registry_behind_a_password(tmp_path):
    """A real redis-server with requirepass: the registry works with the password in the
    URL and is refused without it; logs name the server without the password."""
    import asyncio

    import redis.exceptions

    from services.common.registry import RedisRegistry
    port, password = free_port(), "pw-" + "x" * 24
    server = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind", "127.0.0.1",
                               "--requirepass", password, "--protected-mode", "yes", "--save", "",
                               "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    secret = ClusterSecret.from_file(str(new_secret_file(tmp_path / "secret")))
    info = worker_pb2.WorkerInfo(role="decode", epoch="e1", address="127.0.0.1:1")

    async def run():
        for _ in range(100):
            try:
                good = RedisRegistry(f"redis://:{password}@127.0.0.1:{port}/0", secret=secret)
                await good.announce(info)
                break
            except (redis.exceptions.ConnectionError, OSError):
                await good.close()
                await asyncio.sleep(0.05)
        assert [w.epoch for w in await good.workers()] == ["e1"]
        assert password not in good.where and good.where == f"redis://127.0.0.1:{port}/0"
        await good.close()
        anonymous = RedisRegistry(f"redis://127.0.0.1:{port}/0", secret=secret)
        with pytest.raises(redis.exceptions.AuthenticationError):
            await anonymous.workers()
        await anonymous.close()
    try:
        asyncio.run(run())
    finally:
        terminate(server)


def test_a_tls_router_with_idle_clients_connected_stops_at_once(secure):
    """Stops `secure`'s router, so it runs after every other test of it. Two clients hold
    idle TLS connections: the official client's kept-alive one, between two requests, and
    one that sent nothing. SIGTERM ends the router in a few seconds, not after asyncio's
    30-s wait for each client's close_notify, which an idle client never sends."""
    client = secure.openai(KEYS[0])
    assert _chat(client) in ("stop", "length")
    port = int(secure.http.rsplit(":", 1)[1])
    silent = secure.tls_context().wrap_socket(socket.create_connection(("127.0.0.1", port)),
                                              server_hostname="127.0.0.1")
    try:
        started = time.monotonic()
        code = terminate(secure.procs.pop("router"), timeout=25)
        took = time.monotonic() - started
        assert code == 0 and took < 6, f"exit code {code} after {took:.1f} s"
    finally:
        silent.close()
