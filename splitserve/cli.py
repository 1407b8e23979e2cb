"""The ``splitserve`` command line.

The options of ``prefill``, ``decode``, ``router`` and ``up`` come from the fields of NodeConfig,
RouterConfig and ClusterSpec (runtime.options); router, prefill and decode also read each option
from SPLITSERVE_<OPTION>. ``hash``, ``kv-demo`` and ``generate`` live in cli_tools.

Over 300 lines: one parser for every subcommand, built from the config fields, and each command's
handler (each short); split further, a command's options and its handler would live apart.
"""

from __future__ import annotations

import splitserve.settings as settings

# NOTE: before grpc is imported. grpcio's fork handlers can deadlock a fork made while its threads
# are busy (e.g. grpc/grpc#22624); `splitserve up` forks (fork + exec, for its parent-death signal)
# while its health-check channels are open, and no splitserve process uses gRPC across a fork.
# The processes it starts inherit the setting.
settings.GRPC_ENABLE_FORK_SUPPORT.set_default("false")

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence

from splitserve import __version__, cli_tools
from splitserve.cli_tools import model_path
from splitserve.cluster_spec import AUTO_PREFILL
from splitserve.launcher import ClusterSpec
from splitserve.planner import cli as planner_cli
from splitserve.planner import layout_cli
from splitserve.planner.cli import add_policy_options
from splitserve.router.config import RouterConfig
from splitserve.runtime.config import NodeConfig
from splitserve.runtime.options import EnvParser, add_options, config_kwargs, env_name, flag_of

__all__ = ["ENV_COMMANDS", "build_parser", "env_name", "env_names", "main"]

ENV_COMMANDS = ("router", "prefill", "decode")  # their options also read SPLITSERVE_<OPTION>
# The node options `splitserve up` forwards to every node it starts (unset: the node's default).
UP_NODE_OPTIONS = (
    "dtype",
    "quantization",
    "kv_cache_dtype",
    "kv_cache_mb",
    "kv_host_cache_mb",
    "kv_disk_cache_dir",
    "kv_disk_cache_mb",
    "kv_store",
    "max_num_seqs",
    "max_num_batched_tokens",
    "load_format",
    "async_scheduling",
    "engine_process",
    "stream_interval",
    "enforce_eager",
    "trust_kv_network",
)
ENV_EPILOG = (
    "Every option can also be set as SPLITSERVE_<OPTION> (e.g. --redis-url as "
    "SPLITSERVE_REDIS_URL; switches take 1/true/yes/on); the command line wins."
)


def _error(message: str, status: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return status


def cmd_node(args: argparse.Namespace) -> int:
    """Run one prefill or decode node until SIGTERM/Ctrl-C."""
    from splitserve.runtime.gpus import GpuClaimError, claim_for_node

    if bad := settings.problems(*settings.NODE_SETTINGS):
        return _error("; ".join(bad), 2)
    try:  # before anything starts CUDA: it fixes the order CUDA numbers the GPUs in
        claimed = claim_for_node(
            args.device, args.gpu_lock_dir, count=max(args.tensor_parallel_size or 1, 1)
        )
    except GpuClaimError as exc:
        return _error(str(exc), 1)
    try:
        kwargs = config_kwargs(NodeConfig, args, model_path=model_path(args.model_path))
        config = NodeConfig(**{**kwargs, "device": claimed or kwargs["device"]})
    except ValueError as exc:
        return _error(str(exc), 2)
    try:
        from splitserve.runtime.auth import read_token_file
        from splitserve.runtime.config import check_cuda_dtype
        from splitserve.runtime.node import (
            check_kv_tls,
            transfer_paths,
            use_device,
            uses_engine_process,
        )

        if config.auth_token_file:
            read_token_file(config.auth_token_file)  # refuse a bad token before loading a model
        from splitserve.runtime.tls import TlsFiles

        TlsFiles.load(config.tls_cert, config.tls_key, config.tls_ca)
        transfer_paths(config)
        check_kv_tls(config)  # the tcp path's TLS contexts: a key that does not fit its certificate
        # After the GPU claim: it fixes what CUDA sees. With an engine process only that process
        # makes the device current (a CUDA context here would hold GPU memory for nothing).
        use_device(config.device, make_current=not uses_engine_process(config))
        if config.device.startswith("cuda"):  # (a device that is not there is said first)
            check_cuda_dtype(config.model_path, config.dtype)
        _start_tracing(f"splitserve-{args.command}", config)
    except (ValueError, RuntimeError) as exc:
        return _error(str(exc), 2)
    if args.command == "prefill":
        from splitserve.prefill_node.server import serve
    else:
        from splitserve.decode_node.server import serve
    serve(config)
    return 0


def _start_tracing(service: str, config: NodeConfig | RouterConfig) -> None:
    """OpenTelemetry traces when asked for (``--otlp-endpoint`` or the OTEL_* variables);
    ``RuntimeError`` when its packages are missing."""
    from splitserve.runtime import tracing

    tracing.configure(service, config.otlp_endpoint, config.otlp_sample_ratio)


def cmd_router(args: argparse.Namespace) -> int:
    """Run the router (the public Generate service) until SIGTERM/Ctrl-C."""
    from splitserve.router.request import keep_torch_out

    if bad := settings.problems(*settings.ROUTER_SETTINGS):
        return _error("; ".join(bad), 2)
    keep_torch_out()  # it runs no model: transformers' tokenizers need no torch
    if not args.redis_url and not args.decode_addresses:
        return _error(
            "give --decode node addresses (and --prefill ones; without, the decode nodes "
            "prefill every request themselves), or --redis-url to discover nodes from the "
            "registry",
            2,
        )
    try:
        path = model_path(args.model_path)
        config = RouterConfig(**config_kwargs(RouterConfig, args, model_path=path))
        if config.auth_token_file:
            from splitserve.runtime.auth import read_token_file

            read_token_file(config.auth_token_file)
        from splitserve.runtime.tls import TlsFiles

        TlsFiles.load(config.tls_cert, config.tls_key, config.tls_ca)
        if config.api_key_file:  # a bad key file or HTTPS pair fails now, not at the first call
            from splitserve.router.api_keys import read_api_keys

            read_api_keys(config.api_key_file)
        if config.http_tls_cert and config.http_tls_key:
            from splitserve.router.http import https_context

            https_context(config.http_tls_cert, config.http_tls_key)
        _start_tracing("splitserve-router", config)
    except (ValueError, RuntimeError) as exc:
        return _error(str(exc), 2)
    from splitserve.router.request import ModelInfo
    from splitserve.router.server import serve

    try:
        model = ModelInfo.load(config.model_path, config.tokenizer_path)
    except ValueError as exc:
        return _error(str(exc), 2)
    serve(config, model)
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """Ask a component's grpc.health.v1 service: exit 0 if SERVING, else 1 (health checks)."""
    from splitserve.runtime.health import check, check_address, default_address, tls_from_env

    address = args.address or default_address()
    try:
        check_address(address)
        tls = tls_from_env()  # a component serving mTLS is asked over mTLS
    except ValueError as exc:
        return _error(str(exc), 1)  # a health check knows only healthy (0) or not (1)
    result = check(address, args.service, args.timeout, tls)
    print(result.message, file=sys.stdout if result.serving else sys.stderr)
    return 0 if result.serving else 1


def up_node_args(args: argparse.Namespace) -> list[str]:
    """The node options given to ``up``, as the nodes' own flags (a switch as its flag alone)."""
    node_args: list[str] = []
    for name in UP_NODE_OPTIONS:
        value = getattr(args, name)
        if value is None or value is False:
            continue
        flag = flag_of(NodeConfig, name)
        node_args += [flag] if value is True else [flag, str(value)]
    return node_args


def serving_dtype(path: str, device: str, dtype: str | None) -> str | None:
    """The dtype ``up`` serves checkpoint ``path`` in on ``device``: ``dtype`` as given, except
    that on CUDA a float32 checkpoint without one is served in bfloat16 (vLLM's ``auto``; the
    kernels there take 16-bit types) — every node and the router get it, so the model identity
    agrees. ``ValueError``: float32 asked for on CUDA."""
    from splitserve.runtime.config import check_cuda_dtype

    if not device.startswith("cuda"):
        return dtype
    try:
        check_cuda_dtype(path, dtype)
    except ValueError:
        if dtype is not None:
            raise
        return "bfloat16"
    return dtype


def cmd_up(args: argparse.Namespace) -> int:
    """Start a local cluster (Redis, prefill and decode nodes, router) until Ctrl-C."""
    import signal

    from splitserve.launcher import LocalCluster, StartInterrupted

    # The processes it starts inherit its environment: a bad setting stops them all, so say so now.
    if bad := settings.problems(*settings.NODE_SETTINGS, *settings.ROUTER_SETTINGS):
        return _error("; ".join(bad), 2)
    node_args = up_node_args(args)
    try:
        path = model_path(args.model_path)
        dtype = serving_dtype(path, args.device, args.dtype)
        if dtype != args.dtype:
            print(f"{path} is stored in float32: serving it in {dtype} on CUDA", flush=True)
            node_args += [flag_of(NodeConfig, "dtype"), dtype]
        kwargs = config_kwargs(ClusterSpec, args, model_path=path, node_args=tuple(node_args))
        if kwargs.get("num_prefill") == AUTO_PREFILL:
            from splitserve.planner.layout_cli import auto_layout

            kwargs = auto_layout(args, kwargs, str(kwargs.get("device") or "cpu"))
        spec = ClusterSpec(**kwargs)
        if spec.otlp_endpoint:  # said once here, not by every component it would start
            from splitserve.runtime.tracing import check_installed

            check_installed()
    except (ValueError, RuntimeError) as exc:
        return _error(str(exc), 2)

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # Ctrl-C stops the cluster however up was started: a process started in the background by a
    # script (no job control) inherits SIGINT ignored, and Python then installs no handler of
    # its own (the components handle SIGINT in their event loops either way). Until the cluster
    # exists nothing is running, so an exception is safe; from then on the handlers only call
    # cluster.interrupt() (an event that start() and the serving loop below check).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    planner_policy = None
    if args.autoscale:
        try:
            planner_policy = _autoscale_policy(args, spec)
        except ValueError as exc:
            return _error(str(exc), 2)
        if spec.metrics_port is None:  # the planner reads the router's /metrics
            spec = dataclasses.replace(spec, metrics_port=0)
    signal.signal(signal.SIGTERM, on_sigterm)
    max_nodes = (
        planner_policy[0].max_prefill + planner_policy[0].max_decode if planner_policy else None
    )
    cluster = LocalCluster(spec) if max_nodes is None else LocalCluster(spec, max_nodes)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, frame: cluster.interrupt())
    stop_planner = None
    try:
        a = cluster.start()
        if planner_policy is not None:
            # Every router's /metrics: the planner sums their requests (planner.scrape.merge).
            stop_planner = _start_planner(args, cluster, a.router_metrics, planner_policy)

        def show(name: str, address: str) -> None:  # and its /metrics, when it serves one
            url = a.metrics.get(address)
            print(f"{name:8s} {address}" + (f" metrics {url}" if url else ""), flush=True)

        show("router", a.router)
        for url in a.router_metrics[1:]:  # --num-routers: the others share its address
            print(f"router   {a.router} metrics {url}", flush=True)
        if a.http:
            print(f"http     {a.http} (OpenAI-compatible API)", flush=True)
        for role, addresses in (("prefill", a.prefill), ("decode", a.decode)):
            for address in addresses:
                show(role, address)
        print(f"redis    {a.redis_url}", flush=True)
        if a.token_file:
            print(f"token    {a.token_file} (internal calls carry it)", flush=True)
        key_flag = ""
        if a.api_key_file:
            print(
                f"api-key  {a.api_key_file} (gRPC and HTTP calls send Bearer <key>: the metadata "
                "/ header authorization)",
                flush=True,
            )
            key_flag = f" --api-key-file {a.api_key_file}"
        print(f"ready: splitserve generate --target {a.router}{key_flag} 'Hello'", flush=True)
        # Serving, Ctrl-C and SIGTERM still only call cluster.interrupt(), which this loop
        # checks: an exception raised by a signal handler in the middle of a poll could leave a
        # lock of the launcher's or of a subprocess.Popen held, and the stop below needs them
        # (a CI run's stop hung so).
        while (dead := cluster.poll()) is None:
            if cluster.interrupted(0.5):
                return 0
        return _error(f"{dead} exited; stopping the cluster", 1)
    except (RuntimeError, TimeoutError, ValueError) as exc:
        return _error(str(exc), 1)
    except StartInterrupted as exc:
        print(f"{exc}; stopping what was started", file=sys.stderr, flush=True)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut cleanup
        if stop_planner is not None:
            stop_planner()
        cluster.stop()


def _autoscale_policy(args: argparse.Namespace, spec: ClusterSpec):
    """The planner's (Bounds, Slo, PolicyConfig) for ``up --autoscale``."""
    from splitserve.planner.cli import policy_from

    if not spec.prefix_index:
        raise ValueError("--autoscale needs the Redis registry: new nodes join through it")
    if spec.tp_of("prefill") > 1 or spec.tp_of("decode") > 1:
        # NOTE: the planner places one GPU per node; a node of several ranks needs a run of them.
        raise ValueError("--autoscale places one GPU per node: use it at tensor parallel size 1")
    bounds, slo, config = policy_from(args, spec.num_prefill, spec.num_decode)
    if not bounds.min_prefill <= spec.num_prefill <= bounds.max_prefill:
        raise ValueError("--num-prefill must be within --min-prefill..--max-prefill")
    if not bounds.min_decode <= spec.num_decode <= bounds.max_decode:
        raise ValueError("--num-decode must be within --min-decode..--max-decode")
    return bounds, slo, config


def _start_planner(args: argparse.Namespace, cluster, router_metrics: Sequence[str], policy):
    """The planner on a thread of this process, acting through the launcher; returns its stop."""
    from splitserve.planner.actuators import LocalActuator
    from splitserve.planner.cli import serve_planner_metrics, start_thread
    from splitserve.planner.loop import Planner
    from splitserve.planner.scrape import Scraper

    bounds, slo, config = policy
    planner = Planner(
        Scraper(router_metrics),
        LocalActuator(cluster),
        bounds,
        slo,
        config,
        args.interval,
        args.record,
    )
    port = serve_planner_metrics(planner, args.planner_metrics_port, cluster.spec.host)
    if port is not None:
        print(f"planner  metrics http://{cluster.spec.host}:{port}/metrics", flush=True)
    thread, stop = start_thread(planner)

    def stop_it() -> None:
        stop.set()
        thread.join(timeout=args.interval + 10)

    return stop_it


def cmd_kv_store(args: argparse.Namespace) -> int:
    """Run a Mooncake Store for the nodes' shared KV tier (its master and the memory it lends)
    until Ctrl-C or SIGTERM; nodes reach it with --kv-store mooncake://HOST:PORT."""
    import signal
    import tempfile
    import time
    from pathlib import Path

    from splitserve.kv_store_service import default_store_mb, start_store

    workdir = Path(args.log_dir or tempfile.mkdtemp(prefix="splitserve-kv-store-"))
    workdir.mkdir(parents=True, exist_ok=True)
    memory_mb = args.memory_mb or default_store_mb()
    try:
        store = start_store(
            args.host,
            memory_mb,
            workdir,
            time.monotonic() + args.startup_timeout,
            port=args.port,
            metadata_port=args.metadata_port,
        )
    except (RuntimeError, TimeoutError) as exc:
        return _error(str(exc), 1)
    stopping: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    print(f"KV store: {memory_mb} MiB; nodes: --kv-store '{store.url}'", flush=True)
    print(f"its logs: {workdir}", flush=True)
    try:
        while not stopping:
            for name, proc in zip(("its master", "its memory"), store.procs, strict=True):
                if proc.poll() is not None:
                    return _error(f"KV store: {name} exited ({proc.returncode}): see {workdir}", 1)
            time.sleep(0.5)
    finally:
        store.stop()
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """prefill, decode, router, health, up, kv-store, planner, layout and env."""
    for role in ("prefill", "decode"):
        p = sub.add_parser(role, help=f"run one {role} node", epilog=ENV_EPILOG)
        add_options(p, NodeConfig)
        p.add_argument(  # not a NodeConfig field: consumed before the config is built
            "--gpu-lock-dir",
            default=None,
            help="with --device cuda: claim a GPU no other node holds a lock on in this "
            "directory (shared by the nodes of a host) and use only it",
        )
        p.set_defaults(func=cmd_node)

    p = sub.add_parser("router", help=cmd_router.__doc__, epilog=ENV_EPILOG)
    add_options(p, RouterConfig)
    p.set_defaults(func=cmd_router)

    p = sub.add_parser("health", help=cmd_health.__doc__)
    p.add_argument(
        "--address",
        default=None,
        help="host:port (default: 127.0.0.1:$SPLITSERVE_PORT, i.e. this container's component)",
    )
    p.add_argument("--service", default="", help="a service name (default: the whole server)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds")
    p.set_defaults(func=cmd_health)

    p = sub.add_parser("up", help=cmd_up.__doc__)
    add_options(p, ClusterSpec)
    add_options(p, NodeConfig, UP_NODE_OPTIONS, unset=True)
    p.add_argument(
        "--autoscale",
        action="store_true",
        help="run the planner: it grows and drains the pools within --min/--max-prefill and "
        "--min/--max-decode (default: the --num-* counts) to meet --slo (docs/deploy.md, Scaling)",
    )
    add_policy_options(p, slo=False)  # ClusterSpec's --slo: the router's and the planner's
    layout_cli.add_layout_inputs(p, required=False)  # for --num-prefill auto
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("kv-store", help=cmd_kv_store.__doc__)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to bind (the store has no authentication: a private network's only; "
        "docs/security.md)",
    )
    p.add_argument("--port", type=int, default=50051, help="the master's RPC port")
    p.add_argument("--metadata-port", type=int, default=8080, help="its HTTP metadata server")
    p.add_argument(
        "--memory-mb",
        type=int,
        default=None,
        help="the memory it holds, MiB (default: an eighth of the memory available, at most 4096)",
    )
    p.add_argument("--log-dir", default=None, help="its processes' logs (default: a temp folder)")
    p.add_argument("--startup-timeout", type=float, default=60.0, help="seconds")
    p.set_defaults(func=cmd_kv_store)

    planner_cli.add_command(sub)
    layout_cli.add_commands(sub)

    p = sub.add_parser("env", help=cmd_env.__doc__)
    p.add_argument(
        "--markdown",
        action="store_true",
        help="only the variables that are not options, as docs/deploy.md's table of them",
    )
    p.set_defaults(func=cmd_env)


def option_variables() -> dict[str, tuple[list[str], argparse.Action, object]]:
    """Every ``SPLITSERVE_<OPTION>`` variable: the commands that read it, its option (of the
    first of them) and that option's default."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    out: dict[str, tuple[list[str], argparse.Action, object]] = {}
    for command in ENV_COMMANDS:
        for name, (action, default) in (sub.choices[command]._env_actions or {}).items():
            out.setdefault(name, ([], action, default))[0].append(command)
    return dict(sorted(out.items()))


def _help_text(action: argparse.Action, default: object) -> str:
    text = (action.help or "").split(" [env ")[0]
    return text.replace("%(default)s", str(default)).replace("%%", "%")


def _cell(value: object) -> str:
    return "" if value in (None, "") else f"`{value}`"


def env_listing(markdown: bool = False) -> str:
    """``splitserve env``: every environment variable splitserve reads (splitserve.settings'
    declarations, then the options' variables); ``markdown``: the declarations as docs/deploy.md's
    table of the variables that are not options."""
    options = option_variables()
    lines: list[str] = []
    if markdown:  # the options' variables have their own table there, with the image's values
        lines += ["| variable | kind | takes | default | meaning |", "|---|---|---|---|---|"]
        for s in settings.declared():
            lines.append(f"| `{s.name}` | {s.kind} | {s.takes} | {_cell(s.default)} | {s.help} |")
        return "\n".join(lines) + "\n"
    for kind, meaning in settings.KINDS.items():
        lines.append(f"# {kind}: {meaning}")
        for s in settings.declared():
            if s.kind == kind:
                default = f" (default {s.default})" if s.default not in (None, "") else ""
                lines.append(f"{s.name}  {s.takes}{default}\n    {s.help}")
        lines.append("")
    lines.append("# options: those of splitserve router|prefill|decode (the command line wins)")
    for name, (commands, action, default) in options.items():
        text = _help_text(action, default)
        shown = (
            f" (default {default})" if default not in (None, "") and "(default" not in text else ""
        )
        lines.append(
            f"{name}  {action.option_strings[-1]}, {'/'.join(commands)}{shown}\n    {text}"
        )
    return "\n".join(lines) + "\n"


def cmd_env(args: argparse.Namespace) -> int:
    """List every environment variable splitserve reads: its values, default and meaning."""
    sys.stdout.write(env_listing(markdown=args.markdown))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--version", action="version", version=f"splitserve {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=EnvParser)
    cli_tools.add_commands(sub)
    add_commands(sub)
    for command in ENV_COMMANDS:
        sub.choices[command].read_environment()
    return parser


def env_names(command: str) -> tuple[str, ...]:
    """The SPLITSERVE_* variables that ``splitserve <command>`` reads (router, prefill, decode)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command].env_names


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
