import os

# Triton kernels run under the interpreter (on CPU tensors) where there is no GPU, e.g. in CI.
# Triton reads this when a kernel is *defined*, so it must be set before any test imports
# `kernels`. Harmless for CPU-only code: no Triton kernel launches on CPU tensors otherwise.
# tests/gpu/ are exempt: their conftest imports compiled copies of the kernel modules for them,
# whatever this says (one variable cannot serve both kinds in one process).
os.environ.setdefault("TRITON_INTERPRET", "1")
