"""tests/gpu run the *compiled* Triton kernels, whatever TRITON_INTERPRET the rest of the suite
uses, in a session of their own or mixed with the CPU tests.

Why modules are swapped rather than the variable set: Triton chooses interpreter or compiler
when a kernel is decorated, i.e. when its module is imported, from TRITON_INTERPRET at that
moment, and a module is imported once per process. tests/conftest.py defaults the variable to 1
for the CPU interpreter tests (tests/test_kernels_triton.py, test_kernels_elementwise.py), so
setting 0 here would either come too late (kernels already imported) or turn those tests off.
Instead each Triton module of ``splitserve.kernels`` exists twice in a session: the one the rest
of the suite imports, and a compiled copy imported here under TRITON_INTERPRET=0. The compiled
copies are installed (``sys.modules`` and the ``splitserve.kernels`` package attributes, which
``from splitserve.kernels import x`` and ``kernels.ops``'s lazy imports read) while a tests/gpu
module is imported and while its tests run, with TRITON_INTERPRET=0 in the environment (Triton
also reads it when it compiles a launch); afterwards the previous modules and value come back.

On a CPU machine the swap happens too (decorating a kernel needs no GPU), the gpu-marked tests
skip for want of CUDA, and tests/gpu/test_compiled_mode.py checks the swap itself.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pathlib
import sys
from types import ModuleType

import pytest

# Every splitserve.kernels module that defines a Triton kernel (test_compiled_mode.py checks the
# list against the sources).
TRITON_MODULES = tuple(
    f"splitserve.kernels.{name}"
    for name in ("cache_write", "decode_attention", "elementwise", "prefill_attention")
)
_HERE = pathlib.Path(__file__).resolve().parent
_compiled: dict[str, ModuleType] = {}  # imported once, reused: one Triton compile cache


def _set_kernel_module(name: str, module: ModuleType | None) -> None:
    """Make ``name`` resolve to ``module`` (None: unimported) for both kinds of import."""
    package = sys.modules["splitserve.kernels"]
    attr = name.rsplit(".", 1)[1]
    if module is None:
        sys.modules.pop(name, None)
        if hasattr(package, attr):
            delattr(package, attr)
    else:
        sys.modules[name] = module
        setattr(package, attr, module)


@contextlib.contextmanager
def compiled_kernels():
    """Within: the compiled kernel modules and TRITON_INTERPRET=0; afterwards, what was before."""
    importlib.import_module("splitserve.kernels")
    saved_env = os.environ.get("TRITON_INTERPRET")
    saved = {name: sys.modules.get(name) for name in TRITON_MODULES}
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        if not _compiled:
            for name in TRITON_MODULES:  # all unimported first: they may import each other
                _set_kernel_module(name, None)
            _compiled.update({name: importlib.import_module(name) for name in TRITON_MODULES})
        for name, module in _compiled.items():
            _set_kernel_module(name, module)
        yield
    finally:
        for name, module in saved.items():
            _set_kernel_module(name, module)
        if saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_env


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    # A test module binds the kernels it imports at collection, so import it among the compiled
    # copies (module-level skipif conditions see TRITON_INTERPRET=0 too).
    if isinstance(collector, pytest.Module) and _HERE in collector.path.resolve().parents:
        with compiled_kernels():
            return (yield)
    return (yield)


@pytest.fixture(scope="module", autouse=True)
def _compiled_kernels_while_running():
    """Module scope: set up before the modules' own fixtures (a model built in one launches
    kernels through ``kernels.ops``, which imports them when first called)."""
    with compiled_kernels():
        yield


@pytest.fixture
def triton_kernel_modules() -> tuple[str, ...]:
    return TRITON_MODULES
