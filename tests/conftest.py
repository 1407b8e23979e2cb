"""The suite's shared setup, for every folder of tests/:

- ``tests/unit/``: no processes, no sockets (``scripts/test.sh --fast`` runs this folder alone);
- ``tests/cluster/``: real processes, loopback gRPC and HTTP servers, Redis (and the few
  in-process checks too slow for the unit loop, marked ``slow``);
- ``tests/gpu/``: needs a CUDA GPU (each test has a CPU counterpart elsewhere);
- ``tests/containers/``: builds the image and runs the compose files (podman).

Each test gets the marker of its folder (``unit``, ``cluster``, ``gpu``, ``containers``), so
``pytest -m unit`` or ``pytest -m "not cluster"`` select by layer as well as by path. The helpers
the tests share are the ``support`` package (tests/support/), importable because this file's
folder is on ``sys.path`` (pytest's default ``prepend`` import mode puts it there).

Random draws are seeded. A run picks one seed, ``SPLITSERVE_TEST_SEED`` when set, else a fresh one
(pytest's header prints it). Before each test's setup, ``random``, ``numpy.random`` and ``torch``
are seeded with it (so fixtures, also those a module shares, draw the same whichever test sets them
up first); before the test itself, with a seed of its own, derived from the run's and the test's
id (so parametrized trials differ). The ``rng`` fixture is a ``random.Random`` with that seed;
Hypothesis draws from the run's seed as well (``--hypothesis-seed`` unless given). A
failing test's report has a "random seed" section with the line that repeats it, e.g.:

    SPLITSERVE_TEST_SEED=1234 .venv/bin/python -m pytest 'tests/unit/test_scheduler.py::test_x'
"""

import hashlib
import os
import random
import sys
from pathlib import Path

# `python -m pytest` (unlike the `pytest` script, or python -P) puts the working directory first
# on sys.path: from the checkout, its top-level folders (kernels/, router/, models/, ...) would
# then shadow installed packages of those names, as our kernels/ did transformers' `kernels`
# (the hub kernels package: "cannot import name 'CUDAProperties' from 'kernels'"). They are the
# installed package's splitserve.kernels, splitserve.router, ...: the checkout itself is never
# an import root, so it leaves sys.path before anything below imports.
_CHECKOUT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _CHECKOUT]
os.environ.setdefault("PYTHONSAFEPATH", "1")  # and so for the processes the tests start

import numpy  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Triton chooses interpreter or compiler when a kernel is *defined* (its module imported), from
# TRITON_INTERPRET at that moment, once per process: so the suite picks one before any test
# imports `kernels`. Where there is no GPU (CI): the interpreter, on CPU tensors
# (tests/unit/test_kernels_triton.py, test_kernels_elementwise.py). Where CUDA is present: compiled,
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

# Every router the tests start serves every request it is sent. Past --max-loop-lag-s (0.5 s by
# default) a router refuses new requests (RESOURCE_EXHAUSTED, router_busy) while its event loop
# runs late, and on the 2-core machine, two workers' clusters at once, a loop can lag that long
# (a CI run, 2026-12-05: test_direct_route refused at 505 ms). That refusal answers the machine's
# load, not the code under test; tests/unit/test_loop_lag.py tests it with explicit thresholds. A
# test may still pass --max-loop-lag-s (the flag wins over the variable).
os.environ.setdefault("SPLITSERVE_MAX_LOOP_LAG_S", "0")

LAYERS = {
    "unit": "no processes, no sockets (tests/unit/)",
    "cluster": "real processes, loopback servers or Redis (tests/cluster/)",
    "containers": "builds the image and runs the compose files (tests/containers/)",
}
_HERE = Path(__file__).resolve().parent


SEED_VARIABLE = "SPLITSERVE_TEST_SEED"
RUN_SEED = int(os.environ.get(SEED_VARIABLE) or random.SystemRandom().randrange(2**32))
# One seed for the whole run: pytest-xdist's workers (scripts/test.sh starts them) inherit it.
os.environ[SEED_VARIABLE] = str(RUN_SEED)


def test_seed(nodeid: str) -> int:
    """The seed a test's own draws start from: the run's seed and the test's id, hashed."""
    digest = hashlib.blake2b(f"{RUN_SEED}:{nodeid}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big")


test_seed.__test__ = False  # a helper, not a test


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


# Hypothesis: no deadline and no too-slow health check in any test (a test's own @settings may
# set others). Its 200 ms default deadline and its data-generation timing measure the machine,
# and on the 2-core machine, beside two workers' clusters, they fail tests whose properties hold.
settings.register_profile(
    "splitserve", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile("splitserve")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    for name, meaning in LAYERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")
    _seed_everything(RUN_SEED)  # what test modules draw when they are imported
    # Hypothesis draws from the run's seed too, unless --hypothesis-seed says otherwise (read by
    # its plugin's pytest_configure, which runs after this one).
    if config.getoption("hypothesis_seed", default=None) is None:
        config.option.hypothesis_seed = str(RUN_SEED)


def pytest_report_header(config):
    return f"random seed: {SEED_VARIABLE}={RUN_SEED} repeats this run's draws"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _seed_everything(RUN_SEED)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    _seed_everything(test_seed(item.nodeid))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(
            (
                "random seed",
                f"this test drew from seed {test_seed(item.nodeid)} (run seed {RUN_SEED}); "
                f"repeat it with:\n{SEED_VARIABLE}={RUN_SEED} .venv/bin/python -m pytest "
                f"'{item.nodeid}'",
            )
        )


@pytest.fixture
def rng(request) -> random.Random:
    """A ``random.Random`` seeded with this test's seed (see the module's docstring)."""
    return random.Random(test_seed(request.node.nodeid))


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            folder = Path(str(item.fspath)).resolve().relative_to(_HERE).parts[0]
        except ValueError:
            continue
        if folder in LAYERS or folder == "gpu":
            item.add_marker(getattr(pytest.mark, folder))
