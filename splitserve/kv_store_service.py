"""A Mooncake Store for the nodes' shared KV tier: its master and one process holding its memory.

``splitserve kv-store`` runs both in the foreground (compose's ``kv-store`` service, the
Kubernetes Deployment); ``splitserve up --kv-store embedded`` starts them beside its Redis, bound
to loopback. Nodes reach them as ``--kv-store mooncake://HOST:PORT`` (engine.kv_store).

Mooncake Store has no authentication: whoever reaches the master and the memory holder reads and
writes every block (docs/security.md). Its binaries bind every interface unless told otherwise;
everything started here is told ``host``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve.cluster_spec import free_port
from splitserve.engine import lifeline

logger = logging.getLogger(__name__)

READY = {"mooncake_master": "Master service started", "mooncake_client": "Starting real client"}


def mooncake_binary(name: str) -> str:
    """The path of ``name`` (mooncake_master, mooncake_client) from the installed wheel."""
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(
            f"{name} not found: pip install 'splitserve[mooncake]' (and Debian's libibverbs1)"
        )
    return found


@dataclass
class StoreProcesses:
    url: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def stop(self, timeout: float = 5.0) -> None:
        for proc in reversed(self.procs):  # the memory holder first, then the master
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout)


def start_store(
    host: str,
    memory_mb: int,
    workdir: Path,
    deadline: float,
    port: int = 0,
    metadata_port: int = 0,
    **popen_options: Any,
) -> StoreProcesses:
    """Start a master on ``host:port`` (with its HTTP metadata server on ``metadata_port``; 0:
    free ports) and a process lending the store ``memory_mb`` MiB; return once both serve.
    ``RuntimeError`` if one exits while starting, ``TimeoutError`` past ``deadline``. Both end
    with this process however it ends (unless ``popen_options`` gives a ``preexec_fn``)."""
    popen_options.setdefault("preexec_fn", lifeline.term_with_parent)
    port = port or free_port(host)
    metadata_port = metadata_port or free_port(host)
    metadata = f"http://{host}:{metadata_port}/metadata"
    started = StoreProcesses(f"mooncake://{host}:{port}?metadata={metadata}")
    master = [
        mooncake_binary("mooncake_master"),
        f"--rpc_address={host}",
        f"--rpc_port={port}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={host}",
        f"--http_metadata_server_port={metadata_port}",
        f"--metrics_host={host}",
        f"--metrics_port={free_port(host)}",
        "--logtostderr=true",
    ]
    holder = [
        mooncake_binary("mooncake_client"),
        f"--host={host}",
        f"--port={free_port(host)}",
        f"--global_segment_size={memory_mb} MB",
        "--local_buffer_size=16 MB",
        f"--master_server_address={host}:{port}",
        f"--metadata_server={metadata}",
        "--protocol=tcp",
        "--logtostderr=true",
    ]
    try:
        for argv in (master, holder):
            name = Path(argv[0]).name
            log = workdir / f"{name}.log"
            logger.info("starting %s: %s", name, " ".join(argv))
            with open(log, "wb") as out:  # the child holds its own descriptor (its INFO lines
                # say when it is ready)
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, **popen_options)
            started.procs.append(proc)
            _wait_for(proc, log, READY[name], deadline)
    except BaseException:
        started.stop()
        raise
    return started


def _wait_for(proc: subprocess.Popen, log: Path, line: str, deadline: float) -> None:
    while line not in log.read_text(errors="replace"):
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-8:])
            raise RuntimeError(f"{log.stem} exited with status {proc.returncode}:\n{tail}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{log.stem} not ready (see {log})")
        time.sleep(0.05)


def default_store_mb() -> int:
    """A default size for an embedded store: an eighth of the memory available now, at most
    4 GiB (the host tier takes a quarter)."""
    from splitserve.runtime.config import auto_host_cache_mb

    return max(64, min(4096, auto_host_cache_mb(2)))
