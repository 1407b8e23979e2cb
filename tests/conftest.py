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
