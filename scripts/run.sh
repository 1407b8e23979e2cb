#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then runs the main job: a local splitserve cluster
# (Redis, a prefill node, a decode node and the router as separate processes, serving the default
# model SmolLM2-135M-Instruct), a few chat questions through the SDK and the OpenAI HTTP API
# printed with their answers and usage figures, and shutdown. The components log to a file (-v: to
# the terminal).
# Extra arguments go to examples/quickstart.py (e.g. --model DIR|FILE.gguf|tiny --num-decode 2).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
.venv/bin/python examples/quickstart.py "$@"
