#!/usr/bin/env bash
# Builds splitserve's CPU image with podman and no image registry:
#   1. a Debian bookworm base made by debootstrap (python3, python3-venv, redis-server and
#      libibverbs1), imported as splitserve-base:bookworm — rebuilt only when this script changes;
#   2. the Dockerfile on that base (BASE_IMAGE), torch's CPU build from a folder of wheels when
#      one is given (else from the index pip is configured with) — rebuilt only when the tracked
#      files change.
# Untagged images this script built before are removed (each build replaces the last).
# Needs root (debootstrap), podman, runc and debootstrap (Debian: apt-get install podman runc
# debootstrap). Usage: scripts/build_cpu_image.sh [IMAGE]   (default: splitserve:cpu)
# Environment: SPLITSERVE_TORCH_WHEELS (default: $PIP_FIND_LINKS), a folder with the torch CPU
# wheel; SPLITSERVE_TORCH (default torch==2.13.0); PIP_CERT (default: the host's CA bundle).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
IMAGE=${1:-splitserve:cpu}
BASE=splitserve-base:bookworm
export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/scripts/containers.conf}
log() { printf '[build_cpu_image] %s\n' "$*" >&2; }
label() { podman image inspect --format "{{index .Labels \"$2\"}}" "$1" 2>/dev/null || true; }

base_key=$(sha256sum scripts/build_cpu_image.sh | cut -c1-16)
if [ "$(label "$BASE" splitserve.base-key)" != "$base_key" ]; then
    rootfs=$(mktemp -d)
    trap 'rm -rf "$rootfs"' EXIT
    log "debootstrap bookworm into $rootfs"
    debootstrap --variant=minbase \
        --include=python3,python3-venv,ca-certificates,redis-server,libibverbs1 \
        bookworm "$rootfs" >/dev/null
    tar -C "$rootfs" -c . | podman import --change "LABEL splitserve.base-key=$base_key" - "$BASE"
    rm -rf "$rootfs"
fi

# Everything the image is built from: every file git tracks or would (not the ignored ones), as it
# is in the working tree, but for the folders .dockerignore keeps out of the image; and the inputs.
source_key=$( (git ls-files -co --exclude-standard | grep -vE '^(tests|benchmarks|examples|docs)/' \
    | tr '\n' '\0' | xargs -0 sha256sum; echo "$base_key ${SPLITSERVE_TORCH:-}") \
    | sha256sum | cut -c1-16)
if [ "$(label "$IMAGE" splitserve.source-key)" = "$source_key" ]; then
    log "$IMAGE is up to date ($source_key)"
    exit 0
fi
args=(--format docker --network host --build-arg "BASE_IMAGE=localhost/$BASE"
      --label "splitserve.source-key=$source_key" -t "$IMAGE")
if [ -n "${SPLITSERVE_TORCH:-}" ]; then args+=(--build-arg "TORCH_SPEC=$SPLITSERVE_TORCH"); fi
wheels=${SPLITSERVE_TORCH_WHEELS:-${PIP_FIND_LINKS:-}}
if [ -n "$wheels" ] && [ -d "$wheels" ]; then
    args+=(-v "$(realpath "$wheels"):/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels)
fi
cert=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
if [ -f "$cert" ]; then  # the host's view of TLS (a proxy's CA, say) for pip inside the build
    args+=(-v "$(realpath "$cert"):/etc/ssl/host-ca.crt:ro" --build-arg PIP_CERT=/etc/ssl/host-ca.crt)
fi
# Each build leaves the image it replaces untagged (about 3 GB, most of it torch): remove those,
# and what a failed build left, or a machine that builds on every change fills its disk.
prune() { podman image prune -f --filter label=splitserve.source-key >/dev/null; }
prune
log "building $IMAGE on $BASE"
podman build "${args[@]}" .
prune
