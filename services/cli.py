"""The `pdserve` command: `up` (local cluster, or Ray actors with --ray), `scale` (Ray pools),
`router`, `prefill`, `decode`, `autoscaler`, `convert-model`, `bench` (load generator)."""
from __future__ import annotations

import argparse
import asyncio
import sys

from services.bench.command import add_arguments as bench_arguments
from services.common.settings import (ATTENTION_KERNELS, DTYPES, KV_TRANSPORTS, AutoscalerSettings,
                                      RouterSettings, WorkerSettings, env_defaults)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a local Hugging Face model folder (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"])


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--kv-transport", default="auto", choices=KV_TRANSPORTS,
                   help="KV transfer backend; auto offers/uses the fastest that works for each pair")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: automatic)")
    p.add_argument("--attention-kernel", default="auto", choices=ATTENTION_KERNELS,
                   help="attention: native (C kernels built on first use; CPU), torch (torch's own ops), "
                        "or auto (native where it applies and builds)")


def _worker_args(p: argparse.ArgumentParser, decode: bool) -> None:
    _model_args(p)
    _engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    p.add_argument("--metrics-port", type=int, default=0)
    p.add_argument("--advertise", default=None, metavar="HOST[:PORT]",
                   help="address routers and peers use to reach this worker (default: --host and the bound port)")
    _registry_args(p)
    p.add_argument("--fault-drop-transfers", type=float, default=0.0,
                   help="fault testing: fraction of KV transfers to drop midway")
    p.add_argument("--announce-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds accepted requests may still run before the worker stops")
    if decode:
        p.add_argument("--kv-cache-tokens", type=int, default=65536, help="KV pool size in tokens")
        p.add_argument("--max-batch", type=int, default=64, help="most sequences decoded per step")
        p.add_argument("--prefill-chunk-tokens", type=int, default=0,
                       help="prompts prefilled on this worker run this many tokens per step, interleaved "
                            "with decoding (0: a whole prompt per step)")
    else:
        p.add_argument("--prefix-cache-tokens", type=int, default=16384,
                       help="prompt KV kept for reuse by later prompts with the same prefix (0: off)")


def _registry_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis", default=None, metavar="URL",
                   help="Redis registry (redis://host:6379/0): workers announce themselves, routers discover them")
    p.add_argument("--registry-ttl", type=float, default=3.0,
                   help="seconds a worker stays routable after its last heartbeat")


def _routing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-pending", type=int, default=512,
                   help="requests admitted at once; beyond it new ones get 429 / RESOURCE_EXHAUSTED")
    p.add_argument("--local-prefill-max-tokens", type=int, default=256,
                   help="prompts up to this size may prefill on the decode worker when the cost model "
                        "says it is faster (0: always use a prefill worker)")


def _autoscaling_args(p: argparse.ArgumentParser) -> None:
    """The policy, bounds and budget: the same flags for `up --autoscale` and `autoscaler`."""
    from services.autoscaler.core import Policy
    d = Policy()
    g = p.add_argument_group("autoscaling (docs/autoscaling.md)")
    g.add_argument("--slo-ttft", type=float, default=d.slo_ttft * 1000, metavar="MS",
                   help="time-to-first-token p90 target of the prefill pool, ms")
    g.add_argument("--slo-itl", type=float, default=d.slo_itl * 1000, metavar="MS",
                   help="inter-token latency p90 target of the decode pool, ms")
    for role in ("prefill", "decode"):
        g.add_argument(f"--min-{role}", type=int, default=1, metavar="N", help=f"fewest {role} workers")
        g.add_argument(f"--max-{role}", type=int, default=4, metavar="N", help=f"most {role} workers")
    g.add_argument("--budget", type=int, default=None, metavar="SLOTS",
                   help="most workers in both pools together (or GPUs, with --prefill-cost/--decode-cost)")
    g.add_argument("--prefill-cost", type=int, default=1, metavar="SLOTS", help="budget slots a prefill worker holds")
    g.add_argument("--decode-cost", type=int, default=1, metavar="SLOTS", help="budget slots a decode worker holds")
    g.add_argument("--autoscale-interval", type=float, default=15.0, metavar="S", help="seconds between decisions")
    timings = [("--latency-window", "window", "latency percentiles over this many seconds"),
               ("--warmup", "warmup", "a worker younger than this is warming: its samples are ignored"),
               ("--scale-out-cooldown", "scale_out_cooldown", "after a pool changed, before it may grow again"),
               ("--scale-in-cooldown", "scale_in_cooldown", "after a pool changed, before it may shrink"),
               ("--scale-in-after", "scale_in_after", "calm this long before a pool shrinks"),
               ("--pending-timeout", "pending_timeout", "workers not up after this long are cancelled"),
               ("--manual-hold", "manual_hold", "a replica count changed by someone else is left alone this long")]
    for flag, field_name, text in timings:
        g.add_argument(flag, dest=field_name, type=float, default=getattr(d, field_name), metavar="S", help=text)
    g.add_argument("--min-latency-samples", dest="min_samples", type=int, default=d.min_samples, metavar="N",
                   help="fewer latency samples in the window are no signal")
    g.add_argument("--target-prefill-busy", type=float, default=d.target_prefill_busy, metavar="F",
                   help="share of time a prefill worker computes that counts as full")
    g.add_argument("--target-prefill-queue-tokens", type=int, default=d.target_prefill_queue_tokens, metavar="N",
                   help="queued prefill tokens per prefill worker that count as full")
    g.add_argument("--target-kv-utilisation", type=float, default=d.target_kv_utilisation, metavar="F",
                   help="fraction of a decode worker's KV blocks in use that counts as full")
    g.add_argument("--target-running", type=int, default=d.target_running, metavar="N",
                   help="sequences per decode worker that count as full")


def _autoscaler_settings(a, actuator: str, redis: str | None) -> AutoscalerSettings:
    from services.autoscaler.core import Limits, Policy, PoolBounds
    policy = Policy(slo_ttft=a.slo_ttft / 1000, slo_itl=a.slo_itl / 1000,
                    target_prefill_queue_tokens=a.target_prefill_queue_tokens,
                    target_prefill_busy=a.target_prefill_busy, min_samples=a.min_samples,
                    target_kv_utilisation=a.target_kv_utilisation, target_running=a.target_running,
                    window=a.window, warmup=a.warmup, scale_out_cooldown=a.scale_out_cooldown,
                    scale_in_cooldown=a.scale_in_cooldown, scale_in_after=a.scale_in_after,
                    pending_timeout=a.pending_timeout, manual_hold=a.manual_hold)
    limits = Limits(PoolBounds(a.min_prefill, a.max_prefill), PoolBounds(a.min_decode, a.max_decode), a.budget,
                    a.prefill_cost, a.decode_cost)
    return AutoscalerSettings(redis=redis, policy=policy, limits=limits, actuator=actuator,
                              interval=a.autoscale_interval, namespace=getattr(a, "namespace", None),
                              prefill_deployment=getattr(a, "prefill_deployment", None),
                              decode_deployment=getattr(a, "decode_deployment", None),
                              kubeconfig=getattr(a, "kubeconfig", None), host=a.host,
                              metrics_port=getattr(a, "metrics_port", None), log_level=a.log_level)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start router, prefill and decode workers on this machine")
    _model_args(up)
    _engine_args(up)
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--http-port", type=int, default=8000)
    up.add_argument("--grpc-port", type=int, default=50051)
    up.add_argument("--served-model-name", default=None)
    up.add_argument("--kv-cache-tokens", type=int, default=65536)
    up.add_argument("--max-batch", type=int, default=64)
    up.add_argument("--prefix-cache-tokens", type=int, default=16384)
    up.add_argument("--mode", choices=("disaggregated", "aggregated"), default="disaggregated",
                    help="disaggregated: prefill and decode workers, one core each when they fit; aggregated: "
                         "decode workers that also prefill (chunked), sharing the cores")
    up.add_argument("--prefill-chunk-tokens", type=int, default=None,
                    help="decode workers' local prefill chunk (default: 256 aggregated, whole prompts otherwise)")
    up.add_argument("--no-pin-cpus", dest="pin_cpus", action="store_false",
                    help="do not pin each disaggregated worker to its own core")
    up.add_argument("--prefill", dest="num_prefill", type=int, default=1, metavar="N", help="prefill workers")
    up.add_argument("--decode", dest="num_decode", type=int, default=1, metavar="M", help="decode workers")
    up.add_argument("--redis", default=None, metavar="URL",
                    help="registry to use; default: start a private redis-server if one is installed, "
                         "else give the router the workers' addresses")
    _routing_args(up)
    up.add_argument("--announce-file", default=None, help="write the cluster's addresses here as JSON")
    up.add_argument("--autoscale", action="store_true",
                    help="grow and shrink each pool on its own signal within --min/--max-prefill/decode "
                         "(needs the Redis registry); --prefill/--decode are the starting sizes")
    _autoscaling_args(up)
    up.add_argument("--ray", action="store_true", help="run the services as Ray actors (see --address)")
    up.add_argument("--address", default=None, metavar="ADDR",
                    help="with --ray: the Ray cluster to join (default: start a Ray instance on this machine)")

    scaler = sub.add_parser("autoscaler", help="scale the prefill and decode pools (Kubernetes Deployments)")
    scaler.add_argument("--redis", default=None, metavar="URL", help="the registry the workers use (required)")
    scaler.add_argument("--actuator", default="report", choices=["kubernetes", "report"],
                        help="kubernetes: set the Deployments' scale; report: only log what it would set")
    scaler.add_argument("--namespace", default=None, help="Kubernetes namespace of the Deployments")
    scaler.add_argument("--prefill-deployment", default=None, metavar="NAME")
    scaler.add_argument("--decode-deployment", default=None, metavar="NAME")
    scaler.add_argument("--kubeconfig", default=None, metavar="FILE",
                        help="default: in-cluster credentials, else ~/.kube/config")
    scaler.add_argument("--host", default="127.0.0.1", help="address of its /metrics and /healthz")
    scaler.add_argument("--metrics-port", type=int, default=None, help="serve /metrics and /healthz here")
    scaler.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    _autoscaling_args(scaler)

    scale = sub.add_parser("scale", help="resize the prefill and decode pools of `pdserve up --ray`")
    scale.add_argument("counts", nargs="+", metavar="ROLE=N", help="prefill=N and/or decode=M")
    scale.add_argument("--address", default=None, metavar="ADDR",
                       help="the Ray cluster `up --ray` printed (default: RAY_ADDRESS, or the one `ray start` made)")

    router = sub.add_parser("router", help="the HTTP/gRPC front end")
    _model_args(router)
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--http-port", type=int, default=8000)
    router.add_argument("--grpc-port", type=int, default=50051)
    router.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT")
    router.add_argument("--decode", action="append", default=[], metavar="HOST:PORT")
    router.add_argument("--served-model-name", default=None)
    _registry_args(router)
    _routing_args(router)
    router.add_argument("--aggregated", action="store_true",
                        help="no prefill pool: decode workers prefill every prompt themselves")
    router.add_argument("--announce-file", default=None, help=argparse.SUPPRESS)

    _worker_args(sub.add_parser("prefill", help="a prefill worker"), decode=False)
    _worker_args(sub.add_parser("decode", help="a decode worker"), decode=True)
    sub.add_parser("convert-model", help="convert the default model into the cache (done once)")
    bench_arguments(sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint (this or another server)"))
    env_defaults(parser)
    return parser


def _worker_settings(role: str, a) -> WorkerSettings:
    extra = ({"kv_cache_tokens": a.kv_cache_tokens, "max_batch": a.max_batch,
              "prefill_chunk_tokens": a.prefill_chunk_tokens} if role == "decode"
             else {"prefix_cache_tokens": a.prefix_cache_tokens})
    return WorkerSettings(role=role, model=a.model, dtype=a.dtype, device=a.device, block_size=a.block_size,
                          threads=a.threads, attention_kernel=a.attention_kernel, host=a.host, grpc_port=a.port,
                          metrics_port=a.metrics_port,
                          kv_transport=a.kv_transport, advertise=a.advertise,
                          fault_drop_transfers=a.fault_drop_transfers, announce_file=a.announce_file,
                          log_level=a.log_level, redis=a.redis, registry_ttl=a.registry_ttl,
                          drain_timeout=a.drain_timeout, **extra)


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    from services.common.lifecycle import setup_logging
    setup_logging(getattr(a, "log_level", "info"), a.command)
    try:
        if a.command == "convert-model":
            from services.engine.model_store import ensure_default_model
            print(ensure_default_model())
            return 0
        if a.command == "bench":
            from services.bench.command import run
            return run(a)
        if a.command == "up":
            from services.engine.model_store import resolve_model
            resolve_model(a.model)                     # convert once, before the workers race to
            if a.address and not a.ray:
                raise ValueError("--address is the Ray cluster to join: it needs --ray")
            if a.ray:
                from services.ray_cluster import RayCluster
                return RayCluster(a).run()
            from services.local_cluster import LocalCluster
            scaling = _autoscaler_settings(a, "local", None) if a.autoscale else None
            return LocalCluster(a, scaling).run()
        if a.command == "autoscaler":
            if not a.redis:
                raise ValueError("--redis is needed: workers and latency are read from the registry")
            from services.autoscaler.service import serve as serve_autoscaler
            asyncio.run(serve_autoscaler(_autoscaler_settings(a, a.actuator, a.redis)))
            return 0
        if a.command == "scale":
            from services.ray_cluster import scale_command
            return scale_command(a)
        if a.command == "router":
            from services.router.server import serve
            settings = RouterSettings(model=a.model, served_model_name=a.served_model_name, host=a.host,
                                      http_port=a.http_port, grpc_port=a.grpc_port, prefill=a.prefill,
                                      decode=a.decode, max_pending=a.max_pending, announce_file=a.announce_file,
                                      log_level=a.log_level, redis=a.redis, registry_ttl=a.registry_ttl,
                                      local_prefill_max_tokens=a.local_prefill_max_tokens, aggregated=a.aggregated)
            asyncio.run(serve(settings))
            return 0
        from services.common.worker_main import run_worker
        settings = _worker_settings(a.command, a)
        if a.command == "decode":
            from services.decode.worker import build
        else:
            from services.prefill.worker import build
        asyncio.run(run_worker(settings, build))
        return 0
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdserve {a.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
