"""The nodes' frozen config (``NodeConfig``), built by the CLI and passed down, and the checks and
help texts the router's (``router.config.RouterConfig``) shares.

Each option is declared once, with its default and help: ``splitserve prefill|decode|router``
derive their flags and SPLITSERVE_<OPTION> variables from these fields (runtime.options)."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from splitserve.kvstore.hashing import (
    DEFAULT_BLOCK_SIZE,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    ModelIdentity,
    canonical_dtype,
)
from splitserve.runtime.options import option

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


CPU_KV_CACHE_MB = 256  # the KV pool of a CPU node without --kv-cache-mb
HOST_CACHE_SHARE = 0.25  # of the memory available at start: the host KV tier by default


def auto_host_cache_mb(
    num_nodes: int = 1, meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup"
) -> int:
    """The host KV tier each of ``num_nodes`` nodes of this machine gets by default:
    ``HOST_CACHE_SHARE`` of the memory available now, shared equally; 0 where that cannot be
    read. Available: ``MemAvailable``, or less where this process's cgroup (a container's memory
    limit, v2 or v1) leaves less: /proc/meminfo shows the host's memory inside a container too,
    and a tier sized from it would have the container killed as it fills."""
    try:
        with open(meminfo) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return 0
    left = _cgroup_memory_left(cgroup)
    if left is not None:
        available = min(available, left)
    return int(available / 2**20 * HOST_CACHE_SHARE) // max(num_nodes, 1)


def _cgroup_memory_left(root: str) -> int | None:
    """Bytes this process's cgroup may still take (its limit less its usage), None without a
    limit (or where none can be read)."""
    for limit_file, usage_file in (
        ("memory.max", "memory.current"),  # cgroup v2
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),  # v1
    ):
        try:
            with open(f"{root}/{limit_file}") as f:
                limit = f.read().strip()
            with open(f"{root}/{usage_file}") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # v1's "no limit"
            return None
        return max(int(limit) - usage, 0)
    return None


DISK_CACHE_SHARE = 0.5  # of the disk tier folder's free space at start, by default


def auto_disk_cache_mb(directory: str, num_nodes: int = 1) -> int:
    """The disk KV tier each of ``num_nodes`` nodes under ``directory`` gets by default:
    ``DISK_CACHE_SHARE`` of its file system's free space now plus what the folder holds already
    (blocks of an earlier run: a restart must not shrink the tier), shared equally (the folder
    is made if missing)."""
    import os
    import shutil

    os.makedirs(directory, exist_ok=True)
    held = 0
    for folder, _, files in os.walk(directory):
        for name in files:
            try:
                held += os.path.getsize(os.path.join(folder, name))
            except OSError:
                continue  # (deleted meanwhile)
    free = shutil.disk_usage(directory).free + held
    return int(free / 2**20 * DISK_CACHE_SHARE) // max(num_nodes, 1)


def check_kv_store(url: str, has_tls: bool, trust_kv_network: bool) -> None:
    """Refuse a shared KV store that would carry a TLS cluster's KV in the clear off this host.

    NOTE: Mooncake Store has no authentication and no encryption: whoever reaches its master
    and its memory holders reads and writes every block."""
    from splitserve.engine.kv_store import parse_store_url, store_host

    parse_store_url(url)
    host = store_host(url)
    if has_tls and not trust_kv_network and not is_loopback(host):
        raise ValueError(
            f"--kv-store {url}: the store has no authentication or encryption, and this node "
            "serves with --tls-*: keep the store on loopback, or pass --trust-kv-network where "
            "the network to it is private (docs/security.md)"
        )


def default_advertise_host(listen_host: str) -> str:
    """The host to advertise for a listen address: itself, or for a wildcard (0.0.0.0, ::) this
    machine's name (its FQDN, else its host name; in a container: the container's host name,
    which the other containers of its network resolve)."""
    if listen_host not in WILDCARD_HOSTS:
        return listen_host
    name = socket.getfqdn()
    if not name or name.startswith("localhost") or name in WILDCARD_HOSTS:
        name = socket.gethostname()
    return name


def parse_addresses(value: str) -> tuple[str, ...]:
    """``host:port,host:port,...`` as a tuple (empty for an empty string)."""
    if not value:
        return ()
    addresses = tuple(a.strip() for a in value.split(",") if a.strip())
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{address!r} is not host:port")
    if not addresses:
        raise ValueError("give at least one host:port")
    return addresses


def check_redis_url(url: str | None, flag: str = "--redis-url") -> None:
    """``ValueError`` saying what to fix unless `url` is None or a Redis URL the client reads as
    written: ``redis://host[:port][/db]``, ``rediss://...`` or ``unix:///path``. The client
    itself drops what it cannot place (``redis://redis://h:6379`` would connect to a host named
    "redis"), so a typo would leave a node without its index, quietly."""
    if url is None:
        return
    hint = "give redis://host:port[/db], rediss://host:port[/db] or unix:///path/to/socket"
    parts = urlsplit(url)
    if parts.scheme == "unix":
        if not parts.path or parts.netloc:
            raise ValueError(f"{flag} {url!r}: a unix socket URL is unix:///path; {hint}")
        return
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"{flag} {url!r}: unknown scheme {parts.scheme!r}; {hint}")
    try:
        port = parts.port  # (a ValueError for a port that is no number or out of range)
    except ValueError:
        port = 0
    if port == 0:
        raise ValueError(f"{flag} {url!r}: the port is not a number in 1..65535; {hint}")
    if not parts.hostname:
        raise ValueError(f"{flag} {url!r}: no host; {hint}")
    if parts.path not in ("", "/") and not parts.path[1:].isdigit():
        raise ValueError(
            f"{flag} {url!r}: after the address only /<database number> may follow, "
            f"not {parts.path!r}; {hint}"
        )


def parse_weights(text: str | None) -> dict[str, float]:
    """``tenant-a=4,key-0123abcd4567=0.5`` → {"tenant-a": 4.0, ...}; ``ValueError`` saying
    what is wrong."""
    weights: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        client, sep, value = part.rpartition("=")
        client = client.strip()
        try:
            weight = float(value)
        except ValueError:
            weight = -1.0
        if not sep or not client or not weight > 0 or weight == float("inf"):
            raise ValueError(f"bad client weight {part!r}: give CLIENT=WEIGHT, WEIGHT > 0")
        weights[client] = weight
    return weights


_MODEL_HELP = (
    "checkpoint folder or .gguf file (default: the embedded SmolLM2-135M-Instruct; `tiny`: the "
    "random test model)"
)
PORT_FILE_HELP = "write the bound port here once serving (for launchers)"
METRICS_HELP = "serve Prometheus /metrics on this port (0: any free one; default: none)"
METRICS_FILE_HELP = "write the bound /metrics port here once serving (with --metrics-port 0)"
REDIS_HELP = "node registry + prefix index: discovery and cache-aware routing (default: none)"
OTLP_HELP = (
    "send OpenTelemetry traces of requests to this OTLP collector (HTTP/protobuf to URL/v1/traces; "
    "OTEL_EXPORTER_OTLP_PROTOCOL=grpc for gRPC; the OTEL_* variables are honoured; default: off)"
)
OTLP_RATIO_HELP = (
    "the share of requests traced, 0..1 (the router decides, the nodes follow; default: the "
    "SDK's OTEL_TRACES_SAMPLER, i.e. every request)"
)
_QUANT_HELP = (
    "fp8: the linear layers in FP8 (per-channel weight scales, per-token activation scales; a "
    "16-bit checkpoint is quantized at load; needs FP8 tensor cores on CUDA: Ada, Hopper), part "
    "of the model identity (default: the checkpoint's own: FP8 for one published in FP8)"
)
_KV_DTYPE_HELP = (
    "auto: the KV cache in the model's dtype; fp8: in e4m3 with a scale per layer for K and V "
    "(the checkpoint's self_attn.k_scale/v_scale, else 1.0): twice the tokens per GB and half the "
    "bytes shipped between the pools. Part of the model identity (the same everywhere)"
)
BLOCK_HELP = "tokens per KV block, part of the model identity (the same everywhere)"
TLS_HELP = "mTLS on every gRPC port and channel of this process (all three files, PEM): "
AUTH_HELP = (
    "a file holding the cluster token: internal calls must carry it (authorization: Bearer) "
    "and this process sends it on its own (default: none, internal services open)"
)


def check_cuda_dtype(model_path: str, dtype: str | None) -> None:
    """``ValueError`` when a node on CUDA would serve float32 (``dtype``, or the checkpoint's own
    when None), which the Triton kernels do not take: said when the options are parsed, not
    after the weights load."""
    if dtype is not None:
        if canonical_dtype(dtype) == "float32":
            raise ValueError(
                "--dtype float32 on CUDA: the kernels take float16 and bfloat16; use --dtype "
                "bfloat16 (and give the router the same --dtype)"
            )
        return
    try:
        stored = ModelIdentity.for_checkpoint(model_path).dtype
    except ValueError:
        return  # not a checkpoint folder: loading it says why
    if stored == "float32":
        raise ValueError(
            f"{model_path} is stored in float32, which the CUDA kernels do not take: start every "
            "component (the router too) with --dtype bfloat16 (or float16); `splitserve up "
            "--device cuda` picks bfloat16 by itself"
        )


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """A prefill or decode node."""

    model_path: str = option(help=_MODEL_HELP, flag="--model", cli_default=None)
    host: str = option("127.0.0.1", "listen address")
    advertise_host: str | None = option(
        None,
        "the host other processes reach this node at, registered in Redis (default: --host, or "
        "this machine's name when --host is 0.0.0.0 or ::; see default_advertise_host)",
    )
    port: int = option(0, "listen port; 0: a free one (logged and written to --port-file)")
    port_file: str | None = option(None, PORT_FILE_HELP)
    # SIGTERM: stop taking work, let in-flight requests finish for up to this long, then exit.
    drain_timeout_s: float = option(
        30.0, "on SIGTERM, how long in-flight requests may take to finish"
    )
    metrics_port: int | None = option(None, METRICS_HELP)
    metrics_port_file: str | None = option(None, METRICS_FILE_HELP)
    otlp_endpoint: str | None = option(None, OTLP_HELP)
    otlp_sample_ratio: float | None = option(None, OTLP_RATIO_HELP)
    auth_token_file: str | None = option(None, AUTH_HELP)
    tls_cert: str | None = option(None, TLS_HELP + "its certificate")
    tls_key: str | None = option(None, TLS_HELP + "its private key")
    tls_ca: str | None = option(None, TLS_HELP + "the CA that signs every component's certificate")
    device: str = option("cpu", "cpu or cuda[:N]")
    tensor_parallel_size: int = option(
        1,
        "split the model's heads, MLP and vocabulary over N ranks, one process each (on GPUs: "
        "the N consecutive ones from --device's); the KV of a node at N > 1 moves over gRPC "
        "bytes, to nodes of any size",
    )
    kv_transfer: str = option(
        "ipc,dist,tcp",
        "KV transfer paths besides gRPC bytes (always available), comma-separated, taken in this "
        "order where they work: ipc (same kernel, CUDA), nixl (NIXL/UCX one-sided writes; needs "
        "the nixl extra; not in the default: docs/transfer.md), dist (torch.distributed: NCCL on "
        "GPUs, gloo on CPU), tcp (raw sockets); or none",
    )
    kv_stream_min_tokens: int = option(
        0,
        "prefill: a prompt of at least N tokens ships its KV to the decode node while it is "
        "computed, each layer as soon as the forward wrote it, where the pair's path can (tcp); "
        "its decode blocks are reserved from then on (0, the default: always after the prefill; "
        "not yet measured to pay on a GPU, docs/transfer.md)",
    )
    trust_kv_network: bool = option(
        False,
        "with --tls-*: still offer and take the dist path between nodes, whose KV bytes are "
        "plaintext (NCCL/gloo cannot run inside TLS); with --tls-* or a cluster token: also "
        "nixl, whose UCX neither encrypts nor checks who writes; and a --kv-store off loopback; "
        "only where the network between the nodes is trusted (default: tcp inside TLS or gated "
        "dist instead; with neither --tls-* nor a token both are offered)",
    )
    dtype: str | None = option(None, "float32, float16 or bfloat16 (default: the checkpoint's)")
    quantization: str | None = option(None, _QUANT_HELP, choices=QUANTIZATIONS)
    kv_cache_dtype: str = option("auto", _KV_DTYPE_HELP, choices=KV_CACHE_DTYPES)
    kv_cache_mb: int | None = option(
        None,
        "the KV pool's size in MiB (default: 256 on CPU; on CUDA the memory left under "
        "--gpu-memory-utilization after the weights and activations)",
    )
    kv_host_cache_mb: int | None = option(
        None,
        "the host-memory KV tier behind the pool, in MiB: every full block is copied there, and "
        "a prefix the pool evicted is copied back instead of computed again; on a GPU its pinned "
        "memory is taken at start, on a CPU as it fills (0: off; default: a quarter of the "
        "memory available at start, in a "
        "container of what its memory limit leaves, which `up` divides among its nodes; "
        "docs/deploy.md, KV tiers)",
    )
    kv_disk_cache_dir: str | None = option(
        None,
        "a disk KV tier in this folder behind the host tier: blocks are written to files named "
        "by their hash and read back on a hit; a node restarted with the same folder and model "
        "finds its blocks again (default: none)",
    )
    kv_disk_cache_mb: int | None = option(
        None,
        "the disk tier's size in MiB (default: half the folder's free space at start, which `up` "
        "divides among its nodes)",
    )
    kv_store: str | None = option(
        None,
        "a KV store shared by every node, behind the host tier: mooncake://HOST[:PORT] (Mooncake "
        "Store's master; needs the mooncake extra). Each node puts the blocks it computes and "
        "reads blocks any node put (default: none; `up --kv-store embedded` starts one; "
        "docs/deploy.md, KV tiers)",
    )
    gpu_memory_utilization: float = option(0.9, "share of the GPU's memory this node may use")
    max_num_seqs: int = option(256, "requests in a batch at most")
    max_num_batched_tokens: int = option(8192, "tokens in a batch at most")
    block_size: int = option(DEFAULT_BLOCK_SIZE, BLOCK_HELP)
    load_format: str = option(
        "auto",
        "auto (safetensors) or dummy (random weights, for benchmarks)",
        choices=("auto", "dummy"),
    )
    transfer_deadline_s: float = option(
        30.0, "decode: free a transferred request not claimed by then (seconds)"
    )
    stream_interval: int = option(
        1,
        "decode: send a request's tokens to the router every N tokens (the first and the last at "
        "once): N times fewer messages for the router to relay, tokens in bursts of N",
    )
    # Above the 384 requests one router lets a decode node hold with the defaults (max_num_seqs
    # 256 x --decode-overcommit 1.5): a single prefill node feeding this one never meets it.
    max_transfers_per_peer: int = option(
        512,
        "decode: KV transfers one sending node may have in flight here at once; more: "
        "RESOURCE_EXHAUSTED (the router retries on another pair)",
    )
    max_kv_share_per_peer: float = option(
        0.5,
        "decode: share of this node's KV blocks one sending node's transfers in flight may hold "
        "(its first transfer is always let through); more: RESOURCE_EXHAUSTED (the router "
        "retries on another pair)",
    )
    redis_url: str | None = option(
        None, "publish the prefix index and register in the node registry (default: no index)"
    )
    enable_prefix_caching: bool = option(
        True,
        "compute and ship every prompt in full (a cold baseline for benchmarks)",
        flag="--no-prefix-caching",
    )
    async_scheduling: str = option(
        "auto",
        "schedule and launch step N+1 while step N computes: auto (on a GPU), on, off",
        choices=("auto", "on", "off"),
    )
    enforce_eager: bool = option(
        False,
        "no CUDA graphs: every decode step launches its kernels one by one (slower at small "
        "batches; to rule the graphs out, or where capture fails)",
    )
    engine_process: str = option(
        "auto",
        "run the engine (scheduler, model, KV cache, KV transfer sides) in a process of its own, "
        "apart from the gRPC front: auto (on a GPU), on, off",
        choices=("auto", "on", "off"),
    )

    def __post_init__(self) -> None:
        if self.kv_cache_mb is not None and self.kv_cache_mb < 1:
            raise ValueError(f"--kv-cache-mb: >= 1, got {self.kv_cache_mb}")
        if self.kv_host_cache_mb is not None and self.kv_host_cache_mb < 0:
            raise ValueError(
                f"--kv-host-cache-mb: >= 0 (0: no host tier), got {self.kv_host_cache_mb}"
            )
        if self.kv_disk_cache_mb is not None and self.kv_disk_cache_mb < 1:
            raise ValueError(f"--kv-disk-cache-mb: >= 1, got {self.kv_disk_cache_mb}")
        if self.kv_disk_cache_dir is not None and self.kv_host_cache_mb == 0:
            raise ValueError(
                "--kv-disk-cache-dir spills from the host tier: drop --kv-host-cache-mb 0"
            )
        if self.kv_store is not None and self.kv_host_cache_mb == 0:
            raise ValueError("--kv-store sits behind the host tier: drop --kv-host-cache-mb 0")
        if self.kv_store is not None:
            check_kv_store(self.kv_store, bool(self.tls_cert), self.trust_kv_network)
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval: >= 1, got {self.stream_interval}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size: >= 1, got {self.tensor_parallel_size}")
        if self.max_transfers_per_peer < 1:
            raise ValueError(f"--max-transfers-per-peer: >= 1, got {self.max_transfers_per_peer}")
        if self.kv_stream_min_tokens < 0:
            raise ValueError(f"--kv-stream-min-tokens: >= 0, got {self.kv_stream_min_tokens}")
        if not 0.0 < self.max_kv_share_per_peer <= 1.0:
            raise ValueError(
                f"--max-kv-share-per-peer: in (0, 1], got {self.max_kv_share_per_peer}"
            )
        check_redis_url(self.redis_url)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def advertised_host(self) -> str:
        """``advertise_host`` if given, else ``default_advertise_host(host)`` (may look up this
        machine's name: call once at start)."""
        return self.advertise_host or default_advertise_host(self.host)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
