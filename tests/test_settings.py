"""Flags and their PDSERVE_* environment defaults, and settings validation."""
import pytest

from services.cli import _parser
from services.common.settings import RouterSettings, WorkerSettings, env_defaults


def test_environment_sets_any_flag_default_and_the_command_line_wins():
    parser = _parser()
    env_defaults(parser, {"PDSERVE_REDIS": "redis://r:6379/0", "PDSERVE_KV_CACHE_TOKENS": "4096",
                          "PDSERVE_DECODE": "a:1, b:2", "PDSERVE_ADVERTISE": "decode-0.svc:7001"})
    a = parser.parse_args(["decode"])
    assert a.redis == "redis://r:6379/0" and a.kv_cache_tokens == 4096 and a.advertise == "decode-0.svc:7001"
    assert parser.parse_args(["decode", "--kv-cache-tokens", "512"]).kv_cache_tokens == 512
    assert parser.parse_args(["router"]).decode == ["a:1", "b:2"]


def test_advertised_address():
    assert WorkerSettings(role="decode").advertise_address(7001) == "127.0.0.1:7001"
    s = WorkerSettings(role="decode", host="0.0.0.0", advertise="decode-0.svc:9000")
    assert s.advertise_address(7001) == "decode-0.svc:9000" and s.advertise_host == "decode-0.svc"
    s = WorkerSettings(role="prefill", host="0.0.0.0", advertise="10.0.0.5")
    assert s.advertise_address(7002) == "10.0.0.5:7002" and s.transport_options()["tcp"]["advertise"] == "10.0.0.5"


def test_router_needs_a_registry_or_addresses():
    with pytest.raises(ValueError):
        RouterSettings()
    assert RouterSettings(redis="redis://x").redis
    with pytest.raises(ValueError):
        WorkerSettings(role="prefill", prefix_cache_tokens=-1)
