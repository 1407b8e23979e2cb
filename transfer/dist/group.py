"""The dist path's pair groups: backend choice, process-wide backend settings, the two-rank group
built on a store, and the rendezvous store's addresses. Protocol: ``transfer.dist``."""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any

import torch

import splitserve.settings as settings
from splitserve.transfer.endpoint import BACKEND_FOR_DEVICE

# One logger for the whole dist path (its modules were one), so log settings keep applying.
logger = logging.getLogger("splitserve.transfer.dist")

KEY = "splitserve/kv"  # prefix of every rendezvous key in a receiver's store
POLL_S = 0.05


def default_backend(device: torch.device | str) -> str:
    kind = torch.device(device).type
    if kind not in BACKEND_FOR_DEVICE:
        raise ValueError(f"no dist backend for a pool on {device}")
    return BACKEND_FOR_DEVICE[kind]


def check_backend(backend: str, kv_pool: torch.Tensor) -> None:
    if backend != default_backend(kv_pool.device):
        raise ValueError(
            f"backend {backend!r} cannot move a pool on {kv_pool.device} "
            f"(use {default_backend(kv_pool.device)!r})"
        )


def prepare_backend(backend: str) -> None:
    """Process-wide settings a backend needs before its first group; call at startup.

    NCCL: ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` defaults to 3, which tears the whole process down
    when a communicator fails (e.g. a peer dies mid-transfer); a serving node must survive that,
    so unless it is set this makes it 2 (abort the communicator, surface the error to the wait).
    ProcessGroupNCCL reads it when a group is constructed.
    """
    if backend == "nccl":
        value = settings.TORCH_NCCL_ASYNC_ERROR_HANDLING.set_default("2")
        if value not in ("0", "2"):
            logger.warning(
                "TORCH_NCCL_ASYNC_ERROR_HANDLING=%s: a peer failing mid-transfer will take this "
                "process down (2 keeps it alive)",
                value,
            )


def make_pair_group(
    store: Any, rank: int, backend: str, timeout_s: float, host: str | None = None
) -> Any:
    """A two-rank torch.distributed backend on ``store`` (give each pair its own
    ``PrefixStore``); rank 0 is the receiver. Gloo connects both ranks here (blocks until the
    other side constructs its group or ``timeout_s`` passes); NCCL connects at the first op.
    ``host``: the local address gloo binds and advertises (default: the hostname's)."""
    return make_group(store, rank, 2, backend, timeout_s, host)


def make_group(
    store: Any, rank: int, size: int, backend: str, timeout_s: float, host: str | None = None
) -> Any:
    """A ``size``-rank torch.distributed backend on ``store`` (see ``make_pair_group``)."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        opts = ProcessGroupGloo._Options()  # pyright: ignore[reportAttributeAccessIssue] (not in the stubs)
        opts._timeout = timeout
        device = (
            ProcessGroupGloo.create_device(hostname=host)
            if host
            else ProcessGroupGloo.create_default_device()
        )
        opts._devices = [device]
        return ProcessGroupGloo(store, rank, size, opts)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        prepare_backend("nccl")
        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(store, rank, size, opts)
    raise ValueError(f"unsupported backend {backend!r}")


def local_address_towards(host: str, port: int) -> str:
    """The local IP address this host uses to reach ``host`` (no packet is sent)."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def default_host() -> str:
    """An address of this host that other hosts can reach (the one of the default route)."""
    for probe in ("10.255.255.255", "192.0.2.1"):
        address = local_address_towards(probe, 1)
        if not address.startswith("127."):
            return address
    return "127.0.0.1"


def loopback_store(timeout_s: float) -> tuple[Any, int]:
    """A rendezvous ``TCPStore`` that listens on 127.0.0.1 only, and its port. NOTE: given a
    port, TCPStore listens on every interface whatever host it is told; handed a socket already
    bound to loopback (``master_listen_fd``), it listens there alone."""
    from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage] (not re-exported in the stubs)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = int(sock.getsockname()[1])
        store = TCPStore(
            "127.0.0.1",
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=sock.fileno(),
        )
    except Exception:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now
    return store, port


def store_client(host: str, port: int, timeout_s: float) -> Any:
    """A client of the receiver's rendezvous ``TCPStore`` at ``host:port``."""
    from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage] (not re-exported in the stubs)

    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
