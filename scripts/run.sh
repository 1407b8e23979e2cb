#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then runs the main job: a local splitserve cluster
# (Redis, a prefill node, a decode node and the router as separate processes, serving the embedded
# tiny model), a few requests through the SDK printed with their usage figures, and shutdown.
# Extra arguments go to examples/quickstart.py (e.g. --model DIR --num-decode 2).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
.venv/bin/python examples/quickstart.py "$@"
