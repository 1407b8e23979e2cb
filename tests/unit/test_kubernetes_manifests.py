"""deploy/kubernetes, checked offline (no cluster can run here): the base and both overlays are
rendered (tests/support/kustomize.py: the kustomize features they use; the cluster tests compare
it with `kubectl kustomize`); every object loads into the `kubernetes` client's models and back
unchanged (a misspelt or misplaced field would be dropped); every splitserve container's command
line, with its environment, is parsed by the real `splitserve` parser; the planner's Role allows
exactly get/patch of the two node Deployments' scale subresource; probes, drain grace, disruption
budgets, the token and API key Secrets and GPU requests are where they must be."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import pytest
from support.kustomize import containers, load_all, render

kubernetes = pytest.importorskip("kubernetes")

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
LAYOUTS = ["base", "overlays/cpu", "overlays/gpu", "overlays/gpu-tp"]
MODELS = {"HorizontalPodAutoscaler": "V2HorizontalPodAutoscaler"}
NODE_ROLES = ("prefill", "decode")


def _key(d: dict) -> tuple[str, str]:
    return d["kind"], d["metadata"]["name"]


@pytest.fixture(scope="module", params=LAYOUTS)
def rendered(request) -> tuple[str, dict[tuple[str, str], dict]]:
    docs = render(ROOT / request.param)
    assert len({_key(d) for d in docs}) == len(docs), "two objects of one kind and name"
    return request.param, {_key(d): d for d in docs}


def test_every_object_loads_into_the_client_models(rendered):
    api = kubernetes.client.ApiClient()
    for (kind, name), doc in rendered[1].items():
        model = MODELS.get(kind, f"V1{kind}")
        obj = api._ApiClient__deserialize(copy.deepcopy(doc), model)
        assert api.sanitize_for_serialization(obj) == doc, f"{kind}/{name} has unknown fields"


def _env(container: dict) -> dict[str, str]:
    stand_ins = {"status.podIP": "10.1.2.3", "metadata.namespace": "splitserve"}
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            env[e["name"]] = stand_ins[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) in a container's args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


def test_every_command_line_parses(rendered, monkeypatch):
    from splitserve import cli
    from splitserve.planner.cli import policy_from

    layout, docs = rendered
    seen = set()
    for doc in docs.values():
        for c in containers(doc):
            if not c["image"].startswith("splitserve:"):
                continue
            env = _env(c)
            argv = [_expand(a, env) for a in c["args"]]
            for name in [n for n in os.environ if n.startswith("SPLITSERVE_")]:
                monkeypatch.delenv(name)
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            args = cli.build_parser().parse_args(argv)
            seen.add(args.command)
            if args.command == "planner":
                bounds, _, _ = policy_from(args)
                assert args.actuator == "kubernetes" and args.namespace == "splitserve"
                assert bounds.max_prefill >= bounds.min_prefill >= 1
                assert args.router_metrics == "http://splitserve-router:9100/metrics"
            else:
                assert args.port == 8000 and args.host == "0.0.0.0"
                assert args.redis_url == "redis://splitserve-redis:6379"
                assert args.metrics_port == 9100
            if args.command in NODE_ROLES:
                assert args.advertise_host == "10.1.2.3"
                expected_device = "cuda" if "gpu" in layout else "cpu"
                assert args.device == expected_device
                tp = {"overlays/gpu-tp": {"prefill": 4, "decode": 2}}.get(layout, {})
                assert args.tensor_parallel_size == tp.get(args.command, 1)
    assert seen == {"router", "prefill", "decode", "planner"}


def test_the_planner_may_scale_the_two_pools_and_nothing_else(rendered):
    _, docs = rendered
    role = docs["Role", "splitserve-planner"]
    assert role["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": ["splitserve-prefill", "splitserve-decode"],
            "verbs": ["get", "patch"],
        }
    ]
    for name in role["rules"][0]["resourceNames"]:
        assert ("Deployment", name) in docs
    binding = docs["RoleBinding", "splitserve-planner"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "splitserve-planner",
    }
    planner = docs["Deployment", "splitserve-planner"]["spec"]
    account = planner["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account, "namespace": "splitserve"}
    ]
    assert ("ServiceAccount", account) in docs
    assert planner["replicas"] == 1


def test_nodes_probe_drain_and_budget(rendered):
    layout, docs = rendered
    for role in NODE_ROLES:
        spec = docs["Deployment", f"splitserve-{role}"]["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": ports["grpc"]}, (role, probe)
        drain = float(_env(c)["SPLITSERVE_DRAIN_TIMEOUT_S"])
        assert spec["terminationGracePeriodSeconds"] >= drain + 10
        token = _env(c)["SPLITSERVE_AUTH_TOKEN_FILE"]
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        (vol,) = [n for n, p in mounts.items() if token.startswith(p + "/")]
        assert volumes[vol]["secret"]["secretName"] == "splitserve-cluster-token"
        pdb = docs["PodDisruptionBudget", f"splitserve-{role}"]["spec"]
        labels = docs["Deployment", f"splitserve-{role}"]["spec"]["selector"]["matchLabels"]
        assert pdb["selector"]["matchLabels"] == labels and pdb["maxUnavailable"] == 1
        gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        assert (gpus is not None) == ("gpu" in layout)  # how many: the test below
        assert c["image"] == ("splitserve:cpu" if layout.endswith("cpu") else "splitserve:latest")
    router = docs["Service", "splitserve-router"]["spec"]["ports"]
    assert {p["name"]: p["port"] for p in router} == {"grpc": 8000, "http": 8080, "metrics": 9100}


def test_the_router_mounts_the_token_and_the_api_key_secrets(rendered):
    _, docs = rendered
    spec = docs["Deployment", "splitserve-router"]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    env = _env(c)
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    wanted = {
        "SPLITSERVE_AUTH_TOKEN_FILE": "splitserve-cluster-token",
        "SPLITSERVE_API_KEY_FILE": "splitserve-api-keys",
    }
    for variable, secret in wanted.items():
        path = env[variable]
        (vol,) = [n for n, m in mounts.items() if path.startswith(m["mountPath"] + "/")]
        assert mounts[vol]["readOnly"] and volumes[vol]["secret"]["secretName"] == secret
    assert "--http-port" in c["args"]  # the keys guard a served HTTP API


def test_the_autoscaler_examples_name_real_objects_and_metrics():
    from prometheus_client import generate_latest

    from splitserve.router.metrics import PoolPressure, PressureFigures, RouterMetrics

    metrics = RouterMetrics()
    pool = PoolPressure(0, 0, 0, 0, 0, 0)
    metrics.watch_pressure(lambda: PressureFigures(0, 0, 0.0, 0.0, 0.0, 0.0, pool, pool))
    exported = set(re.findall(r"^(\w+)", generate_latest(metrics.registry).decode(), re.M))
    api = kubernetes.client.ApiClient()
    for hpa in load_all(ROOT / "examples" / "hpa.yaml"):
        obj = api._ApiClient__deserialize(copy.deepcopy(hpa), "V2HorizontalPodAutoscaler")
        assert api.sanitize_for_serialization(obj) == hpa
        assert hpa["spec"]["scaleTargetRef"]["name"] in {f"splitserve-{r}" for r in NODE_ROLES}
        for m in hpa["spec"]["metrics"]:
            assert m["external"]["metric"]["name"] in exported
    for so in load_all(ROOT / "examples" / "keda-scaledobjects.yaml"):
        assert so["kind"] == "ScaledObject" and so["apiVersion"] == "keda.sh/v1alpha1"
        assert so["spec"]["scaleTargetRef"]["name"] == so["metadata"]["name"]
        for t in so["spec"]["triggers"]:
            names = set(re.findall(r"splitserve_\w+", t["metadata"]["query"]))
            assert names and names <= exported, names - exported
            float(t["metadata"]["threshold"])


def test_a_node_pod_holds_exactly_its_ranks_gpus(rendered):
    """A node at tensor parallel size N runs a rank on each of N GPUs: its pod must get N."""
    for doc in rendered[1].values():
        for c in containers(doc):
            if c["name"] not in NODE_ROLES:
                continue
            gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
            tp = _env(c).get("SPLITSERVE_TENSOR_PARALLEL_SIZE", "1")
            if gpus is not None:
                assert gpus == tp, f"{c['name']}: {gpus} GPUs for tensor parallel size {tp}"
            else:
                assert tp == "1", f"{c['name']}: tensor parallel size {tp} without GPUs"


def test_the_kv_store_example_loads_and_its_command_parses(monkeypatch):
    from splitserve import cli

    api = kubernetes.client.ApiClient()
    docs = {_key(d): d for d in load_all(ROOT / "examples" / "kv-store.yaml")}
    for (kind, name), doc in docs.items():
        obj = api._ApiClient__deserialize(copy.deepcopy(doc), f"V1{kind}")
        assert api.sanitize_for_serialization(obj) == doc, f"{kind}/{name} has unknown fields"
    (container,) = containers(docs["Deployment", "splitserve-kv-store"])
    args = cli.build_parser().parse_args([_expand(a, _env(container)) for a in container["args"]])
    assert args.command == "kv-store" and args.host == "10.1.2.3" and args.port == 50051
    # Only the node pods may reach it (it has no authentication).
    (rule,) = docs["NetworkPolicy", "splitserve-kv-store"]["spec"]["ingress"]
    (selector,) = rule["from"][0]["podSelector"]["matchExpressions"]
    assert set(selector["values"]) == {f"splitserve-{role}" for role in NODE_ROLES}
