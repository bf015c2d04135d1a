"""The router is a small process: it tokenizes, routes and streams, and loads no torch
(nor xgrammar, which imports it). Schemas it reads with the pure checks of
text/json_schema.py; the workers compile them, and a schema they cannot compile comes
back as the router's own 400."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

# What the router process imports and runs on its own, before any worker answers.
FRESH_ROUTER = """
import json, sys
import services.cli
from services.router import grpc_api, openai_api, server
from services.engine.text import json_schema
from services.engine.text.model_store import context_length, default_model_dir, read_config
from services.engine.text.tokenizer import encode_chat, load_tokenizer
tokenizer = load_tokenizer(default_model_dir())
assert encode_chat(tokenizer, [{"role": "user", "content": "hi"}])
assert context_length(read_config(default_model_dir())) > 0
json_schema.parse(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "xgrammar"))))
"""


def test_the_router_imports_no_torch_in_a_fresh_interpreter(model_dir):
    done = subprocess.run([sys.executable, "-c", FRESH_ROUTER], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_a_serving_router_has_no_torch_library_mapped(cluster):
    """The running router's memory map, after it has served a request with a schema: no
    libtorch, while a worker's has it (the check would see it). `up`'s own is
    test_lifecycle's (the tests' clusters fork theirs from a process that holds torch)."""
    r = httpx.post(f"{cluster.http}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Give a number."}], "max_tokens": 8, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}})
    assert r.status_code == 200, r.text

    def maps(pid: int) -> str:
        return Path(f"/proc/{pid}/maps").read_text()
    assert "libtorch" not in maps(cluster.info["router_pid"])
    assert "libtorch" in maps(cluster.info["decodes"][0]["pid"])


def test_a_schema_only_a_worker_can_refuse_is_the_routers_400(cluster):
    """A lookbehind, which xgrammar cannot compile, passes the router's pure checks; the worker's
    refusal arrives as the same error the router gives the schemas it refuses."""
    schema = {"type": "string", "pattern": "(?<=a)b"}
    r = httpx.post(f"{cluster.http}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_json_schema" and "JSON schema" in err["message"], err
    ok = httpx.post(f"{cluster.http}/v1/completions", timeout=60,
                    json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200, ok.text
