"""``splitserve planner`` and the planner options of ``splitserve up --autoscale``."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from splitserve.planner.policy import AIM, Bounds, PolicyConfig, aim

logger = logging.getLogger(__name__)


def add_policy_options(p: argparse.ArgumentParser, slo: bool = True) -> None:
    """Bounds, SLO and timing: shared by ``planner`` and ``up --autoscale`` (``slo``: add
    ``--slo``; ``up`` has its own, which is also the router's)."""
    g = p.add_argument_group("planner")
    for role in ("prefill", "decode"):
        g.add_argument(f"--min-{role}", type=int, default=None, help=f"fewest {role} nodes")
        g.add_argument(f"--max-{role}", type=int, default=None, help=f"most {role} nodes")
    if slo:
        g.add_argument(
            "--slo",
            default=None,
            help=f"the latency aimed at: ttft=SECONDS,tpot=SECONDS (default: {AIM}, also for a "
            "bound left out)",
        )
    g.add_argument("--interval", type=float, default=5.0, help="seconds between decisions")
    g.add_argument(
        "--cooldown",
        type=float,
        default=60.0,
        help="seconds a pool's load must stay low, and since its last change, before it shrinks",
    )
    g.add_argument(
        "--scale-out-after",
        type=float,
        default=None,
        help="seconds a pool must be short before it grows (default: the --interval)",
    )
    g.add_argument(
        "--settle",
        type=float,
        default=120.0,
        help="after growing a pool, seconds to wait for its new nodes before growing it again",
    )
    g.add_argument("--max-step", type=int, default=2, help="nodes one decision may add to a pool")
    g.add_argument(
        "--planner-metrics-port",
        type=int,
        default=None,
        help="serve the planner's /metrics on this port (0: a free one; default: none)",
    )
    g.add_argument("--record", default=None, help="append every round (figures, decision) as JSONL")


def policy_from(args: argparse.Namespace, prefill: int = 1, decode: int = 1):
    """(Bounds, Slo, PolicyConfig) of the options; unset bounds default to the given counts."""
    bounds = Bounds(
        min_prefill=prefill if args.min_prefill is None else args.min_prefill,
        max_prefill=prefill if args.max_prefill is None else args.max_prefill,
        min_decode=decode if args.min_decode is None else args.min_decode,
        max_decode=decode if args.max_decode is None else args.max_decode,
    )
    if args.interval <= 0 or args.cooldown < 0 or args.settle < 0 or args.max_step < 1:
        raise ValueError("give --interval > 0, --cooldown and --settle >= 0, --max-step >= 1")
    out_after = args.interval if args.scale_out_after is None else args.scale_out_after
    config = PolicyConfig(
        out_after_s=out_after,
        cooldown_s=args.cooldown,
        settle_s=args.settle,
        max_step=args.max_step,
    )
    return bounds, aim(args.slo), config


def serve_planner_metrics(planner, port: int | None, host: str) -> int | None:
    if port is None:
        return None
    from splitserve.runtime.metrics import serve_metrics

    return serve_metrics(port, planner.registry, host)


def start_thread(planner) -> tuple[threading.Thread, threading.Event]:
    stop = threading.Event()
    thread = threading.Thread(target=planner.run, args=(stop,), name="planner", daemon=True)
    thread.start()
    return thread, stop


def cmd_planner(args: argparse.Namespace) -> int:
    """Scale the prefill and decode pools of a compose project or Kubernetes Deployments."""
    from splitserve.planner.actuators import ComposeActuator, KubernetesActuator
    from splitserve.planner.loop import Planner
    from splitserve.planner.scrape import Scraper

    try:
        bounds, slo, config = policy_from(args)
        if args.actuator == "compose":
            actuator = ComposeActuator(
                args.compose_file or ["compose.yaml"], args.compose_command, args.compose_project
            )
        else:
            deployments = {"prefill": args.prefill_deployment, "decode": args.decode_deployment}
            actuator = KubernetesActuator(args.namespace, deployments)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    planner = Planner(
        Scraper(args.router_metrics), actuator, bounds, slo, config, args.interval, args.record
    )
    serve_planner_metrics(planner, args.planner_metrics_port, args.metrics_host)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    planner.run(stop)
    return 0


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("planner", help=cmd_planner.__doc__, description=cmd_planner.__doc__)
    p.add_argument(
        "--router-metrics",
        default="http://127.0.0.1:9100/metrics",
        help="the /metrics URL of the router, or of every router comma-separated (their "
        "requests are summed; default: %(default)s)",
    )
    p.add_argument("--actuator", choices=("compose", "kubernetes"), default="compose")
    p.add_argument(
        "--compose-file", action="append", help="compose: a -f file (repeat; default compose.yaml)"
    )
    p.add_argument(
        "--compose-command",
        default="docker compose",
        help="compose: the command (e.g. podman-compose; default: %(default)s)",
    )
    p.add_argument("--compose-project", default=None, help="compose: the -p project name")
    p.add_argument("--namespace", default="default", help="kubernetes: the Deployments' namespace")
    p.add_argument("--prefill-deployment", default="splitserve-prefill", help="kubernetes")
    p.add_argument("--decode-deployment", default="splitserve-decode", help="kubernetes")
    p.add_argument("--metrics-host", default="0.0.0.0", help="address of --planner-metrics-port")
    add_policy_options(p)
    p.set_defaults(func=cmd_planner)
