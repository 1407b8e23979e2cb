#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then lints and runs the whole test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k kvstore -x`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest "$@"
