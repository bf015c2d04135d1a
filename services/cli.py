"""The `pdserve` command: `up` (local cluster, or Ray actors with --ray), `scale` (Ray pools),
`router`, `prefill`, `decode`, `autoscaler`, `convert-model`, `bench` (load generator)."""
from __future__ import annotations

import argparse
import asyncio
import sys

from services.bench.command import add_arguments as bench_arguments
from services.autoscaler.settings import AutoscalerSettings
from services.common.flags import add_arguments, env_defaults, from_args
from services.common.lifecycle import exit_now
from services.common.settings import (LOG_FORMAT_HELP, LOG_FORMATS, LOG_LEVELS, ClusterSettings, RouterSettings,
                                      WorkerSettings)
from services.common.version import VERSION


def _autoscaling_args(p: argparse.ArgumentParser) -> None:
    """The policy, bounds and budget: the same flags for `up --autoscale` and `autoscaler`."""
    from services.autoscaler.core import Policy, PoolBounds
    d, bounds = Policy(), PoolBounds()
    g = p.add_argument_group("autoscaling (docs/autoscaling.md)")
    g.add_argument("--slo-ttft", type=float, default=d.slo_ttft * 1000, metavar="MS",
                   help="time-to-first-token p90 target of the prefill pool, ms")
    g.add_argument("--slo-itl", type=float, default=d.slo_itl * 1000, metavar="MS",
                   help="inter-token latency p90 target of the decode pool, ms")
    for role in ("prefill", "decode"):
        g.add_argument(f"--min-{role}", type=int, default=bounds.min, metavar="N", help=f"fewest {role} workers")
        g.add_argument(f"--max-{role}", type=int, default=bounds.max, metavar="N", help=f"most {role} workers")
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
                              metrics_port=getattr(a, "metrics_port", None), log_level=a.log_level,
                              cluster_secret_file=getattr(a, "cluster_secret_file", None))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("--version", action="version", version=VERSION)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start router, prefill and decode workers on this machine")
    add_arguments(up, ClusterSettings)
    _autoscaling_args(up)

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
    scaler.add_argument("--cluster-secret-file", default=None, metavar="FILE",
                        help="the cluster secret the workers and routers share: the registry's records are "
                             "signed with it, and unsigned ones ignored")
    scaler.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    scaler.add_argument("--log-format", default="text", choices=LOG_FORMATS, help=LOG_FORMAT_HELP)
    _autoscaling_args(scaler)

    scale = sub.add_parser("scale", help="resize the prefill and decode pools of `pdserve up --ray`")
    scale.add_argument("counts", nargs="+", metavar="ROLE=N", help="prefill=N and/or decode=M")
    scale.add_argument("--address", default=None, metavar="ADDR",
                       help="the Ray cluster `up --ray` printed (default: RAY_ADDRESS, or the one `ray start` made)")

    add_arguments(sub.add_parser("router", help="the HTTP/gRPC front end"), RouterSettings)
    for role in ("prefill", "decode"):
        add_arguments(sub.add_parser(role, help=f"a {role} worker"), WorkerSettings, role=role)
    sub.add_parser("convert-model", help="convert the default model into the cache (done once)")
    bench_arguments(sub.add_parser("bench", help="load-test an OpenAI-compatible endpoint (this or another server)"))
    env_defaults(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = _parser()              # PDSERVE_* variables become the flags' defaults here
    except ValueError as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    a = parser.parse_args(argv)
    from services.common.lifecycle import setup_logging
    setup_logging(getattr(a, "log_level", "info"), a.command, getattr(a, "log_format", "text"))
    try:
        if a.command == "convert-model":
            from services.engine.text.model_store import ensure_default_model
            print(ensure_default_model())
            return 0
        if a.command == "bench":
            from services.bench.command import run
            return run(a)
        if a.command == "up":
            settings = from_args(ClusterSettings, a)
            from services.engine.text.model_store import check_weights, resolve_model
            check_weights(resolve_model(settings.model, settings.revision))   # converted once, before the workers race
            if settings.ray:
                from services.ray_cluster import RayCluster
                return RayCluster(settings).run()
            from services.local_cluster import LocalCluster
            from services.local_processes import check_ports_free
            check_ports_free(settings.host, {"--http-port": settings.http_port, "--grpc-port": settings.grpc_port})
            scaling = _autoscaler_settings(a, "local", None) if settings.autoscale else None
            return LocalCluster(settings, scaling).run()
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
            asyncio.run(serve(from_args(RouterSettings, a)))
            exit_now(0)         # stopped all it started: no interpreter teardown (lifecycle.py)
        from services.worker.main import run_worker
        settings = from_args(WorkerSettings, a, role=a.command)
        if a.command == "decode":
            from services.decode.worker import build
        else:
            from services.prefill.worker import build
        status = asyncio.run(run_worker(settings, build))
        exit_now(status)        # stopped all it started: no interpreter teardown (lifecycle.py)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pdserve {a.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
