"""The suite's shared setup, for every folder of tests/:

- ``tests/unit/``: no processes, no sockets (``scripts/test.sh --fast`` runs this folder alone);
- ``tests/cluster/``: real processes, loopback gRPC and HTTP servers, Redis;
- ``tests/gpu/``: needs a CUDA GPU (each test has a CPU counterpart elsewhere);
- ``tests/containers/``: builds the image and runs the compose files (podman).

Each test gets the marker of its folder (``unit``, ``cluster``, ``gpu``, ``containers``), so
``pytest -m unit`` or ``pytest -m "not cluster"`` select by layer as well as by path. The helpers
the tests share are the ``support`` package (tests/support/), importable because this file's
folder is on ``sys.path`` (pytest's default ``prepend`` import mode puts it there).
"""

import os
from pathlib import Path

import torch

# Triton chooses interpreter or compiler when a kernel is *defined* (its module imported), from
# TRITON_INTERPRET at that moment, once per process: so the suite picks one before any test
# imports `kernels`. Where there is no GPU (CI): the interpreter, on CPU tensors
# (tests/test_kernels_triton.py, test_kernels_elementwise.py). Where CUDA is present: compiled,
# so tests/gpu run the real kernels whether started alone or with the whole suite; the
# interpreter tests then skip (tests/gpu cover the same kernels compiled). An explicit
# TRITON_INTERPRET wins either way.
if "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"

# grpcio's C core registers fork handlers by default, and they can deadlock a fork made while
# its threads are busy (e.g. grpc/grpc#22624): the test process forks with channels open whenever it
# starts a process with a preexec_fn (splitserve.launcher.LocalCluster does), and one such fork
# hung a whole run (no timeout can interrupt it). Every child of the suite execs at once and no
# process here uses gRPC across a fork, so the handlers serve nothing; children inherit the
# setting (`splitserve up` forks likewise).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

LAYERS = {
    "unit": "no processes, no sockets (tests/unit/)",
    "cluster": "real processes, loopback servers or Redis (tests/cluster/)",
    "containers": "builds the image and runs the compose files (tests/containers/)",
}
_HERE = Path(__file__).resolve().parent


def pytest_configure(config):
    for name, meaning in LAYERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        try:
            folder = Path(str(item.fspath)).resolve().relative_to(_HERE).parts[0]
        except ValueError:
            continue
        if folder in LAYERS or folder == "gpu":
            item.add_marker(getattr(pytest.mark, folder))
