#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then lints, checks types and runs the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k kvstore -x`.
# `bash scripts/test.sh --fast [pytest args]`: the inner loop, in the environment setup.sh made
# before (it is not re-run): ruff, then tests/unit only (no processes, no sockets; about a minute
# on 2 cores). The layers are described in tests/conftest.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# (`python -m pytest` from the checkout needs nothing set: tests/conftest.py keeps the checkout's
# top-level folders from shadowing installed packages, for the tests and the processes they start.)
if [[ "${1:-}" == "--fast" ]]; then
    shift
    .venv/bin/ruff check .
    .venv/bin/ruff format --check .
    exec .venv/bin/python -m pytest -q tests/unit "$@"
fi
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# Types: pyright's basic mode over the package, 0 errors ([tool.pyright] in pyproject.toml).
.venv/bin/pyright
# The suite on a worker per core, at most 4 (SPLITSERVE_TEST_WORKERS sets how many; 0: none, in
# this process): each worker takes whole files (--dist loadfile), so a module's shared cluster is
# started once. Most of a cluster test's time is one process waiting on another (a node's start
# is mostly single-threaded imports): on 2 cores, two workers take ~35% off the wall time.
# The slowest tests, in every full run's log (what to make quicker first).
workers=${SPLITSERVE_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
.venv/bin/python -m pytest -n "$workers" --dist loadfile --durations=25 "$@"
