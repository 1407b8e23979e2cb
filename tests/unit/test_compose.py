"""compose.yaml, the Dockerfile and .dockerignore, checked without Docker (`docker compose config`
and podman-compose's reading of the files: tests/containers/test_compose_config.py)."""

import fnmatch
import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from splitserve import cli

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_TEXT = (ROOT / "compose.yaml").read_text()
DEPLOY_DOC = (ROOT / "docs" / "deploy.md").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
COMPONENTS = {"router": "router", "prefill": "prefill", "decode": "decode"}  # service -> command
# ${NAME}, ${NAME:-default}, ${NAME-default}: compose's interpolation (no nesting used here)
INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}")


def _defaults(text: str) -> str:
    """compose.yaml as compose sees it with none of its variables set."""
    return INTERPOLATION.sub(lambda m: m.group(3) or "", text)


COMPOSE = yaml.safe_load(_defaults(COMPOSE_TEXT))
# The cluster's services; those of an optional profile (monitoring) apart.
SERVICES = {k: v for k, v in COMPOSE["services"].items() if not v.get("profiles")}
MONITORING = {k: v for k, v in COMPOSE["services"].items() if "monitoring" in v.get("profiles", ())}


def _env(service: str) -> dict[str, str]:
    env = SERVICES[service].get("environment") or {}
    assert isinstance(env, dict), "environment is written as a mapping"
    return {k: "" if v is None else str(v) for k, v in env.items()}


def _volumes(service: str) -> list[tuple[str, str, str]]:
    out = []
    for volume in SERVICES[service].get("volumes", []):
        source, target, *mode = volume.split(":")
        out.append((source, target, mode[0] if mode else "rw"))
    return out


def test_the_four_services():
    assert set(SERVICES) == {"redis", "router", "prefill", "decode"}
    assert set(MONITORING) == {"prometheus", "grafana", "jaeger"}
    assert set(COMPOSE["services"]) == set(SERVICES) | set(MONITORING) | {"kv-store"}


def test_the_kv_store_profile_runs_a_store_the_nodes_can_name_and_publishes_nothing():
    from splitserve import cli

    store = COMPOSE["services"]["kv-store"]
    assert store["profiles"] == ["kv-store"] and "ports" not in store
    args = cli.build_parser().parse_args([str(a) for a in store["command"]])
    assert args.host == store["hostname"] == "kv-store" and args.memory_mb == 4096
    for role in ("prefill", "decode"):  # empty unless asked for: no store, nothing changes
        assert _env(role)["SPLITSERVE_KV_STORE"] == ""
    assert "SPLITSERVE_KV_STORE=mooncake://kv-store:50051" in COMPOSE_TEXT  # (how to ask)


def test_the_monitoring_profile_mounts_its_files_and_publishes_on_loopback_only():
    mounts = {
        target: ROOT / source
        for spec in MONITORING.values()
        for source, target, _mode in (v.split(":") for v in spec.get("volumes", []))
    }
    assert mounts["/etc/prometheus/prometheus.yml"].is_file()
    assert (mounts["/etc/grafana/provisioning"] / "datasources" / "prometheus.yml").is_file()
    assert (mounts["/var/lib/grafana/dashboards"] / "splitserve.json").is_file()
    for name, spec in MONITORING.items():
        for port in spec.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), name
    # Prometheus scrapes each cluster service by name at the port every component serves on.
    scrape = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    targets = {
        sd["names"][0]: sd["port"]
        for job in scrape["scrape_configs"]
        for sd in job["dns_sd_configs"]
    }
    port = int(re.search(r"SPLITSERVE_METRICS_PORT:-(\d+)", COMPOSE_TEXT).group(1))
    assert targets == {"router": port, "prefill": port, "decode": port}


@pytest.mark.parametrize("service", ["prefill", "decode"])
def test_every_node_reserves_gpus_and_claims_one_of_its_own(service):
    devices = SERVICES[service]["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1
    (device,) = devices
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    # `count: N` would give every replica the host's first N GPUs: each node sees all of them and
    # claims one through a lock in a volume that all node containers share.
    assert device["count"] == "all"
    env = _env(service)
    assert env["SPLITSERVE_DEVICE"] == "cuda"  # no index: the claimed GPU is the node's cuda:0
    lock_dir = env["SPLITSERVE_GPU_LOCK_DIR"]
    mounts = {target: source for source, target, _ in _volumes(service)}
    assert mounts[lock_dir] in COMPOSE["volumes"]  # a named volume, the same for every node
    assert _volumes("prefill") == _volumes("decode")


def test_the_router_and_redis_reserve_no_gpu():
    for service in ("router", "redis"):
        assert "deploy" not in SERVICES[service]


@pytest.mark.parametrize("service", list(COMPONENTS))
def test_components_share_the_image_and_the_read_only_model(service):
    spec = SERVICES[service]
    assert spec["image"] == SERVICES["router"]["image"] == "splitserve:latest"
    assert spec["build"] == "."
    assert spec["command"][0] == COMPONENTS[service]
    if service in ("prefill", "decode"):  # each pool's tensor parallel size, 1 unless set
        assert spec["command"][1:] == ["--tensor-parallel-size", "1"]
    assert ("./checkpoint", "/models", "ro") in _volumes(service)
    assert "${SPLITSERVE_MODEL_DIR:-./checkpoint}:/models:ro" in COMPOSE_TEXT
    env = _env(service)
    assert env["SPLITSERVE_MODEL"] == "/models"
    assert env["SPLITSERVE_REDIS_URL"] == "redis://redis:6379"
    assert env["SPLITSERVE_HOST"] == "0.0.0.0"  # reachable from the other containers


def test_healthchecks():
    for service, spec in SERVICES.items():
        check = spec["healthcheck"]
        assert check["test"][0] in ("CMD", "CMD-SHELL") and check.get("retries", 0) >= 1
        if service in COMPONENTS:
            assert check["test"][:3] == ["CMD", "splitserve", "health"]  # grpc.health.v1
            assert check["start_period"]  # loading a model takes a while


def test_dependencies_wait_for_healthy_services():
    for service, spec in SERVICES.items():
        for dependency, condition in spec.get("depends_on", {}).items():
            assert dependency in SERVICES
            assert condition == {"condition": "service_healthy"}, (service, dependency)
    assert set(SERVICES["router"]["depends_on"]) == {"redis", "prefill", "decode"}
    assert set(SERVICES["prefill"]["depends_on"]) == {"redis"}
    assert set(SERVICES["decode"]["depends_on"]) == {"redis"}


def test_only_the_router_publishes_a_host_port():
    for service in ("redis", "prefill", "decode"):
        assert "ports" not in SERVICES[service], f"{service} must scale: no fixed host port"
        assert "container_name" not in SERVICES[service]
    grpc_port, http_port = SERVICES["router"]["ports"]
    host_port, container_port = str(grpc_port).rsplit(":", 1)
    assert container_port == _env("router")["SPLITSERVE_PORT"] == "8000"
    assert host_port == "8000"
    assert '"${SPLITSERVE_ROUTER_PORT:-8000}:8000"' in COMPOSE_TEXT  # configurable
    host_port, container_port = str(http_port).rsplit(":", 1)
    assert container_port == _env("router")["SPLITSERVE_HTTP_PORT"] == "8080"
    assert '"${SPLITSERVE_ROUTER_HTTP_PORT:-8080}:8080"' in COMPOSE_TEXT


@pytest.mark.parametrize("service", list(COMPONENTS))
def test_environment_names_are_options_of_the_command(service):
    known = set(cli.env_names(COMPONENTS[service]))
    for name in _env(service):
        assert name in known, f"{service}: {name} is no option of `splitserve {service}`"


def test_health_checks_reach_the_port_the_component_listens_on():
    from splitserve.runtime.health import default_address

    for service in COMPONENTS:
        assert default_address(_env(service)) == "127.0.0.1:8000"


def test_every_variable_is_documented():
    lines = [line for line in COMPOSE_TEXT.splitlines() if not line.lstrip().startswith("#")]
    compose_variables = {m.group(1) for m in INTERPOLATION.finditer("\n".join(lines))}
    assert "SPLITSERVE_MODEL_DIR" in compose_variables
    option_variables = {name for command in cli.ENV_COMMANDS for name in cli.env_names(command)}
    for name in sorted(compose_variables | option_variables):
        assert f"`{name}`" in DEPLOY_DOC, f"docs/deploy.md does not explain {name}"
    assert "docker compose up -d --build --scale prefill=2 --scale decode=4" in DEPLOY_DOC


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = (ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            out.append((instruction.upper(), rest.strip()))
    return out


def _instructions(name: str) -> list[str]:
    return [rest for instruction, rest in _dockerfile() if instruction == name]


def test_dockerfile_runs_any_component_through_the_console_script():
    assert PYPROJECT["project"]["scripts"]["splitserve"] == "splitserve.cli:main"
    (entrypoint,) = _instructions("ENTRYPOINT")
    assert json.loads(entrypoint) == ["splitserve"]
    assert _instructions("STOPSIGNAL") == ["SIGTERM"]
    (healthcheck,) = _instructions("HEALTHCHECK")
    assert json.loads(healthcheck.partition("CMD ")[2]) == ["splitserve", "health"]
    users = _instructions("USER")
    assert users and users[-1] not in ("root", "0")
    assert _instructions("EXPOSE") == ["8000"]
    env = " ".join(_instructions("ENV"))
    assert "SPLITSERVE_HOST=0.0.0.0" in env and "SPLITSERVE_PORT=8000" in env


def test_dockerfile_base_has_a_torch_the_project_accepts():
    (arg,) = [a for a in _instructions("ARG") if a.startswith("BASE_IMAGE=")]
    image = arg.partition("=")[2]
    match = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-runtime", image)
    assert match, image
    (torch_spec,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch")]
    assert Version(match.group(1)) in SpecifierSet(torch_spec.removeprefix("torch"))
    assert _instructions("FROM") == ["${BASE_IMAGE}"]


def test_dockerfile_installs_the_project_without_test_tools():
    installs = [r for r in _instructions("RUN") if "pip install" in r]
    assert installs and not any("[test]" in r or " -e " in r for r in installs)


def test_dockerignore_keeps_what_the_install_needs_and_drops_the_rest():
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert not any(p.startswith("!") for p in patterns)

    def ignored(path: str) -> bool:
        return any(
            fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, p.removeprefix("**/"))
            for p in patterns
        )

    for path in (".venv", ".git", "tests", "x.whl", "__pycache__", "checkpoint"):
        assert ignored(path), path
    folders = PYPROJECT["tool"]["setuptools"]["package-dir"].values()
    for path in ("pyproject.toml", "README.md", *folders):
        assert (ROOT / path).exists() and not ignored(path), path
