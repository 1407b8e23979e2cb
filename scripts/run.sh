#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then runs the main job.
# Until the router/prefill/decode pipeline lands, that is the part that runs today: the model
# runner generating with the embedded tiny model (created on first use under ~/.cache/splitserve),
# the KV cache manager driven by chat-like traffic, and the kvstore benchmark.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
.venv/bin/splitserve generate "The quick brown fox" "Paged attention" --max-tokens 24
echo
.venv/bin/splitserve kv-demo
echo
.venv/bin/python benchmarks/kvstore.py
