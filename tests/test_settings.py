"""Flags and their PDSERVE_* environment defaults, and settings validation."""
import pytest

from services.cli import _parser
from services.common.flags import env_defaults
from services.common.settings import RouterSettings, WorkerSettings


def test_environment_sets_any_flag_default_and_the_command_line_wins():
    parser = _parser()
    env_defaults(parser, {"PDSERVE_REDIS": "redis://r:6379/0", "PDSERVE_KV_CACHE_TOKENS": "4096",
                          "PDSERVE_DECODE": "a:1, b:2", "PDSERVE_ADVERTISE": "decode-0.svc:7001"})
    a = parser.parse_args(["decode"])
    assert a.redis == "redis://r:6379/0" and a.kv_cache_tokens == 4096 and a.advertise == "decode-0.svc:7001"
    assert parser.parse_args(["decode", "--kv-cache-tokens", "512"]).kv_cache_tokens == 512
    assert parser.parse_args(["router"]).decode == ["a:1", "b:2"]
    assert parser.parse_args(["router", "--decode", "c:3", "--decode", "d:4"]).decode == ["c:3", "d:4"]   # not added


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


def test_without_a_private_registry_up_cannot_autoscale_or_use_ray_unless_given_one():
    from services.common.settings import ClusterSettings
    assert not ClusterSettings(private_registry=False).private_registry
    for flag in ("autoscale", "ray"):
        with pytest.raises(ValueError, match=f"--{flag} needs a registry"):
            ClusterSettings(private_registry=False, **{flag: True})
        assert ClusterSettings(private_registry=False, redis="redis://x", **{flag: True}).redis


def test_flags_come_from_the_settings_fields_and_booleans_switch_both_ways():
    parser = _parser()
    assert parser.parse_args(["up"]).pin_cpus is True
    assert parser.parse_args(["up", "--no-pin-cpus"]).pin_cpus is False
    for env in ({"PDSERVE_PIN_CPUS": "0"}, {"PDSERVE_NO_PIN_CPUS": "1"}, {"PDSERVE_PIN_CPUS": "false"}):
        p = _parser()
        env_defaults(p, env)
        assert p.parse_args(["up"]).pin_cpus is False, env
        assert p.parse_args(["up", "--pin-cpus"]).pin_cpus is True         # the command line still wins
    p = _parser()
    with pytest.raises(ValueError, match="PDSERVE_PIN_CPUS"):
        env_defaults(p, {"PDSERVE_PIN_CPUS": "maybe"})


def test_one_name_means_one_thing_in_the_environment():
    """`up` counts workers (PDSERVE_NUM_PREFILL); a router lists addresses (PDSERVE_PREFILL)."""
    parser = _parser()
    env_defaults(parser, {"PDSERVE_NUM_PREFILL": "3", "PDSERVE_PREFILL": "p:1", "PDSERVE_DECODE": "d:2"})
    up = parser.parse_args(["up"])
    assert up.num_prefill == 3 and up.num_decode == 0            # 0: the default count
    router = parser.parse_args(["router"])
    assert router.prefill == ["p:1"] and router.decode == ["d:2"]


def test_a_settings_object_renders_to_the_flags_that_rebuild_it():
    from services.common.flags import from_args, to_argv
    parser = _parser()
    w = WorkerSettings(role="prefill", dtype="float32", prefix_cache_tokens=0, redis="unix:///tmp/r.sock",
                       max_num_batched_tokens=2048, fault_drop_transfers=0.25)
    assert from_args(WorkerSettings, parser.parse_args(["prefill", *to_argv(w)]), role="prefill") == w
    assert "--kv-cache-tokens" not in " ".join(to_argv(w))          # a decode worker's setting
    r = RouterSettings(decode=["a:1", "b:2"], prefill=["c:3"], aggregated=True, max_pending=7,
                       served_model_name=["smol", "SmolLM2-135M-Instruct"])
    assert from_args(RouterSettings, parser.parse_args(["router", *to_argv(r)])) == r


def test_served_model_names_are_given_as_vllm_takes_them():
    """--served-model-name a b (vLLM's nargs="+"), repeated, or PDSERVE_SERVED_MODEL_NAME=a,b;
    `up` hands them to its router and workers alike."""
    from services.common.flags import from_args
    from services.common.settings import ClusterSettings
    parser = _parser()
    for argv in (["--served-model-name", "smol", "hf/smol"], ["--served-model-name", "smol", "--served-model-name",
                                                              "hf/smol"]):
        up = from_args(ClusterSettings, parser.parse_args(["up", *argv, "--dtype", "float32"]))
        assert up.served_model_name == ["smol", "hf/smol"] and up.dtype == "float32", argv
        assert up.worker("decode").served_model_name == up.router(redis="redis://x").served_model_name == ["smol",
                                                                                                        "hf/smol"]
    env_defaults(parser, {"PDSERVE_SERVED_MODEL_NAME": "smol,hf/smol"})
    assert parser.parse_args(["router"]).served_model_name == ["smol", "hf/smol"]
    assert parser.parse_args(["router", "--served-model-name", "cli"]).served_model_name == ["cli"]
    assert from_args(RouterSettings, _parser().parse_args(["router", "--redis", "redis://x"])).served_model_name == []


def test_up_hands_its_engine_settings_to_every_worker():
    from services.common.flags import from_args
    from services.common.settings import ClusterSettings
    c = from_args(ClusterSettings, _parser().parse_args(["up", "--dtype", "float32", "--block-size", "32",
                                                         "--max-num-batched-tokens", "1024", "--host", "0.0.0.0"]))
    w = c.worker("decode", threads=1, redis=None)
    assert (w.dtype, w.block_size, w.max_num_batched_tokens, w.threads, w.host) == ("float32", 32, 1024, 1,
                                                                                   "127.0.0.1")
    assert c.router(redis="redis://x").host == "0.0.0.0" and not c.router(redis="redis://x").aggregated


def test_dtype_auto_fits_the_cpu():
    import torch

    from services.engine.model.hardware import cpu_kind, pick_dtype
    cpu = torch.device("cpu")
    avx2 = frozenset({"avx", "avx2", "fma"})
    bf16 = avx2 | {"avx512f", "avx512_bf16"}
    assert pick_dtype("auto", cpu, avx2).name == "float32"
    assert "no native bfloat16" in pick_dtype("auto", cpu, avx2).reason
    assert pick_dtype("auto", cpu, bf16).name == "bfloat16"
    assert pick_dtype("auto", cpu, bf16 | {"amx_bf16"}).name == "bfloat16"
    assert pick_dtype("auto", torch.device("cuda"), avx2).name == "bfloat16"
    assert pick_dtype("float32", cpu, bf16).name == "float32"
    assert (cpu_kind(avx2), cpu_kind(bf16)) == ("avx2", "avx512-bf16")
    with pytest.raises(ValueError):
        pick_dtype("float8", cpu, bf16)


# Flag sets of the three CPU kinds the project's machines have had (as /proc/cpuinfo names them).
AVX2_ONLY = frozenset({"avx", "avx2", "fma"})
ZEN4 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_tile", "amx_int8"}


@pytest.mark.parametrize("flags, bf16, int8, f32", [
    (AVX2_ONLY, False, False, True),            # float32 matmuls only: bf16 would be emulated
    (ZEN4, True, True, False),                  # vdpbf16ps / vpdpbusd kernels, the one-call decoder
    (SAPPHIRE_RAPIDS, False, False, False),     # oneDNN's AMX tiles for matmuls and SDPA
], ids=["avx2", "avx512-bf16", "amx-bf16"])
def test_which_cpu_kernels_each_cpu_kind_takes(flags, bf16, int8, f32):
    """The one rule the runner applies and the kernel tests skip by (hardware.CpuKernels),
    on each CPU kind, from flag sets: it runs the same on any machine."""
    from services.engine.model.hardware import cpu_kernels
    kernels = cpu_kernels(flags)
    assert (kernels.bf16_matmul, kernels.int8_matmul, kernels.f32_matmul) == (bf16, int8, f32)
    assert kernels.one_call_decoder == kernels.bf16_prefill == bf16


def test_mixed_prefill_cap_defaults_by_role_and_device():
    from services.common.budgets import MIXED_PREFILL_CPU, MIXED_PREFILL_GPU
    from services.worker.main import scheduler_config
    decode = WorkerSettings(role="decode")
    assert scheduler_config(decode, "cpu").max_mixed_prefill == MIXED_PREFILL_CPU
    assert scheduler_config(decode, "cpu", 3e-4).context_cost == 3e-4
    assert scheduler_config(WorkerSettings(role="prefill"), "cpu", 3e-4).context_cost == 0.0
    assert scheduler_config(decode, "cuda").max_mixed_prefill == MIXED_PREFILL_GPU
    assert scheduler_config(WorkerSettings(role="decode", mixed_prefill_tokens=0)).max_mixed_prefill == 0
    assert scheduler_config(WorkerSettings(role="decode", mixed_prefill_tokens=96)).max_mixed_prefill == 96
    assert scheduler_config(WorkerSettings(role="prefill")).max_mixed_prefill == 0   # nothing decodes there
    with pytest.raises(ValueError):
        WorkerSettings(role="decode", mixed_prefill_tokens=-2)


def test_token_budget_defaults_by_role_and_device():
    from services.common import budgets
    from services.worker import main
    budget = {(role, device): main.scheduler_config(WorkerSettings(role=role), device).max_num_batched_tokens
              for role in ("prefill", "decode") for device in ("cpu", "cuda")}
    assert budget == {("prefill", "cpu"): budgets.PREFILL_TOKEN_BUDGET, ("decode", "cpu"): budgets.DECODE_TOKEN_BUDGET,
                      ("prefill", "cuda"): budgets.PREFILL_TOKEN_BUDGET_GPU,
                      ("decode", "cuda"): budgets.DECODE_TOKEN_BUDGET_GPU}
    assert main.scheduler_config(WorkerSettings(role="decode", max_num_batched_tokens=300),
                                 "cuda").max_num_batched_tokens == 300


def test_the_router_url_reaches_a_wildcard_bind_on_loopback_and_names_https():
    from types import SimpleNamespace

    from services.local_processes import router_url
    plain, tls = SimpleNamespace(host="0.0.0.0", tls_cert=None), SimpleNamespace(host="::", tls_cert="cert.pem")
    assert router_url(plain, 8000) == "http://127.0.0.1:8000"
    assert router_url(plain, 8000, loopback=False) == "http://0.0.0.0:8000"
    assert router_url(tls, 8443) == "https://[::1]:8443"
    assert router_url(SimpleNamespace(host="10.1.2.3", tls_cert=None), 80) == "http://10.1.2.3:80"


def test_the_device_kind_is_known_without_torch_where_no_gpu_driver_is(monkeypatch, tmp_path):
    """`pdserve up` decides cuda or cpu for --device auto from the driver's device nodes;
    where one is present, torch decides (as the workers do)."""
    import torch

    from services.common import devices
    assert devices.device_type("cuda:1") == "cuda" and devices.device_type("cpu") == "cpu"
    monkeypatch.setattr(devices, "GPU_DRIVER_NODES", (str(tmp_path / "nvidiactl"),))
    assert devices.device_type("auto") == devices.device_type() == "cpu"
    (tmp_path / "nvidiactl").touch()
    assert devices.device_type("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


def test_what_up_cannot_use_is_one_line_before_anything_starts(tmp_path, capsys, monkeypatch):
    """Each is said in one line with exit code 2, before a worker loads a model: a port
    out of range (each role names its own flag), a port another process holds, a model
    folder without weights, a PDSERVE_ variable that is no value of its flag (even for
    --help)."""
    import socket

    from services.cli import main
    from services.engine.text.model_store import check_weights
    from services.local_processes import check_ports_free
    with pytest.raises(ValueError, match="--http-port must be a port number.*not 70000"):
        RouterSettings(redis="redis://x", http_port=70000)
    with pytest.raises(ValueError, match="--port must be a port number.*not -1"):
        WorkerSettings(role="decode", grpc_port=-1)
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ValueError, match=f"--grpc-port {port}: cannot listen on 127.0.0.1:{port}"):
            check_ports_free("127.0.0.1", {"--http-port": 0, "--grpc-port": port})
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no weights there"):
        check_weights(tmp_path)
    monkeypatch.setenv("PDSERVE_PIN_CPUS", "maybe")
    assert main(["--version"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "PDSERVE_PIN_CPUS='maybe'" in err


def test_help_shows_each_flags_default_and_what_the_environment_made_it(monkeypatch, capsys):
    from services.cli import main
    with pytest.raises(SystemExit):
        main(["up", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "OpenAI-compatible HTTP port (default: 8000)" in text and "(default: 0.9)" in text
    monkeypatch.setenv("PDSERVE_MAX_BATCH", "32")
    with pytest.raises(SystemExit):
        main(["up", "--help"])
    assert "running batch (default: 32)" in " ".join(capsys.readouterr().out.split())


def test_only_decode_workers_replay_cuda_graphs():
    """A prefill worker's steps export each layer as it is written, so they run eagerly:
    its ranks must never replay a graph either (their all-reduces would not meet)."""
    assert WorkerSettings(role="decode").cuda_graphs and not WorkerSettings(role="decode", enforce_eager=True).cuda_graphs
    assert not WorkerSettings(role="prefill").cuda_graphs


def test_a_workers_stop_bound_covers_its_drain_and_each_ranks_join():
    """What `up` (and the worker itself) waits for before taking a stop for stuck: the
    drain, the gRPC grace, the engine's join and one per rank, and slack; `up` gave every
    worker 45 s, under a TP-2 worker's own 70."""
    one, two = WorkerSettings(role="decode"), WorkerSettings(role="decode", tensor_parallel_size=2)
    assert one.stop_seconds == 60 and two.stop_seconds == 70
    assert WorkerSettings(role="prefill", drain_timeout=90).stop_seconds == 120
