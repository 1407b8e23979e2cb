"""One frozen config per process kind, built by the CLI and passed down."""

from __future__ import annotations

import socket
from dataclasses import dataclass

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


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


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """A prefill or decode node."""

    model_path: str  # checkpoint folder (config.json, safetensors, tokenizer)
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port (the chosen one is logged and written to port_file)
    port_file: str | None = None  # write the bound port here once serving (for launchers)
    device: str = "cpu"  # "cpu" or "cuda[:N]"
    dtype: str | None = None  # default: the checkpoint's
    kv_cache_mb: int = 256  # CPU KV cache size; on CUDA the pool is sized from free memory
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    load_format: str = "auto"  # or "dummy" (random weights, for benchmarks)
    transfer_deadline_s: float = 30.0  # decode: free a transferred request not claimed by then
    redis_url: str | None = None  # prefix index + registry; None: no index (static routing)
    enable_prefix_caching: bool = True  # False: every prompt is computed and shipped in full
    # The host other processes reach this node at (what it registers in Redis); None: the listen
    # host, or this machine's name when that is a wildcard (default_advertise_host).
    advertise_host: str | None = None
    # SIGTERM: stop taking work, let in-flight requests finish for up to this long, then exit.
    drain_timeout_s: float = 30.0
    metrics_port: int | None = None  # Prometheus /metrics on this port (0: any free one)
    # KV transfer paths this node may use besides the gRPC byte stream (always available):
    # "ipc" (same host, CUDA), "dist" (torch.distributed: NCCL on GPUs, gloo on CPU).
    kv_transfer: str = "ipc"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def advertised_host(self) -> str:
        """``advertise_host`` if given, else ``default_advertise_host(host)`` (may look up this
        machine's name: call once at start)."""
        return self.advertise_host or default_advertise_host(self.host)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    model_path: str  # for the tokenizer
    prefill_addresses: tuple[str, ...]
    decode_addresses: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0
    port_file: str | None = None
    request_timeout_s: float = 600.0
    max_attempts: int = 3  # per stage: a failed or refusing node is retried elsewhere
    redis_url: str | None = None  # node registry + prefix index: discovery, cache-aware routing
    dtype: str | None = None  # the nodes' KV dtype (part of the model identity); default: ckpt's
    metrics_port: int | None = None  # Prometheus /metrics on this port (0: any free one)
    block_size: int = 16  # the nodes' KV block size (part of the model identity, hashing)
