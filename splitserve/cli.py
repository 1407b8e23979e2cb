"""The ``splitserve`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys

from splitserve import __version__

ENV_PREFIX = "SPLITSERVE_"
ENV_COMMANDS = ("router", "prefill", "decode")  # their options also read SPLITSERVE_<OPTION>
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def env_name(action: argparse.Action) -> str:
    """SPLITSERVE_ and the long option in upper snake case: --redis-url -> SPLITSERVE_REDIS_URL."""
    flag = next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose options, after ``read_environment()``, take their defaults from
    SPLITSERVE_<OPTION> variables; an option given on the command line still wins. Empty
    variables count as unset. Read at parse time, so a bad value fails only the command that
    would use it."""

    _env_actions: dict[str, tuple[argparse.Action, object]] | None = None

    def read_environment(self) -> None:
        self._env_actions = {}
        for action in self._actions:
            if not action.option_strings or isinstance(
                action, argparse._HelpAction | argparse._VersionAction
            ):
                continue
            name = env_name(action)
            self._env_actions[name] = (action, action.default)
            action.help = f"{action.help} [env {name}]" if action.help else f"[env {name}]"

    @property
    def env_names(self) -> tuple[str, ...]:
        return tuple(self._env_actions or ())

    def _env_value(self, name: str, action: argparse.Action, raw: str) -> object:
        if action.nargs == 0:  # store_true / store_const: a switch
            if raw.lower() in _TRUE:
                return action.const
            if raw.lower() in _FALSE:
                return self._env_actions[name][1]
            self.error(f"{name}={raw!r}: give 1/true/yes/on or 0/false/no/off")
        convert = action.type or str
        try:
            value = convert(raw)
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            kind = getattr(convert, "__name__", repr(convert))
            self.error(f"{name}={raw!r}: invalid {kind} value (for {action.option_strings[0]})")
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(repr(c) for c in action.choices)
            self.error(f"{name}={raw!r}: invalid choice (choose from {choices})")
        return [value] if isinstance(action, argparse._AppendAction) else value

    def parse_known_args(self, args=None, namespace=None):
        for name, (action, default) in (self._env_actions or {}).items():
            raw = os.environ.get(name, "").strip()
            action.default = self._env_value(name, action, raw) if raw else default
        return super().parse_known_args(args, namespace)


def _identity(args: argparse.Namespace):
    from splitserve.kvstore import ModelIdentity

    return ModelIdentity(
        args.model, revision=args.revision, dtype=args.dtype, block_size=args.block_size
    )


def cmd_hash(args: argparse.Namespace) -> int:
    """Print the chained block hashes of a token list: the keys a prefix is cached under."""
    from splitserve.kvstore import hash_request_tokens

    try:
        tokens = [int(t) for t in args.tokens.replace(",", " ").split()]
        identity = _identity(args)
        hashes = hash_request_tokens(tokens, identity.block_size, identity.root_hash, args.salt)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"root {identity.root_hash.hex()}  ({identity})")
    for i, block_hash in enumerate(hashes):
        print(
            f"block {i:4d}  tokens {i * identity.block_size}..{(i + 1) * identity.block_size - 1}"
            f"  {block_hash.hex()}"
        )
    tail = len(tokens) - len(hashes) * identity.block_size
    print(f"{len(hashes)} full blocks, {tail} tokens in the partial tail block (not hashed)")
    return 0


def cmd_kv_demo(args: argparse.Namespace) -> int:
    """Drive the real KV cache manager with chat-like traffic and report prefix-cache figures."""
    from splitserve.kvstore import BlockPool, BlockStored, KVCacheManager, hash_request_tokens

    rng = random.Random(args.seed)
    identity = _identity(args)
    bs = identity.block_size
    pool = BlockPool(args.num_blocks, enable_events=True)
    mgr = KVCacheManager(pool, bs)
    system_prompts = [
        [rng.randrange(32_000) for _ in range(rng.randrange(64, 512))]
        for _ in range(args.system_prompts)
    ]
    running: list[tuple[str, int]] = []
    refused = stored = evicted = 0
    print(f"{'step':>5s} {'running':>8s} {'usage':>6s} {'cached blocks':>14s} {'hit rate':>9s}")
    for step in range(args.requests):
        prompt = rng.choice(system_prompts) + [
            rng.randrange(32_000) for _ in range(rng.randrange(1, 200))
        ]
        hashes = hash_request_tokens(prompt, bs, identity.root_hash)
        computed = mgr.get_computed_blocks(hashes, len(prompt))
        rid = f"req-{step}"
        if mgr.allocate_slots(rid, len(prompt), computed) is None:
            refused += 1
        else:
            mgr.cache_blocks(rid, hashes, len(prompt))
            running.append((rid, len(prompt) + rng.randrange(16, 256)))
        for rid, final_len in list(running):  # requests grow to their final length and finish
            if mgr.allocate_slots(rid, final_len) is None or rng.random() < 0.05:
                mgr.free(rid)
                running.remove((rid, final_len))
        for event in pool.take_events():
            if isinstance(event, BlockStored):
                stored += len(event.block_hashes)
            else:
                evicted += len(event.block_hashes)
        if step % max(1, args.requests // 10) == 0 or step == args.requests - 1:
            print(
                f"{step:5d} {len(running):8d} {pool.get_usage():6.1%} "
                f"{pool.num_cached_blocks:14d} {mgr.stats.hit_rate:9.1%}"
            )
    s = mgr.stats
    print(
        f"\n{s.requests} lookups, {s.hit_tokens}/{s.queried_tokens} prompt tokens from cache "
        f"({s.hit_rate:.1%}); {refused} refused for lack of blocks; "
        f"{stored} blocks stored, {evicted} evicted (events a Redis index would receive)"
    )
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate text: through a running cluster with --target, else in this process."""
    if args.target:
        return _generate_remote(args)
    import time

    import torch
    from transformers import AutoTokenizer

    from splitserve.kvstore import ModelIdentity
    from splitserve.models.engine import LLMEngine
    from splitserve.models.loader import load_model
    from splitserve.models.runner import ModelRunner, RunnerConfig
    from splitserve.models.sampling_params import SamplingParams
    from splitserve.models.tiny import ensure_tiny_model

    path = args.model_path or ensure_tiny_model()
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    try:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
            seed=args.seed,
        )
        config, model = load_model(path, dtype=args.dtype, device=device)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rc = RunnerConfig(kv_cache_bytes=None if device == "cuda" else args.kv_cache_mb << 20)
    runner = ModelRunner(config, model, rc)
    identity = ModelIdentity(str(path), dtype=str(runner.dtype).removeprefix("torch."))
    engine = LLMEngine(runner, identity)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = args.prompt or ["The quick brown fox"]
    t0 = time.perf_counter()
    reqs = engine.generate([tokenizer(p).input_ids for p in prompts], params)
    elapsed = time.perf_counter() - t0
    for prompt, req in zip(prompts, reqs, strict=True):
        text = tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        print(
            f"{prompt!r} -> {text!r}  ({len(req.output_token_ids)} tokens, "
            f"{req.finish_reason}, {req.num_cached_tokens} prompt tokens from cache)"
        )
    total = sum(len(r.output_token_ids) for r in reqs)
    print(f"{total} tokens in {elapsed:.2f} s on {device} ({total / elapsed:.0f} tok/s)")
    return 0


def _generate_remote(args: argparse.Namespace) -> int:
    """Stream each prompt's completion from the router at --target; usage goes to stderr."""
    from splitserve.client import Client, SplitserveError

    prompts = args.prompt or ["The quick brown fox"]
    with Client(args.target) as client:
        for prompt in prompts:
            try:
                last = None
                for chunk in client.stream(
                    prompt,
                    max_tokens=args.max_tokens,
                    temperature=args.temperature,
                    top_p=args.top_p,
                    top_k=args.top_k,
                    seed=args.seed,
                    stop=args.stop,
                    ignore_eos=args.ignore_eos,
                    cache_salt=args.cache_salt,
                    timeout=args.timeout,
                ):
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    last = chunk
            except SplitserveError as exc:
                sys.stdout.write("\n")
                print(f"error: {exc}", file=sys.stderr)
                return 2 if exc.code.name == "INVALID_ARGUMENT" else 1
            sys.stdout.write("\n")
            if last is not None and last.usage is not None:
                u = last.usage
                print(
                    f"[{last.finish_reason}] prompt_tokens={u.prompt_tokens} "
                    f"cached_tokens={u.cached_tokens} completion_tokens={u.completion_tokens} "
                    f"time_to_first_token={u.time_to_first_token_s * 1000:.1f} ms",
                    file=sys.stderr,
                )
    return 0


def _model_path(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from splitserve.models.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


_NODE_FLAGS = (  # argparse dest -> NodeConfig field; unset flags keep NodeConfig's defaults
    "redis_url",
    "enable_prefix_caching",
    "host",
    "port",
    "port_file",
    "device",
    "dtype",
    "kv_cache_mb",
    "gpu_memory_utilization",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "load_format",
    "transfer_deadline_s",
    "advertise_host",
    "drain_timeout_s",
    "metrics_port",
    "kv_transfer",
)


def cmd_node(args: argparse.Namespace) -> int:
    """Run one prefill or decode node until SIGTERM/Ctrl-C."""
    from splitserve.runtime.config import NodeConfig
    from splitserve.runtime.gpus import GpuClaimError, claim_for_node

    given = {k: getattr(args, k) for k in _NODE_FLAGS if getattr(args, k) is not None}
    try:  # before anything starts CUDA: the claimed GPU must be the only one it sees
        claim_for_node(args.device or "cpu", args.gpu_lock_dir)
    except GpuClaimError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    config = NodeConfig(model_path=_model_path(args), **given)
    try:
        from splitserve.runtime.node import transfer_paths

        transfer_paths(config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "prefill":
        from splitserve.prefill_node.server import serve
    else:
        from splitserve.decode_node.server import serve
    serve(config)
    return 0


def _addresses(flag: str, value: str) -> tuple[str, ...]:
    addresses = tuple(a.strip() for a in value.split(",") if a.strip())
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{flag}: {address!r} is not host:port")
    if not addresses:
        raise ValueError(f"{flag}: give at least one host:port")
    return addresses


def cmd_router(args: argparse.Namespace) -> int:
    """Run the router (the public Generate service) until SIGTERM/Ctrl-C."""
    from splitserve.runtime.config import RouterConfig

    if not args.redis_url and not (args.prefill and args.decode):
        print(
            "error: give --prefill and --decode node addresses, or --redis-url to discover "
            "nodes from the registry",
            file=sys.stderr,
        )
        return 2
    try:
        config = RouterConfig(
            model_path=_model_path(args),
            prefill_addresses=_addresses("--prefill", args.prefill) if args.prefill else (),
            decode_addresses=_addresses("--decode", args.decode) if args.decode else (),
            redis_url=args.redis_url,
            dtype=args.dtype,
            host=args.host,
            port=args.port,
            port_file=args.port_file,
            request_timeout_s=args.request_timeout_s,
            max_attempts=args.max_attempts,
            metrics_port=args.metrics_port,
            block_size=args.block_size,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from splitserve.router.server import serve

    serve(config)
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """Ask a component's grpc.health.v1 service: exit 0 if SERVING, else 1 (health checks)."""
    from splitserve.runtime.health import check, check_address, default_address

    address = args.address or default_address()
    try:
        check_address(address)
    except ValueError as exc:
        print(f"error: --address: {exc}", file=sys.stderr)
        return 1  # a health check knows only healthy (0) and unhealthy (1)
    result = check(address, args.service, args.timeout)
    print(result.message, file=sys.stdout if result.serving else sys.stderr)
    return 0 if result.serving else 1


def cmd_up(args: argparse.Namespace) -> int:
    """Start a local cluster (Redis, prefill and decode nodes, router) until Ctrl-C."""
    import signal
    import time

    from splitserve.launcher import ClusterSpec, LocalCluster

    node_args: list[str] = []
    for flag in ("dtype", "kv_cache_mb", "max_num_seqs", "max_num_batched_tokens", "load_format"):
        if (value := getattr(args, flag)) is not None:
            node_args += [f"--{flag.replace('_', '-')}", str(value)]
    try:
        spec = ClusterSpec(
            model_path=_model_path(args),
            num_prefill=args.num_prefill,
            num_decode=args.num_decode,
            host=args.host,
            port=args.port,
            redis_url=args.redis_url,
            device=args.device,
            gpu_memory_utilization=args.gpu_memory_utilization,
            node_args=tuple(node_args),
            startup_timeout_s=args.startup_timeout,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    cluster = LocalCluster(spec)
    try:
        a = cluster.start()
        print(f"router   {a.router}", flush=True)
        for role, addresses in (("prefill", a.prefill), ("decode", a.decode)):
            for address in addresses:
                print(f"{role:8s} {address}", flush=True)
        print(f"redis    {a.redis_url}", flush=True)
        print(f"ready: splitserve generate --target {a.router} 'Hello'", flush=True)
        while (dead := cluster.poll()) is None:
            time.sleep(0.5)
        print(f"error: {dead} exited; stopping the cluster", file=sys.stderr)
        return 1
    except (RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut cleanup
        cluster.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"splitserve {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default="splitserve/tiny-llama", help="model name or path")
        p.add_argument("--revision", default="main")
        p.add_argument("--dtype", default="float32")
        p.add_argument("--block-size", type=int, default=16)

    p = sub.add_parser("hash", help=cmd_hash.__doc__)
    model_args(p)
    p.add_argument("--salt", default=None, help="cache_salt (per tenant)")
    p.add_argument("tokens", help="token ids, separated by commas or spaces")
    p.set_defaults(func=cmd_hash)

    p = sub.add_parser("kv-demo", help=cmd_kv_demo.__doc__)
    model_args(p)
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--system-prompts", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_kv_demo)

    p = sub.add_parser("generate", help=cmd_generate.__doc__)
    p.add_argument("prompt", nargs="*", help="prompts (default: one example)")
    p.add_argument("--model-path", default=None, help="checkpoint folder (default: tiny model)")
    p.add_argument("--dtype", default=None, help="float32, float16, bfloat16 (default: ckpt's)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--kv-cache-mb", type=int, default=256, help="KV cache size on CPU")
    p.add_argument("--cpu", action="store_true", help="run on CPU even if a GPU is present")
    remote = p.add_argument_group("through a running cluster (--target)")
    remote.add_argument("--target", default=None, help="router host:port; streams via the SDK")
    remote.add_argument("--top-k", type=int, default=-1)
    remote.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    remote.add_argument("--ignore-eos", action="store_true")
    remote.add_argument("--cache-salt", default=None)
    remote.add_argument("--timeout", type=float, default=None, help="seconds per request")
    p.set_defaults(func=cmd_generate)

    def node_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", default=None, help="checkpoint folder (default: tiny model)")
        p.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
        p.add_argument(
            "--advertise-host",
            default=None,
            help="the host other processes reach this node at, registered in Redis (default: "
            "--host, or this machine's name when --host is 0.0.0.0 or ::)",
        )
        p.add_argument("--port", type=int, default=None, help="0 (default): a free port")
        p.add_argument("--port-file", default=None, help="write the bound port here")
        p.add_argument(
            "--drain-timeout-s",
            type=float,
            default=None,
            help="on SIGTERM, how long in-flight requests may take to finish (default 30)",
        )
        p.add_argument(
            "--metrics-port", type=int, default=None, help="serve Prometheus /metrics on it"
        )
        p.add_argument("--device", default=None, help="cpu (default) or cuda[:N]")
        p.add_argument(
            "--kv-transfer",
            default=None,
            help="KV transfer paths besides gRPC bytes, comma-separated: ipc (same host, CUDA; "
            "the default), dist (torch.distributed), or none",
        )
        p.add_argument("--dtype", default=None, help="default: the checkpoint's")
        p.add_argument("--kv-cache-mb", type=int, default=None, help="CPU KV cache size")
        p.add_argument("--gpu-memory-utilization", type=float, default=None)
        p.add_argument("--max-num-seqs", type=int, default=None)
        p.add_argument("--max-num-batched-tokens", type=int, default=None)
        p.add_argument("--block-size", type=int, default=None)
        p.add_argument("--load-format", default=None, choices=("auto", "dummy"))
        p.add_argument("--transfer-deadline-s", type=float, default=None)
        p.add_argument("--redis-url", default=None, help="publish the prefix index and register")
        p.add_argument(
            "--gpu-lock-dir",
            default=None,
            help="with --device cuda: claim a GPU no other node holds a lock on in this "
            "directory (shared by the nodes of a host) and use only it",
        )
        p.add_argument(
            "--no-prefix-caching",
            dest="enable_prefix_caching",
            action="store_const",
            const=False,
            default=None,
            help="compute and ship every prompt in full (a cold baseline for benchmarks)",
        )

    env_epilog = (
        "Every option can also be set as SPLITSERVE_<OPTION> (e.g. --redis-url as "
        "SPLITSERVE_REDIS_URL; switches take 1/true/yes/on); the command line wins."
    )
    for role in ("prefill", "decode"):
        p = sub.add_parser(role, help=f"run one {role} node", epilog=env_epilog)
        node_args(p)
        p.set_defaults(func=cmd_node)

    p = sub.add_parser("router", help=cmd_router.__doc__, epilog=env_epilog)
    p.add_argument("--model", default=None, help="checkpoint folder (tokenizer; default: tiny)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--port-file", default=None)
    p.add_argument("--prefill", default="", help="static prefill nodes, host:port,host:port,...")
    p.add_argument("--decode", default="", help="static decode nodes, host:port,host:port,...")
    p.add_argument("--dtype", default=None, help="the nodes' dtype (default: the checkpoint's)")
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--max-attempts", type=int, default=3, help="per stage, across nodes")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on it")
    p.add_argument(
        "--block-size", type=int, default=16, help="the nodes' KV block size (same everywhere)"
    )
    p.add_argument(
        "--redis-url",
        default=None,
        help="node registry + prefix index: discovery and cache-aware routing",
    )
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
    p.add_argument("--model", default=None, help="checkpoint folder (default: tiny model)")
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the router's port")
    p.add_argument("--redis-url", default=None, help="default: start a private redis-server")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (all nodes on it)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--kv-cache-mb", type=int, default=None, help="CPU KV cache size per node")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="per node (default on CUDA: 0.9 / number of nodes)",
    )
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--load-format", default=None, choices=("auto", "dummy"))
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    p.set_defaults(func=cmd_up)

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
