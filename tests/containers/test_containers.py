"""The container deployment, built and run for real: the CPU image (scripts/build_cpu_image.sh,
no image registry) and compose.cpu.yaml under podman-compose — Redis, the router, 2 prefill and 2
decode containers on the host's loopback, each under its own host name.

Requests from the SDK on the host through the router are token-exact with the in-process engine;
a third decode container added at run time receives transfers within seconds; a decode container
stopped (SIGTERM) while requests stream drains and exits 0 with no request failed; `down` leaves
nothing running. The KV of every request goes by gloo (`dist`): the containers share the host's
kernel and loopback, so no transfer falls back to bytes (read from the decode nodes' counters).

Skipped, with the reason, where podman cannot run containers here (not root, no podman/runc/
debootstrap, no podman-compose). scripts/setup.sh installs them on a Debian machine as root.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from support.processes import Traffic

from splitserve.client import Client, SplitserveError
from splitserve.launcher import free_port
from splitserve.router.api_keys import write_api_key_file
from splitserve.runtime.auth import metadata_for, write_token_file
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "splitserve:cpu"
GREEDY = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
COMPOSE = [sys.executable, "-m", "podman_compose", "-f", str(ROOT / "compose.cpu.yaml")]


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "building the base with debootstrap and running podman here needs root"
    missing = [t for t in ("podman", "runc", "debootstrap") if shutil.which(t) is None]
    if missing:
        return (
            f"{', '.join(missing)} not installed (Debian: apt-get install podman runc debootstrap)"
        )
    try:
        import podman_compose  # noqa: F401
    except ImportError:
        return "podman-compose is not installed (pip install podman-compose)"
    env = {**os.environ, "CONTAINERS_CONF": str(ROOT / "scripts/containers.conf")}
    try:
        info = subprocess.run(
            ["podman", "info"], capture_output=True, text=True, env=env, timeout=60
        )
    except subprocess.TimeoutExpired:
        return "podman info did not answer within 60 s"
    if info.returncode != 0:
        return f"podman cannot run here: {info.stderr.strip()[-300:]}"
    return None


IMAGE_GID = 10001  # the group of the image's user (Dockerfile)
pytestmark = [pytest.mark.slow]
if (_reason := _why_not()) is not None:
    pytestmark.append(pytest.mark.skip(reason=_reason))


class Deployment:
    def __init__(self, project: str) -> None:
        self.project = project
        self.router_port, self.redis_port = free_port(), free_port()
        self.http_port = free_port()
        # The cluster token and the HTTP API's key compose.cpu.yaml mounts as secrets.
        secrets = Path(tempfile.mkdtemp(prefix="sstest-secrets-"))
        self.token = write_token_file(secrets / "cluster-token")
        self.api_key = write_api_key_file(secrets / "api-keys")
        for name in (
            "cluster-token",
            "api-keys",
        ):  # readable by the image's group, as deploy.md says
            os.chown(secrets / name, -1, IMAGE_GID)
            os.chmod(secrets / name, 0o640)
        self.env = {
            **os.environ,
            "CONTAINERS_CONF": str(ROOT / "scripts/containers.conf"),
            "SPLITSERVE_ROUTER_PORT": str(self.router_port),
            "SPLITSERVE_REDIS_PORT": str(self.redis_port),
            "SPLITSERVE_ROUTER_HTTP_PORT": str(self.http_port),
            "SPLITSERVE_TOKEN_PATH": str(secrets / "cluster-token"),
            "SPLITSERVE_API_KEYS_PATH": str(secrets / "api-keys"),
            "SPLITSERVE_NUM_PREFILL": "2",
            "SPLITSERVE_NUM_DECODE": "2",
            "SPLITSERVE_MODEL": "tiny",  # the reference below runs the same random model
            "SPLITSERVE_DRAIN_TIMEOUT_S": "30",
        }
        self.router = f"127.0.0.1:{self.router_port}"

    def compose(self, *args: str, timeout: float = 300) -> str:
        out = subprocess.run(
            [*COMPOSE, "-p", self.project, *args],
            capture_output=True, text=True, env=self.env, timeout=timeout, cwd=ROOT,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        return out.stdout

    def podman(self, *args: str, timeout: float = 120) -> str:
        out = subprocess.run(
            ["podman", *args], capture_output=True, text=True, env=self.env, timeout=timeout
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout

    def containers(self, service: str | None = None, running: bool = True) -> list[str]:
        filters = ["--filter", f"label=io.podman.compose.project={self.project}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        out = self.podman("ps", *([] if running else ["-a"]), *filters, "--format", "{{.Names}}")
        return sorted(out.split())

    def address(self, container: str) -> str:
        """A node's host:port: it listens on a port picked at start, written to its port file."""
        deadline = time.monotonic() + 60
        while True:
            out = subprocess.run(
                ["podman", "exec", container, "cat", "/tmp/splitserve.port"],
                capture_output=True, text=True, env=self.env,
            )  # fmt: skip
            if out.returncode == 0 and out.stdout.strip():
                return f"127.0.0.1:{out.stdout.strip()}"
            assert time.monotonic() < deadline, f"{container} never wrote its port"
            time.sleep(0.5)

    def stats(self, container: str):
        with grpc.insecure_channel(self.address(container)) as channel:
            stub = nodes_pb2_grpc.NodeStatsServiceStub(channel)
            return stub.GetStats(
                nodes_pb2.GetStatsRequest(), timeout=10, metadata=metadata_for(self.token)
            )


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _serves(router: str, api_key: str) -> bool:
    try:
        with Client(router, api_key=api_key) as client:
            return len(client.generate(prompt_token_ids=[1, 2, 3], **GREEDY).token_ids) == 8
    except SplitserveError:
        return False


@pytest.fixture(scope="module")
def deployment():
    started = time.monotonic()
    build = subprocess.run(
        ["bash", str(ROOT / "scripts/build_cpu_image.sh"), IMAGE],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    print(f"\nimage {IMAGE}: ready in {time.monotonic() - started:.0f} s")
    d = Deployment(f"sstest{os.getpid()}")
    try:
        started = time.monotonic()
        d.compose("up", "-d")
        _wait(lambda: len(d.containers()) == 6, 60, "6 containers")
        _wait(
            lambda: _serves(d.router, d.api_key), 180, "the router to serve through the containers"
        )
        print(f"cluster in containers: serving in {time.monotonic() - started:.0f} s")
        yield d
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run([*COMPOSE, "-p", d.project, "down", "-t", "10"], env=d.env, cwd=ROOT,
                           capture_output=True, timeout=300)  # fmt: skip
        left = d.containers(running=False)
        if left:  # never leave anything behind, even when down missed some
            subprocess.run(["podman", "rm", "-f", *left], env=d.env, capture_output=True)
        assert not left, f"down left containers behind: {left}"


def _reference(prompts: list[list[int]]) -> list[list[int]]:
    """Greedy output of the in-process engine on the same embedded model."""
    from splitserve.engine.core import LLMEngine
    from splitserve.kvstore import ModelIdentity
    from splitserve.models.loader import load_model
    from splitserve.models.runner import ModelRunner, RunnerConfig
    from splitserve.models.sampling_params import SamplingParams
    from splitserve.models.tiny import ensure_tiny_model

    path = ensure_tiny_model()
    config, model = load_model(path, dtype="float32")
    runner = ModelRunner(config, model, RunnerConfig(kv_cache_bytes=64 << 20))
    engine = LLMEngine(runner, ModelIdentity.for_checkpoint(path))
    reqs = engine.generate(prompts, SamplingParams(**GREEDY))
    return [r.output_token_ids for r in reqs]


PATHS = ("ipc", "dist", "tcp", "grpc")


def _transfers_by_path(d: Deployment) -> dict[str, dict[str, int]]:
    """Each decode container's received transfers, by KV path (from its counters)."""
    out = {}
    for container in d.containers("decode"):
        counters = d.stats(container).counters
        paths = {p: int(counters.get(f"transfers_{p}", 0)) for p in PATHS[:3]}
        paths["grpc"] = int(counters.get("transfers", 0)) - sum(paths.values())
        out[container] = paths
    return out


def test_containers_serve_token_exact_with_their_own_host_names(deployment):
    d = deployment
    names = {d.podman("exec", c, "hostname").strip() for c in d.containers()}
    assert {"redis", "router", "prefill", "decode"} <= names
    prompts = [[(7 * i + j) % 250 + 1 for j in range(20 + 13 * i)] for i in range(6)]
    before = _transfers_by_path(d)
    with Client(d.router, api_key=d.api_key) as client:  # the API keys guard gRPC too
        got = [list(client.generate(prompt_token_ids=p, **GREEDY).token_ids) for p in prompts]
    assert got == _reference(prompts)
    after = _transfers_by_path(d)
    print(f"transfers by path, per decode container: {after}")
    took = {p: sum(after[c][p] - before[c][p] for c in after) for p in PATHS}
    # CPU pools on one kernel: not ipc (CUDA only); dist before tcp; never the byte fallback.
    want = {**dict.fromkeys(PATHS, 0), "dist": len(prompts)}
    assert took == want, f"the prompts' transfers by path {took}, per container {after}"
    # The router's HTTP API wants the key compose.cpu.yaml mounted; /health does not.
    models = f"http://127.0.0.1:{d.http_port}/v1/models"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(models, timeout=10)
    assert refused.value.code == 401
    keyed = urllib.request.Request(models, headers={"Authorization": f"Bearer {d.api_key}"})
    assert urllib.request.urlopen(keyed, timeout=10).status == 200
    health = f"http://127.0.0.1:{d.http_port}/health"
    assert urllib.request.urlopen(health, timeout=10).status == 200


def test_a_decode_container_added_at_run_time_gets_transfers(deployment):
    d = deployment
    before = set(d.containers("decode"))
    # Only the new replica starts: the running containers are neither recreated nor restarted.
    # The count stays in the environment, so that `down` knows of the third one too.
    d.env["SPLITSERVE_NUM_DECODE"] = "3"
    d.compose("up", "-d", "--no-recreate", "--no-deps", "decode")
    (new,) = set(d.containers("decode")) - before
    started = time.monotonic()

    rng = random.Random(0)

    def got_transfers() -> bool:
        # New prompts each time: a prompt seen before is routed to the node caching its prefix.
        with Client(d.router, api_key=d.api_key) as client:
            for _ in range(4):
                prompt = [rng.randrange(1, 250) for _ in range(24)]
                client.generate(prompt_token_ids=prompt, **GREEDY)
        return d.stats(new).counters.get("transfers", 0) > 0

    _wait(got_transfers, 60, f"{new} to receive transfers")
    print(f"{new}: first transfers {time.monotonic() - started:.1f} s after it was added")


def test_a_stopped_decode_container_drains_and_no_request_fails(deployment):
    d = deployment
    victim = d.containers("decode")[0]
    traffic = Traffic(
        d.router, 3, prompt_len=30, max_tokens=GREEDY["max_tokens"], api_key=d.api_key
    )
    try:
        _wait(lambda: traffic.ok >= 6, 60, "traffic")
        d.podman("stop", "-t", "45", victim, timeout=90)  # SIGTERM, then the drain
        assert d.podman("inspect", "--format", "{{.State.ExitCode}}", victim).strip() == "0"
        mark = traffic.ok
        _wait(lambda: traffic.ok >= mark + 6, 60, "traffic after the drain")
    finally:
        traffic.stop()
    assert traffic.failures == [], traffic.failures[:5]
    assert victim not in d.containers("decode")


def test_the_planners_compose_actuator_grows_and_drains_a_pool(deployment):
    """The actuator `splitserve planner --actuator compose` uses, on podman-compose: one decode
    replica more, then one fewer under traffic: the newest is drained and no request fails."""
    from splitserve.planner.actuators import ComposeActuator

    d = deployment

    def run(argv, env):
        return subprocess.run(
            list(argv), env={**d.env, **env}, cwd=ROOT, check=True, capture_output=True,
            text=True, timeout=300,
        ).stdout  # fmt: skip

    act = ComposeActuator(
        [str(ROOT / "compose.cpu.yaml")], f"{sys.executable} -m podman_compose", d.project, run=run
    )
    have = act.current()
    before = set(d.containers("decode"))
    assert have.decode == len(before) and have.prefill == len(d.containers("prefill"))
    act.scale("decode", have.decode + 1)
    act.wait()
    d.env["SPLITSERVE_NUM_DECODE"] = str(have.decode + 1)  # so that `down` knows of it
    _wait(lambda: len(d.containers("decode")) == have.decode + 1, 60, "the new replica")
    newest = act.replicas("decode")[0]  # the one a drain takes
    traffic = Traffic(
        d.router, 3, prompt_len=30, max_tokens=GREEDY["max_tokens"], api_key=d.api_key
    )
    try:
        _wait(lambda: traffic.ok >= 6, 60, "traffic")
        act.scale("decode", have.decode)  # stop (SIGTERM: the drain), remove, compose up
        act.wait()
        mark = traffic.ok
        _wait(lambda: traffic.ok >= mark + 6, 60, "traffic after the drain")
    finally:
        traffic.stop()
    assert traffic.failures == [], traffic.failures[:5]
    assert len(d.containers("decode")) == have.decode
    assert newest not in d.containers(running=False)  # drained and removed
    assert act.current() == have
