"""What ``splitserve up`` starts (ClusterSpec: its options are these fields), where it put it
(ClusterAddresses), and the free ports it hands out; splitserve.launcher starts the processes."""

from __future__ import annotations

import collections
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from splitserve.runtime.config import check_redis_url
from splitserve.runtime.options import option
from splitserve.runtime.slo import Slo

DEFAULT_GPU_SHARE = 0.9  # of one GPU's memory, split among the nodes sharing it

# ``--num-routers auto`` (docs/deploy.md, "Routers", has the measurements behind these): one
# router relays ~15,000 tok/s on a core, a decode GPU of an 8B model makes up to ~6,300 (9,000 at
# TP 2); one router's event loop falls behind past ~2x a GPU's knee under overload, two hold 4x.
DECODE_GPUS_PER_ROUTER = 2
MIN_GPU_ROUTERS = 2
CORES_PER_ROUTER = 4  # a router's core, and room for the nodes' own processes

RouterCount = int  # ``--num-routers``: a number, or ``auto`` (0; ClusterSpec resolves it)
PrefillCount = int  # ``--num-prefill``: a number, or ``auto`` (AUTO_PREFILL; `up` resolves it)
AUTO_PREFILL = -1


def prefill_count(text: str | int) -> int:
    """``--num-prefill``: a number >= 0, or ``auto`` (``AUTO_PREFILL``: the layout search's)."""
    if isinstance(text, int):  # the default, as is
        return text
    if text.strip().lower() == "auto":
        return AUTO_PREFILL
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"give a number or auto, got {text!r}") from None


def router_count(text: str) -> int:
    """``--num-routers``: ``auto`` (0) or a number >= 1."""
    if text.strip().lower() == "auto":
        return 0
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"give a number or auto, got {text!r}") from None


def auto_routers(device: str, decode_gpus: int, cores: int | None) -> int:
    """The routers ``--num-routers auto`` starts for ``decode_gpus`` GPUs of decode nodes
    (their ranks counted) on a host of ``cores`` CPU cores."""
    if not device.startswith("cuda"):
        return 1  # CPU nodes make a few hundred tokens a second: one router is plenty
    wanted = max(MIN_GPU_ROUTERS, -(-decode_gpus // DECODE_GPUS_PER_ROUTER))
    return max(1, min(wanted, (cores or 1) // CORES_PER_ROUTER))


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """What ``splitserve up`` starts (its options are these fields; see runtime.options)."""

    model_path: str = option(
        help="checkpoint folder, .gguf file (or a folder holding one) or `tiny` (the random "
        "test model); default: SmolLM2-135M-Instruct",
        flag="--model",
        cli_default=None,
    )
    num_prefill: PrefillCount = option(
        1,
        "prefill nodes (0: the decode nodes prefill every request themselves, e.g. one GPU; "
        "`auto`: the layout that serves --workload best under --slo, from --rates: "
        "docs/deploy.md, Choosing the layout)",
        convert=prefill_count,
    )
    num_decode: int = option(1, "decode nodes")
    num_routers: RouterCount = option(
        0,
        "routers sharing the one --port (and --http-port) through SO_REUSEPORT; the decode nodes "
        "lease their capacity to them as each needs it. `auto`: one for CPU nodes; on GPUs one per "
        f"{DECODE_GPUS_PER_ROUTER} decode GPUs, at least {MIN_GPU_ROUTERS}, at most one per "
        f"{CORES_PER_ROUTER} cores (docs/deploy.md, Routers)",
        cli_default="auto",
        convert=router_count,
    )
    host: str = option("127.0.0.1", "listen address of every component")
    port: int = option(8000, "the router's port")
    http_port: int | None = option(
        None, "the router's OpenAI-compatible HTTP API on this port (0: a free one; default: none)"
    )
    direct_prefill_tokens: int | None = option(
        None,
        "the router's --direct-prefill-tokens: prompts with at most this many uncached tokens "
        "are prefilled on their decode node (default: the router's, 0: never)",
    )
    tokenizer_path: str | None = option(
        None, "the router's tokenizer folder (default: the checkpoint's)", flag="--tokenizer"
    )
    slo: str | None = option(
        None,
        "the router's --slo, e.g. ttft=2,tpot=100ms: requests predicted to miss it are refused "
        "at once (default: none); with --autoscale also the planner's aim (default there: "
        "ttft=2,tpot=0.1)",
    )
    metrics_port: int | None = option(
        None,
        "Prometheus /metrics of every component: the router's on this port, each node's on the "
        "next ones (prefill nodes first); 0: free ones; all printed (default: none)",
    )
    otlp_endpoint: str | None = option(
        None,
        "OpenTelemetry traces of requests from every component to this OTLP collector (HTTP/"
        "protobuf to URL/v1/traces; the OTEL_* variables are honoured; default: off)",
    )
    otlp_sample_ratio: float | None = option(
        None, "the share of requests traced, 0..1 (default: every request)"
    )
    redis_url: str | None = option(None, "a Redis to use (default: start a private redis-server)")
    prefix_index: bool = True  # False: no Redis at all (static routing by load, local caches)
    kv_store_mb: int | None = option(
        None,
        "with --kv-store embedded: the memory the store holds, in MiB (default: an eighth of the "
        "memory available at start, at most 4096)",
    )
    device: str = option(
        "cpu",
        "cpu, cuda (the nodes spread over --gpus, round robin) or cuda:N (all on GPU N)",
    )
    gpus: str | None = option(
        None, "with --device cuda: the GPUs to place nodes on, round robin (default: all visible)"
    )
    gpu_memory_utilization: float | None = option(
        None, "per node (default on CUDA: 0.9 / number of nodes)"
    )
    tensor_parallel_size: int = option(
        1,
        "every node's tensor parallel size (its ranks on that many consecutive GPUs; "
        "docs/deploy.md, Models larger than one GPU)",
    )
    prefill_tp: int | None = option(
        None, "the prefill nodes' tensor parallel size (default: --tensor-parallel-size)"
    )
    decode_tp: int | None = option(
        None, "the decode nodes' tensor parallel size (default: --tensor-parallel-size)"
    )
    node_args: tuple[str, ...] = ()  # further flags for every node, e.g. ("--kv-cache-mb", "512")
    startup_timeout_s: float = option(600.0, "seconds", flag="--startup-timeout")
    node_hostnames: bool = option(
        False,
        "run each node under a host name of its own (a UTS namespace, `unshare --uts`; needs "
        "root): the layout of one container per node, on one kernel",
    )
    auth_token_file: str | None = option(
        None,
        "the cluster token every internal call must carry: a file, `auto` (a new random one in "
        "the run folder, printed) or `none`",
        cli_default="auto",
    )
    api_key_file: str | None = option(
        None,
        "the API keys both public APIs require (gRPC metadata authorization / HTTP header "
        "Authorization: Bearer <key>): a file, one key a line; `auto` (a new random one in the "
        "run folder, printed) or `none` (open APIs)",
        cli_default="auto",
    )
    tls_cert: str | None = option(None, "mTLS for every component: its certificate (PEM)")
    tls_key: str | None = option(None, "mTLS: the private key of --tls-cert")
    tls_ca: str | None = option(None, "mTLS: the CA that signed it (and every client's)")
    log_file: str | None = option(
        None, "append every component's log to this file (default: this terminal's stderr)"
    )
    stop_grace_s: float = 10.0

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1 or self.num_routers < 0:
            raise ValueError(
                "--num-prefill must be >= 0, --num-decode >= 1, --num-routers >= 1 (or auto)"
            )
        if self.num_routers == 0:  # auto: resolved here, so every later use sees the number
            decode_gpus = self.num_decode * self.tp_of("decode")
            routers = auto_routers(self.device, decode_gpus, os.cpu_count())
            object.__setattr__(self, "num_routers", routers)
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"--http-port {self.http_port}: give 0..65535")
        check_redis_url(self.redis_url)
        # the first router's, then one per node, then the other routers'
        last = 65536 - self.num_prefill - self.num_decode - self.num_routers
        if self.metrics_port is not None and not 0 <= self.metrics_port <= last:
            raise ValueError(f"--metrics-port {self.metrics_port}: give 0..{last}")
        Slo.parse(self.slo)  # a bad --slo fails here, not in the router started later
        ratio = self.otlp_sample_ratio
        if ratio is not None and not 0.0 <= ratio <= 1.0:
            raise ValueError(f"--otlp-sample-ratio {ratio}: give a fraction in [0, 1]")
        for name, value in (
            ("--tensor-parallel-size", self.tensor_parallel_size),
            ("--prefill-tp", self.prefill_tp),
            ("--decode-tp", self.decode_tp),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    def tp_of(self, role: str) -> int:
        """The tensor parallel size of the ``role`` pool's nodes."""
        given = self.prefill_tp if role == "prefill" else self.decode_tp
        return given or self.tensor_parallel_size

    def metrics_ports(self) -> list[int] | None:
        """The /metrics port of the first router, then of each node (prefill nodes first), then
        of the other routers: from ``metrics_port`` on, or 0 for each (each binds a free one
        itself) for 0; None without ``metrics_port``."""
        if self.metrics_port is None:
            return None
        count = self.num_routers + self.num_prefill + self.num_decode
        if self.metrics_port == 0:
            return [0] * count
        return [self.metrics_port + i for i in range(count)]

    def placement(self, num_gpus: int) -> list[tuple[str, float | None]]:
        """(device, memory share) of each node, prefill nodes first. ``--device cuda`` spreads the
        nodes round robin over ``--gpus`` (default: the ``num_gpus`` visible), as a compose
        deployment has one node per GPU; nodes that share a GPU split its memory evenly."""
        sizes = [self.tp_of("prefill")] * self.num_prefill + [self.tp_of("decode")] * (
            self.num_decode
        )
        if self.device == "cuda":
            gpus = parse_gpus(self.gpus) if self.gpus else list(range(max(num_gpus, 1)))
            groups = gpu_groups(gpus, sizes)
        else:
            groups = [[self.device] * n for n in sizes]
            if self.device.startswith("cuda:"):
                first = int(self.device[5:])
                groups = [[f"cuda:{first + r}" for r in range(n)] for n in sizes]
        devices = [g[0] for g in groups]
        if self.gpu_memory_utilization is not None or not self.device.startswith("cuda"):
            return [(d, self.gpu_memory_utilization) for d in devices]
        # NOTE: each node (each of its ranks) sizes its KV pool from its share of its GPU(s).
        load = collections.Counter(d for g in groups for d in g)
        return [(g[0], round(DEFAULT_GPU_SHARE / max(load[d] for d in g), 4)) for g in groups]


def gpu_groups(gpus: list[int], sizes: list[int]) -> list[list[str]]:
    """The GPUs of each node, given each node's tensor parallel size: a node of size n takes
    the next n consecutive GPUs of ``gpus`` (round robin; a node's ranks run on consecutive
    device numbers, from its ``--device``). ``ValueError`` when no such run exists."""
    out, cursor = [], 0
    for n in sizes:
        if n > len(gpus):
            raise ValueError(
                f"a node at tensor parallel size {n} needs {n} GPUs; --gpus gives {len(gpus)}"
            )
        if cursor + n > len(gpus):
            cursor = 0
        run = gpus[cursor : cursor + n]
        if run != list(range(run[0], run[0] + n)):
            raise ValueError(
                f"a node at tensor parallel size {n} needs {n} consecutive GPUs; --gpus gives "
                f"{gpus[cursor : cursor + n]}"
            )
        out.append([f"cuda:{g}" for g in run])
        cursor = (cursor + n) % len(gpus)
    return out


def parse_gpus(text: str) -> list[int]:
    try:
        gpus = [int(g) for g in text.split(",") if g.strip()]
    except ValueError:
        raise ValueError(f"--gpus {text!r}: give GPU indices, e.g. 0,1,2") from None
    if not gpus or min(gpus) < 0:
        raise ValueError(f"--gpus {text!r}: give GPU indices, e.g. 0,1,2")
    return gpus


@dataclass(frozen=True, slots=True)
class ClusterAddresses:
    router: str
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    redis_url: str
    token_file: str | None = None  # the cluster token (None: internal services are open)
    http: str | None = None  # the router's HTTP API, host:port (None: not served)
    # Each component's gRPC address (router, nodes) → its /metrics URL (empty: not served).
    metrics: Mapping[str, str] = field(default_factory=dict)
    api_key_file: str | None = None  # the public APIs' keys (None: no key needed)
    # Every router's /metrics URL (several share ``router``: --num-routers), empty: not served.
    router_metrics: tuple[str, ...] = ()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def metrics_url(host: str, port: int) -> str:
    return f"http://{host}:{port}/metrics"
