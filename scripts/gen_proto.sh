#!/usr/bin/env bash
# Regenerate the Python modules of proto/splitserve/v1/*.proto (never edit them by hand). They are
# written beside their sources and imported as splitserve.v1 (pyproject.toml maps the folder).
# Uses the pinned grpcio-tools of the test extra: stubs from a newer one refuse an older grpcio at
# import. `buf lint proto` (STANDARD rules, proto/buf.yaml) passes on these files.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-proto}
"$PY" -m grpc_tools.protoc -I proto --python_out="$OUT" --grpc_python_out="$OUT" --pyi_out="$OUT" \
    proto/splitserve/v1/common.proto proto/splitserve/v1/router.proto proto/splitserve/v1/nodes.proto
