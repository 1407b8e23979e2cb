"""A local cluster of separate processes: Redis, prefill nodes, decode nodes and the router.

``splitserve up`` runs one: each component is ``python -m splitserve.cli <role> ...`` with
``--port 0 --port-file F``; the launcher waits for every port file and for grpc.health.v1 to
answer SERVING before it starts what depends on it, and on stop sends SIGTERM (router first,
then the nodes, then Redis), waits, and SIGKILLs what is left. With ``--metrics-port`` every
component serves Prometheus ``/metrics`` (ClusterAddresses.metrics): on ports from P on, or, with 0,
on a free one it binds itself and writes to ``--metrics-port-file`` (picking one for it would race
other processes on the machine for the port between the pick and the bind).

Over 300 lines: the whole life of a local cluster (start order, the elastic pools the planner grows
and drains under one lock, stop order) is one object; moving the elastic part out would split that
lock's users across files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitserve.cluster_spec import (
    ClusterAddresses,
    ClusterSpec,
    free_port,
    metrics_url,
    parse_gpus,
)
from splitserve.engine import lifeline
from splitserve.planner import placement
from splitserve.runtime.config import auto_disk_cache_mb, auto_host_cache_mb
from splitserve.runtime.tls import TlsFiles, sync_channel

__all__ = [
    "ClusterAddresses",
    "ClusterSpec",
    "LocalCluster",
    "StartInterrupted",
    "free_port",
    "metrics_url",
    "parse_gpus",
    "start_redis_server",
]

logger = logging.getLogger(__name__)
HOST_CACHE_FLAG = "--kv-host-cache-mb"
STORE_FLAG = "--kv-store"
DISK_DIR_FLAG, DISK_CACHE_FLAG = "--kv-disk-cache-dir", "--kv-disk-cache-mb"


@dataclass(slots=True)
class _Process:
    name: str
    popen: subprocess.Popen
    port_file: Path | None = None
    metrics_port: int | None = None  # its /metrics port; 0: bound by it, in metrics_port_file
    metrics_port_file: Path | None = None
    device: str = "cpu"
    elastic: bool = False  # started at run time (add_node): its exit does not stop the cluster
    disk_folder: str | None = None  # its disk KV tier's folder (None: none)
    drained_at: float | None = None  # when drain_node sent it SIGTERM


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of the last ``flag value`` pair in ``args`` (None: absent)."""
    found = None
    for i, arg in enumerate(args[:-1]):
        if arg == flag:
            found = args[i + 1]
    return found


def _without_flags(args: Sequence[str], flags: Sequence[str]) -> list[str]:
    """``args`` less every ``flag value`` pair of ``flags``."""
    out, skip = [], False
    for i, arg in enumerate(args):
        if skip:
            skip = False
        elif arg in flags and i + 1 < len(args):
            skip = True
        else:
            out.append(arg)
    return out


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _kill_leftovers(proc: _Process) -> None:
    """SIGKILL what is left of an exited component's process group: it was started in a
    session of its own, so its engine process and tensor-parallel ranks are in that group.
    (They end with it anyway, engine.lifeline; this covers anything else it started.)
    The group's id cannot be reused while any member lives."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.popen.pid, signal.SIGKILL)


def _exited(popen: subprocess.Popen, timeout: float) -> bool:
    """Whether ``popen``'s process exits within ``timeout`` seconds (reaped here if so).

    It reaps with ``os.waitpid`` itself, not ``Popen.wait``: an exception that a signal handler
    raises (Ctrl-C; ``up``'s SIGTERM) just after a ``Popen.poll`` took that Popen's internal lock
    leaves the lock held for good, and every later ``wait()`` without a timeout blocks on it. A
    CI run of ``up`` hung so after SIGTERM ("decode-0 ignored SIGTERM", then nothing for 3 min)."""
    end = time.monotonic() + timeout
    while popen.returncode is None:
        try:
            pid, status = os.waitpid(popen.pid, os.WNOHANG)
        except ChildProcessError:
            return True  # reaped already, by the Popen's own poll in another thread: gone
        if pid == popen.pid:
            popen.returncode = os.waitstatus_to_exitcode(status)
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.02)
    return True


def _child_options() -> dict[str, Any]:
    """``subprocess.Popen`` options of every process the launcher starts."""
    return {
        "start_new_session": True,  # Ctrl-C reaches the launcher only; it stops them in order
        # children get SIGTERM if the launcher dies without stopping them (kill -9)
        "preexec_fn": lifeline.term_with_parent,
    }


# Node flags that enter the model identity: the router must be given the same ones, or it
# hashes every prompt differently from the nodes and refuses them at registration.
IDENTITY_FLAGS = ("--dtype", "--block-size", "--quantization", "--kv-cache-dtype")


def _identity_flags(node_args: tuple[str, ...]) -> list[str]:
    """The identity flags of ``node_args`` (``--flag value`` pairs), for the router."""
    out: list[str] = []
    for i, arg in enumerate(node_args[:-1]):
        if arg in IDENTITY_FLAGS:
            out += [arg, node_args[i + 1]]
    return out


class StartInterrupted(Exception):
    """``LocalCluster.start`` gave up because ``interrupt()`` was called (Ctrl-C, SIGTERM)."""


class LocalCluster:
    """Start with ``start()`` (or ``with``); ``stop()`` ends every process it started.

    With ``max_nodes`` (``up --autoscale``) the pools are elastic: ``add_node`` starts a node
    on a GPU with room and ``drain_node`` drains one (SIGTERM); the router then finds the nodes
    in the Redis registry only (no static lists), so one that leaves is forgotten."""

    def __init__(self, spec: ClusterSpec, max_nodes: int | None = None) -> None:
        self.spec = spec
        self.max_nodes = max_nodes
        self._procs: list[_Process] = []
        self._draining: list[_Process] = []
        self._node_flags: list[str] = []  # Redis, token and TLS flags of every node (start)
        self._tier_flags: list[str] = []  # the host KV tier's size, for nodes at TP 1 (start)
        self._disk_folder: str | None = None  # --kv-disk-cache-dir given to up (start)
        self._started = {"prefill": 0, "decode": 0}
        # The planner's thread adds and drains nodes while the main thread polls them.
        self._lock = threading.RLock()
        self._workdir = Path(tempfile.mkdtemp(prefix="splitserve-up-"))
        self.addresses: ClusterAddresses | None = None
        self._tls: TlsFiles | None = None  # set by start(): mTLS files every component uses
        self._interrupted = threading.Event()

    def interrupt(self) -> None:
        """Make a ``start()`` in progress raise ``StartInterrupted`` at its next check (within
        about a second). Only sets an event, so a signal handler may call it: an exception
        raised by the handler itself could land while a lock of the launcher's or of a
        ``subprocess.Popen`` is held, and ``stop()`` needs them."""
        self._interrupted.set()

    def interrupted(self, timeout: float = 0.0) -> bool:
        """Whether ``interrupt()`` has been called (waiting up to ``timeout`` seconds for it)."""
        return self._interrupted.wait(timeout)

    def _spawn(self, name: str, argv: list[str], port_file: Path | None, **kw) -> _Process:
        logger.info("starting %s: %s", name, " ".join(argv))
        popen = subprocess.Popen(argv, **_child_options(), **kw)
        proc = _Process(name, popen, port_file)
        self._procs.append(proc)
        return proc

    def _component(
        self, role: str, index: int, extra: list[str], metrics_port: int | None = None
    ) -> _Process:
        name = f"{role}-{index}"
        if role != "router":
            self._started[role] = max(self._started[role], index + 1)
        port_file = self._workdir / f"{name}.port"
        metrics_file = None
        if metrics_port is not None:
            extra = [*extra, "--metrics-port", str(metrics_port)]
            if metrics_port == 0:
                metrics_file = self._workdir / f"{name}.metrics-port"
                extra += ["--metrics-port-file", str(metrics_file)]
        # -P: the working directory is not put on sys.path; run from a checkout, its top-level
        # folders (kernels/, models/, ...) would shadow installed packages of the same name.
        argv = [sys.executable, "-P", "-m", "splitserve.cli", role, "--model", self.spec.model_path]
        argv += ["--host", self.spec.host, "--port-file", str(port_file), *extra]
        if self.spec.node_hostnames and role != "router":
            # NOTE: a new UTS namespace gets the new host name before the node starts; the node
            # still shares the kernel, loopback and GPUs, like a container with host networking.
            argv = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', name, *argv]
        if self.spec.log_file is None:
            proc = self._spawn(name, argv, port_file)
        else:
            with open(self.spec.log_file, "ab") as log:  # the child keeps its own descriptor
                proc = self._spawn(name, argv, port_file, stdout=log, stderr=subprocess.STDOUT)
        proc.metrics_port, proc.metrics_port_file = metrics_port, metrics_file
        return proc

    def start(self) -> ClusterAddresses:
        """Start every component (``with LocalCluster(spec) as cluster`` calls this; then read
        ``cluster.addresses``)."""
        if self.addresses is not None:
            raise RuntimeError("this cluster is already started")
        spec = self.spec
        deadline = time.monotonic() + spec.startup_timeout_s
        redis_url = ""
        if spec.prefix_index:
            redis_url = spec.redis_url or self._start_redis(deadline)
        index_flags = ["--redis-url", redis_url] if redis_url else []
        token_file = self._token_file()
        if token_file:
            index_flags += ["--auth-token-file", token_file]
        self._tls = TlsFiles.load(spec.tls_cert, spec.tls_key, spec.tls_ca)
        if self._tls is not None:
            index_flags += ["--tls-cert", spec.tls_cert, "--tls-key", spec.tls_key]
            index_flags += ["--tls-ca", spec.tls_ca]
        if spec.otlp_endpoint:  # every component traces (the OTEL_* variables pass down too)
            index_flags += ["--otlp-endpoint", spec.otlp_endpoint]
        if spec.otlp_sample_ratio is not None:
            index_flags += ["--otlp-sample-ratio", str(spec.otlp_sample_ratio)]
        roles = ["prefill"] * spec.num_prefill + ["decode"] * spec.num_decode
        self._node_flags = list(index_flags)
        if HOST_CACHE_FLAG not in spec.node_args:  # the default tier, shared by this host's nodes
            host_mb = auto_host_cache_mb(self.max_nodes or len(roles))
            self._tier_flags = [HOST_CACHE_FLAG, str(host_mb)]
            logger.info("host KV tier: %d MiB per node (%s to change)", host_mb, HOST_CACHE_FLAG)
        args = spec.node_args
        if _flag_value(args, STORE_FLAG) == "embedded":
            self._tier_flags += [STORE_FLAG, self._start_store(deadline)]
        self._disk_folder = _flag_value(args, DISK_DIR_FLAG)  # each node a folder below it
        if self._disk_folder is not None and DISK_CACHE_FLAG not in args:
            # the default: the folder's free space, shared by the nodes
            disk_mb = auto_disk_cache_mb(self._disk_folder, self.max_nodes or len(roles))
            self._tier_flags += [DISK_CACHE_FLAG, str(disk_mb)]
        placement = self._placement(len(roles))
        metrics = spec.metrics_ports()  # router, then each node
        procs = []
        for i, (role, (device, share)) in enumerate(zip(roles, placement, strict=True)):
            flags = ["--port", "0", "--device", device, *self._node_flags]
            if share is not None:
                flags += ["--gpu-memory-utilization", str(share)]
            index = i if role == "prefill" else i - spec.num_prefill
            if spec.tp_of(role) > 1:
                flags += ["--tensor-parallel-size", str(spec.tp_of(role))]
            metrics_port = metrics[1 + i] if metrics else None
            extra = [*flags, *self._tier_args(role, procs)]
            procs.append(self._component(role, index, extra, metrics_port))
            procs[-1].device = device
            procs[-1].disk_folder = _flag_value(extra, DISK_DIR_FLAG)
        prefill, decode = procs[: spec.num_prefill], procs[spec.num_prefill :]
        prefill_addrs = tuple(self._wait_ready(p, deadline) for p in prefill)
        decode_addrs = tuple(self._wait_ready(p, deadline) for p in decode)
        # NOTE: elastic pools are found in the registry only: a static node the planner drained
        # would stay in the router's pools as a down node for good.
        static = ((), ()) if self.max_nodes else (prefill_addrs, decode_addrs)
        api_key_file = self._api_key_file()  # both doors: the gRPC API and the HTTP API
        nodes = spec.num_prefill + spec.num_decode
        router_metrics = [metrics[0], *metrics[1 + nodes :]] if metrics else []
        routers: list[_Process] = []
        # --num-routers: one gRPC and one HTTP port, each router binding it with SO_REUSEPORT
        shared = (spec.port, spec.http_port) if spec.num_routers > 1 else None
        for i in range(spec.num_routers):
            if i == 1 and shared is not None:
                shared = self._ports_bound_by(routers[0], shared, deadline)
            flags = self.router_flags(*static, shared)
            if api_key_file:
                flags += ["--api-key-file", api_key_file]
            metrics_port = router_metrics[i] if metrics else None
            routers.append(self._component("router", i, [*flags, *index_flags], metrics_port))
        router_addr, *_ = [self._wait_ready(r, deadline) for r in routers]  # one address
        http = None
        if spec.http_port is not None:
            http_port = (shared[1] if shared else None) or spec.http_port
            if not http_port:
                http_port = self._read_port_file(routers[0], self._http_port_file, deadline)
            http = f"{spec.host}:{http_port}"
        urls, router_urls = {}, []
        if metrics:
            components = (router_addr, *prefill_addrs, *decode_addrs)
            ports = [self._metrics_port(p, deadline) for p in (routers[0], *procs)]
            urls = {a: metrics_url(spec.host, p) for a, p in zip(components, ports, strict=True)}
            router_urls = [metrics_url(spec.host, self._metrics_port(r, deadline)) for r in routers]
        self.addresses = ClusterAddresses(
            router_addr,
            prefill_addrs,
            decode_addrs,
            redis_url,
            token_file,
            http,
            urls,
            api_key_file,
            tuple(router_urls),
        )
        return self.addresses

    @property
    def _http_port_file(self) -> Path:
        return self._workdir / "router-0.http-port"

    def _ports_bound_by(
        self, first: _Process, shared: tuple[int, int | None], deadline: float
    ) -> tuple[int, int | None]:
        """The gRPC and HTTP ports the other routers share with the first: those given, or
        (for 0) those it bound (a port picked for them all could be taken before one binds)."""
        port, http = shared
        if not port:
            port = int(self._wait_ready(first, deadline).rsplit(":", 1)[1])
        if http == 0:
            http = self._read_port_file(first, self._http_port_file, deadline)
        return port, http

    def router_flags(
        self,
        prefill: tuple[str, ...],
        decode: tuple[str, ...],
        shared: tuple[int, int | None] | None = None,
    ) -> list[str]:
        """A router's own flags (those of Redis, the token, TLS and /metrics come on top);
        ``shared``: the gRPC and HTTP ports of ``--num-routers`` routers."""
        spec = self.spec
        port, http_port = shared or (spec.port, spec.http_port)
        flags = ["--port", str(port)]
        if shared is not None:
            # The decode nodes' leases share their capacity among the routers as each needs it
            # (decode_node.leases); prefill nodes queue what several routers send them.
            flags += ["--reuse-port"]
        if prefill or decode:
            flags += ["--prefill", ",".join(prefill), "--decode", ",".join(decode)]
        if http_port is not None:
            flags += ["--http-port", str(http_port)]
            if http_port == 0:
                flags += ["--http-port-file", str(self._http_port_file)]
        if spec.tokenizer_path is not None:
            flags += ["--tokenizer", spec.tokenizer_path]
        if spec.direct_prefill_tokens is not None:
            flags += ["--direct-prefill-tokens", str(spec.direct_prefill_tokens)]
        if spec.slo:
            flags += ["--slo", spec.slo]
        return flags + _identity_flags(spec.node_args)

    def _token_file(self) -> str | None:
        """The token file every component gets: ``auto`` writes a new one into the run folder."""
        given = self.spec.auth_token_file
        if given is None or given == "none":
            return None
        from splitserve.runtime.auth import read_token_file, write_token_file

        if given == "auto":
            path = self._workdir / "cluster-token"
            write_token_file(path)
            return str(path)
        read_token_file(given)  # a clear error now rather than from every component
        return given

    def _api_key_file(self) -> str | None:
        """The public APIs' key file: ``auto`` writes one with a new key into the run folder."""
        given = self.spec.api_key_file
        if given is None or given == "none":
            return None
        from splitserve.router.api_keys import read_api_keys, write_api_key_file

        if given == "auto":
            path = self._workdir / "api-key"
            write_api_key_file(path)
            return str(path)
        read_api_keys(given)  # a clear error now rather than from the router
        return given

    @property
    def api_key(self) -> str | None:
        """A key the public APIs take (``Bearer <key>``); None: they need none."""
        from splitserve.router.api_keys import read_api_keys

        key_file = self.addresses.api_key_file if self.addresses else None
        return read_api_keys(key_file)[0] if key_file else None

    @property
    def call_metadata(self):
        """Metadata for calls to the nodes' internal services (GetStats, ...) from outside."""
        from splitserve.runtime.auth import metadata_for, read_token_file

        token_file = self.addresses.token_file if self.addresses else None
        return metadata_for(read_token_file(token_file)) if token_file else None

    def _start_store(self, deadline: float) -> str:
        """``--kv-store embedded``: a Mooncake Store (master and memory) on this cluster's host;
        its URL."""
        from splitserve.kv_store_service import default_store_mb, start_store

        mb = self.spec.kv_store_mb or default_store_mb()
        # NOTE: loopback whatever --host says: the store has no authentication (docs/security.md)
        # and this cluster's nodes all run on this host.
        store = start_store("127.0.0.1", mb, self._workdir, deadline, **_child_options())
        for name, popen in zip(("kv-store-master", "kv-store-memory"), store.procs, strict=True):
            self._procs.append(_Process(name, popen))
        logger.info("KV store: %d MiB at %s (--kv-store-mb to change)", mb, store.url)
        return store.url

    def _start_redis(self, deadline: float) -> str:
        log = self._workdir / "redis.log"
        popen, port = start_redis_server(self.spec.host, log, deadline, **_child_options())
        self._procs.append(_Process("redis", popen))
        return f"redis://{self.spec.host}:{port}"

    def _read_port_file(self, proc: _Process, path: Path, deadline: float) -> int:
        """The port ``proc`` writes to ``path`` once it serves (waiting for it)."""
        while True:
            self._check_alive(proc)
            try:
                text = path.read_text().strip()
            except FileNotFoundError:
                text = ""
            if text:
                return int(text)
            self._sleep_until(deadline, proc)

    def _metrics_port(self, proc: _Process, deadline: float) -> int:
        """The port ``proc`` serves /metrics on: the one it was given, or the one it bound."""
        if proc.metrics_port_file is not None:
            return self._read_port_file(proc, proc.metrics_port_file, deadline)
        assert proc.metrics_port is not None
        return proc.metrics_port

    def _wait_ready(self, proc: _Process, deadline: float) -> str:
        """Wait for the port file, then for health SERVING; return host:port."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        assert proc.port_file is not None
        port = self._read_port_file(proc, proc.port_file, deadline)
        address = f"{self.spec.host}:{port}"
        with sync_channel(address, self._tls) as channel:
            # typeshed's HealthStub declares no methods (the generated one sets them in __init__)
            stub: Any = health_pb2_grpc.HealthStub(channel)
            while True:
                self._check_alive(proc)
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        logger.info("%s ready on %s", proc.name, address)
                        return address
                except grpc.RpcError:
                    pass
                self._sleep_until(deadline, proc)

    def _check_alive(self, proc: _Process) -> None:
        if (rc := proc.popen.poll()) is not None:
            log = self.spec.log_file if proc.name != "redis" else None
            where = f"its log is in {log}" if log else "see its log"
            raise RuntimeError(f"{proc.name} exited with status {rc} while starting ({where})")

    def _sleep_until(self, deadline: float, proc: _Process) -> None:
        if self._interrupted.is_set():
            raise StartInterrupted(f"interrupted while waiting for {proc.name} to start")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{proc.name} not ready after {self.spec.startup_timeout_s:.0f} s "
                "(raise --startup-timeout for large models)"
            )
        self._interrupted.wait(0.1)

    def _gpus(self) -> list[int] | None:
        """The GPUs nodes are placed on (None: not ``--device cuda``)."""
        if self.spec.device != "cuda":
            return None
        if self.spec.gpus:
            return parse_gpus(self.spec.gpus)
        return list(range(max(_visible_gpus(), 1)))

    def _placement(self, count: int) -> list[tuple[str, float | None]]:
        """(device, memory share) of the first ``count`` nodes."""
        gpus = self._gpus() if self.max_nodes else None
        if gpus is None:
            return self.spec.placement(_visible_gpus() if self.spec.device == "cuda" else 0)
        used: dict[int, int] = {}
        out: list[tuple[str, float | None]] = []
        for _ in range(count):
            device, share = self._place(gpus, used)
            gpu = int(device.removeprefix("cuda:"))
            used[gpu] = used.get(gpu, 0) + 1
            out.append((device, share))
        return out

    def _tier_args(self, role: str, others: Sequence[_Process]) -> list[str]:
        """``up``'s node options for a new ``role`` node, with its KV tiers: the host tier's
        and disk tier's sizes, and a disk folder of its own, ``<--kv-disk-cache-dir>/<role>-<k>``
        with the lowest k no node in ``others`` holds (the same folders when the same layout is
        started again; two nodes never share one: each trims its folder to its own size). A node
        at TP > 1 gets no tier flags (no tiers there yet: docs/deploy.md, KV tiers)."""
        args = list(self.spec.node_args)
        if _flag_value(args, STORE_FLAG) == "embedded":
            args = _without_flags(args, (STORE_FLAG,))  # (the started store's URL comes below)
        if self.spec.tp_of(role) > 1:
            tiers = (HOST_CACHE_FLAG, DISK_DIR_FLAG, DISK_CACHE_FLAG, STORE_FLAG)
            return _without_flags(args, tiers)
        args += self._tier_flags
        if self._disk_folder is None:
            return args
        taken = {p.disk_folder for p in others}
        k = 0
        while (folder := os.path.join(self._disk_folder, f"{role}-{k}")) in taken:
            k += 1
        return [*args, DISK_DIR_FLAG, folder]

    def _place(self, gpus: Sequence[int], used: dict[int, int]) -> tuple[str, float | None]:
        assert self.max_nodes
        capacity = placement.per_gpu(self.max_nodes, len(gpus))
        gpu = placement.pick_gpu(gpus, used, capacity)
        if gpu is None:
            raise RuntimeError(f"every GPU of {list(gpus)} holds {capacity} nodes already")
        share = self.spec.gpu_memory_utilization or placement.node_share(self.max_nodes, len(gpus))
        return f"cuda:{gpu}", share

    def node_counts(self) -> dict[str, int]:
        """Nodes of each role running or starting (not those draining)."""
        with self._lock:
            self.reap()
            return {
                role: sum(1 for p in self._procs if p.name.startswith(f"{role}-"))
                for role in ("prefill", "decode")
            }

    def add_node(self, role: str) -> str:
        """Start one more ``role`` node (it registers in Redis once ready); returns its name."""
        with self._lock:
            if self.addresses is None or not self.max_nodes:
                raise RuntimeError("add_node needs a started cluster with max_nodes")
            self.reap()
            flags = ["--port", "0", *self._node_flags]
            gpus = self._gpus()
            if gpus is None:
                device, share = self.spec.device, self.spec.gpu_memory_utilization
            else:
                used: dict[int, int] = {}
                for p in self._procs + self._draining:
                    if p.device.startswith("cuda:"):
                        used[int(p.device[5:])] = used.get(int(p.device[5:]), 0) + 1
                device, share = self._place(gpus, used)
            flags += ["--device", device]
            if share is not None:
                flags += ["--gpu-memory-utilization", str(share)]
            metrics_port = None if self.spec.metrics_port is None else 0  # it binds a free one
            index = self._started[role]
            extra = [*flags, *self._tier_args(role, self._procs + self._draining)]
            proc = self._component(role, index, extra, metrics_port)
            proc.disk_folder = _flag_value(extra, DISK_DIR_FLAG)
            proc.device, proc.elastic = device, True
            return proc.name

    def drain_node(self, role: str) -> str | None:
        """SIGTERM the newest ``role`` node: it deregisters, finishes what it accepted and exits
        (the drain of a node); returns its name (None: no such node)."""
        with self._lock:
            nodes = [p for p in self._procs if p.name.startswith(f"{role}-")]
            if not nodes:
                return None
            proc = nodes[-1]
            self._procs.remove(proc)
            proc.drained_at = time.monotonic()
            self._draining.append(proc)
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
            logger.info("draining %s", proc.name)
            return proc.name

    def reap(self) -> None:
        """Forget drained nodes that exited (SIGKILL one past its drain time and the grace), and
        started-at-run-time nodes that died (logged: the planner asks for another)."""
        with self._lock:
            for proc in list(self._draining):
                if (rc := proc.popen.poll()) is not None:
                    logger.info("%s drained (status %s)", proc.name, rc)
                    _kill_leftovers(proc)
                    self._draining.remove(proc)
                elif time.monotonic() - (proc.drained_at or 0.0) > 60.0 + self.spec.stop_grace_s:
                    logger.warning("%s still draining; killing it", proc.name)
                    proc.popen.kill()
            for proc in [p for p in self._procs if p.elastic and p.popen.poll() is not None]:
                logger.warning("%s exited with status %s", proc.name, proc.popen.returncode)
                _kill_leftovers(proc)
                self._procs.remove(proc)

    def pids(self) -> dict[str, int]:
        """Each component's process id, by name (router-0, prefill-0, ..., redis)."""
        return {proc.name: proc.popen.pid for proc in self._procs}

    def poll(self) -> str | None:
        """The name and status of a process that exited by itself, else None."""
        with self._lock:
            self.reap()
            for proc in self._procs:
                if (rc := proc.popen.poll()) is not None:
                    return f"{proc.name} (status {rc})"
            return None

    def stop(self) -> None:
        """SIGTERM each group (router, nodes, Redis), wait, SIGKILL leftovers. Idempotent."""
        with self._lock:
            self._procs += self._draining
            self._draining = []
        groups = [
            [p for p in self._procs if p.name.startswith("router")],
            [p for p in self._procs if p.name.startswith(("prefill", "decode"))],
            [p for p in self._procs if p.name.startswith("kv-store-memory")],
            [p for p in self._procs if p.name in ("kv-store-master", "redis")],
        ]
        for group in groups:
            for proc in group:
                if proc.popen.poll() is None:
                    proc.popen.send_signal(signal.SIGTERM)
            end = time.monotonic() + self.spec.stop_grace_s
            for proc in group:
                if not _exited(proc.popen, max(end - time.monotonic(), 0)):
                    logger.warning("%s ignored SIGTERM; killing it", proc.name)
                    proc.popen.kill()
                    if not _exited(proc.popen, lifeline.KILL_WAIT_S):  # never a wait without an end
                        logger.error("%s (pid %d) outlived SIGKILL", proc.name, proc.popen.pid)
                _kill_leftovers(proc)  # exited: nothing it started outlives it
        self._procs.clear()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_redis_server(
    host: str, log: Path, deadline: float, port: int = 0, **popen_options: Any
) -> tuple[subprocess.Popen, int]:
    """A private ``redis-server`` (no persistence) on ``host:port``, or on a free port for 0;
    returns the process and its port once it answers. ``RuntimeError`` if it exits while
    starting (its output is in ``log``), ``TimeoutError`` past ``deadline`` (it is killed)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server not found: install Redis or pass --redis-url")
    # NOTE: Redis cannot bind a free port itself and say which (its port 0 turns TCP off): a
    # port picked here may be taken before it binds. It then exits, and it is started again on
    # another; until then an answer on that port may come from the other process (the PID in
    # INFO tells).
    for attempt in range(1, 4):
        chosen = port or free_port(host)
        argv = [exe, "--port", str(chosen), "--bind", host, "--save", "", "--appendonly", "no"]
        logger.info("starting redis: %s", " ".join(argv))
        with open(log, "wb") as out:  # the child holds its own descriptor
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, **popen_options)
        while popen.poll() is None:
            if _redis_pid(host, chosen) == popen.pid:
                return popen, chosen
            if time.monotonic() > deadline:
                popen.kill()
                _exited(popen, lifeline.KILL_WAIT_S)  # never a wait without an end
                raise TimeoutError(f"redis-server not answering on {host}:{chosen} (see {log})")
            time.sleep(0.05)
        text = log.read_text(errors="replace")
        if port or "Address already in use" not in text or attempt == 3:
            tail = "\n".join(text.splitlines()[-5:])
            raise RuntimeError(f"redis-server exited with status {popen.returncode}:\n{tail}")
        logger.info("redis: port %d was taken before it bound it; trying another", chosen)
    raise AssertionError("unreachable")


def _redis_pid(host: str, port: int) -> int | None:
    """The process ID of the Redis server answering on ``host:port`` (None: none answers)."""
    reply, found = b"", None
    try:
        with socket.create_connection((host, port), timeout=1) as sock:
            sock.sendall(b"INFO server\r\n")
            while found is None:
                chunk = sock.recv(65536)
                if not chunk or len(reply) > 1 << 16:  # INFO server is about 1 kB
                    return None
                reply += chunk
                found = re.search(rb"process_id:(\d+)\r\n", reply)
    except OSError:
        return None
    return int(found[1])
