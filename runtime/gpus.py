"""One GPU per node when several node processes see the same GPUs (``--gpu-lock-dir``).

Docker gives every container that reserves *a number* of GPUs the same first ones (``count: 1``
is GPU 0 for every replica of a scaled service), so scaled node containers reserve all of the
host's GPUs and each node claims one here: it takes an exclusive ``flock`` on a file named after
the GPU in a directory that every node of the host shares, trying the GPUs in order, and holds it
for as long as the process lives (the kernel drops the lock when the process ends, however it
ends). It then computes on that GPU (``cuda:I``) and allocates nothing on the others, which stay
visible so that KV can be copied straight into a peer's pool on another GPU (ipc).

The GPUs tried, in order: the entries of ``CUDA_VISIBLE_DEVICES`` when it is set; else the UUIDs
of the NVIDIA GPUs whose device node this process can see (from the driver's
``/proc/driver/nvidia/gpus``, in PCI bus order); else the UUIDs ``nvidia-smi`` lists.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import socket
import subprocess
from collections.abc import MutableMapping
from pathlib import Path

import splitserve.settings as settings

logger = logging.getLogger(__name__)

PROC_GPUS = Path("/proc/driver/nvidia/gpus")
DEV = Path("/dev")

_held: list[int] = []  # descriptors of the locks this process holds (open until it exits)


def held_locks() -> tuple[int, ...]:
    """The lock descriptors this process holds (its engine process inherits them)."""
    return tuple(_held)


def inherit_locks(fds: str) -> None:
    """Count the lock descriptors a parent passed down (``3,4``) as this process's own, so its
    children (tensor-parallel ranks) inherit them in turn; ones not open here are skipped."""
    for text in fds.split(","):
        if text.strip().isdigit():
            fd = int(text)
            try:
                os.fstat(fd)
            except OSError:
                continue
            _held.append(fd)


class GpuClaimError(RuntimeError):
    """No GPU could be claimed (none visible, all held by other nodes, lock dir unusable)."""


def _proc_gpus(proc_dir: Path, dev_dir: Path) -> list[str]:
    """UUIDs of the GPUs the driver lists whose /dev/nvidiaN node exists here (bus order)."""
    gpus = []
    try:
        entries = sorted(p for p in proc_dir.iterdir() if p.is_dir())
    except OSError:
        return []
    for entry in entries:
        fields = {}
        try:
            for line in (entry / "information").read_text().splitlines():
                key, sep, value = line.partition(":")
                if sep:
                    fields[key.strip()] = value.strip()
        except OSError:
            continue
        uuid, minor = fields.get("GPU UUID", ""), fields.get("Device Minor", "")
        if uuid and minor.isdigit() and (dev_dir / f"nvidia{minor}").exists():
            gpus.append(uuid)
    return gpus


def _nvidia_smi_gpus() -> list[str]:
    try:
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    if proc.returncode != 0:
        return []
    return [line.strip() for line in proc.stdout.splitlines() if line.strip()]


def visible_gpus(
    environ: MutableMapping[str, str] | None = None,
    proc_dir: Path = PROC_GPUS,
    dev_dir: Path = DEV,
) -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries, in the order tried."""
    if given := settings.CUDA_VISIBLE_DEVICES.raw(environ):
        return [g.strip() for g in given.split(",") if g.strip()]
    return _proc_gpus(proc_dir, dev_dir) or _nvidia_smi_gpus()


def _lock_name(gpu: str) -> str:
    return "gpu-" + re.sub(r"[^A-Za-z0-9._-]", "_", gpu) + ".lock"


def claim_gpu(lock_dir: str | Path, gpus: list[str]) -> tuple[str, int]:
    """Lock the first of ``gpus`` that no other process holds; return it and the lock's
    descriptor (the lock lasts until that descriptor is closed or the process ends)."""
    lock_dir = Path(lock_dir)
    if not gpus:
        raise GpuClaimError(
            "no NVIDIA GPU is visible to this process (give the container GPUs, or run the "
            "node with --device cpu)"
        )
    try:
        lock_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GpuClaimError(f"cannot create the GPU lock directory {lock_dir}: {exc}") from exc
    for gpu in gpus:
        path = lock_dir / _lock_name(gpu)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise GpuClaimError(f"cannot open the GPU lock {path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        return gpu, fd
    raise GpuClaimError(
        f"all {len(gpus)} GPUs visible here are held by other nodes (locks in {lock_dir}): "
        "run fewer node replicas than GPUs on this host"
    )


def claim_for_node(
    device: str,
    lock_dir: str | None,
    environ: MutableMapping[str, str] | None = None,
    count: int = 1,
) -> str | None:
    """With a lock directory and ``device == "cuda"``: claim a GPU of its own for this process and
    return the device to compute on, ``cuda:I``. Every GPU stays visible — a prefill node maps a
    decode node's pool on another GPU of the host (ipc: a peer copy over NVLink/PCIe) — in the
    order tried, pinned in ``CUDA_VISIBLE_DEVICES`` before CUDA starts, so that index I is the
    claimed GPU whatever CUDA's own device order. Else claim nothing and return None (an explicit
    ``cuda:N`` or ``cpu`` is used as given)."""
    if not lock_dir or device != "cuda":
        return None
    gpus = visible_gpus(environ)
    if count > 1:
        return _claim_several(lock_dir, gpus, count, environ)
    gpu, fd = claim_gpu(lock_dir, gpus)
    _held.append(fd)
    settings.CUDA_VISIBLE_DEVICES.put(",".join(gpus), environ)
    index = gpus.index(gpu)
    logger.info("claimed GPU %s (lock in %s): computing on cuda:%d of %s", gpu, lock_dir, index,
                ",".join(gpus))  # fmt: skip
    return f"cuda:{index}"


def _claim_several(
    lock_dir: str, gpus: list[str], count: int, environ: MutableMapping[str, str] | None
) -> str:
    """A tensor-parallel node's ``count`` GPUs: claimed one by one (all or none), then put first
    in ``CUDA_VISIBLE_DEVICES`` so its ranks compute on cuda:0..count-1 (the rest stay visible,
    after them, for ipc peers)."""
    claimed: list[tuple[str, int]] = []
    try:
        for _ in range(count):
            left = [g for g in gpus if g not in {c for c, _ in claimed}]
            claimed.append(claim_gpu(lock_dir, left))
    except GpuClaimError as exc:
        for _, fd in claimed:
            os.close(fd)
        raise GpuClaimError(
            f"a node at tensor parallel size {count} needs {count} GPUs of its own: {exc}"
        ) from None
    _held.extend(fd for _, fd in claimed)
    mine = [g for g, _ in claimed]
    settings.CUDA_VISIBLE_DEVICES.put(",".join(mine + [g for g in gpus if g not in mine]), environ)
    logger.info("claimed GPUs %s (locks in %s): ranks on cuda:0..%d", mine, lock_dir, count - 1)
    return "cuda:0"
