#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then runs the main job.
# Until the router/prefill/decode pipeline lands, that is the part that runs today: the KV cache
# manager driven by chat-like traffic (prefix-cache hits, evictions) and the kvstore benchmark.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
.venv/bin/splitserve kv-demo "$@"
echo
.venv/bin/python benchmarks/kvstore.py
