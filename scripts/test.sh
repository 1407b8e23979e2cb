#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then lints, checks types and runs the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k kvstore -x`.
# `bash scripts/test.sh --fast [pytest args]`: the inner loop, in the environment setup.sh made
# before (it is not re-run): ruff, then tests/unit only (no processes, no sockets; about a minute
# on 2 cores). The layers are described in tests/conftest.py.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# Python puts the working directory first on sys.path for `python -m`: the checkout's top-level
# folders (kernels/, models/, ...) would then shadow installed packages of the same name (e.g.
# the `kernels` package transformers >= 5.25 imports). Off here and in every child process.
export PYTHONSAFEPATH=1
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
.venv/bin/python -m pytest "$@"
