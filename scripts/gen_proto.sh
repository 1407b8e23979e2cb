#!/usr/bin/env bash
# Regenerate the Python modules of proto/*.proto (never edit them by hand). Uses the pinned
# grpcio-tools of the test extra: stubs from a newer one refuse an older grpcio at import.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-.}
"$PY" -m grpc_tools.protoc -I. --python_out="$OUT" --grpc_python_out="$OUT" --pyi_out="$OUT" \
    proto/common.proto proto/router.proto proto/nodes.proto
