import os

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
