"""The planner's parts around the policy: reading the router's real /metrics exposition, GPU
placement of the local actuator, the compose and Kubernetes actuators (against a recorded
command runner and a fake AppsV1Api), one planner round with its log and own /metrics, and the
command lines of `splitserve planner` and `splitserve up --autoscale`."""

from __future__ import annotations

import logging
import math

import pytest
from prometheus_client import generate_latest

from splitserve.cli import build_parser
from splitserve.planner import placement
from splitserve.planner.actuators import ComposeActuator, KubernetesActuator
from splitserve.planner.cli import policy_from
from splitserve.planner.loop import Planner
from splitserve.planner.policy import AIM, Bounds, Counts, Figures, PoolFigures, aim
from splitserve.planner.scrape import Scraper, quantile
from splitserve.router.metrics import PoolPressure, PressureFigures, RouterMetrics
from splitserve.runtime.slo import Slo


def _router_page(ttft: list[float], itl: list[float], queued: int = 3) -> tuple[str, RouterMetrics]:
    metrics = RouterMetrics()
    pool = PoolPressure(
        nodes=2, in_flight=5, slots=16, prompt_tokens=700, kv_blocks_total=100, kv_blocks_charged=40
    )
    metrics.watch_pressure(
        lambda: PressureFigures(
            queued=queued,
            queued_prompt_tokens=120,
            oldest_wait_s=0.75,
            wait_p50_s=0.1,
            wait_p99_s=0.5,
            prefill_tokens_per_s=900.0,
            prefill=pool,
            decode=pool,
        )
    )
    metrics.queue_length.set(queued)  # set by the router's admission
    for v in ttft:
        metrics.ttft.observe(v)
    for v in itl:
        metrics.itl.observe(v)
    return generate_latest(metrics.registry).decode(), metrics


def test_the_router_exposition_reads_into_figures():
    text, metrics = _router_page([0.05] * 9 + [3.0], [0.01] * 10)
    scraper = Scraper("http://unused")
    f = scraper.read_text(text, at=12.0)
    assert f.at == 12.0 and f.queue_length == 3 and f.queue_prompt_tokens == 120
    assert f.oldest_wait_s == 0.75 and f.wait_p99_s == 0.5 and f.prefill_tokens_per_s == 900
    assert f.prefill == PoolFigures(nodes=2, in_flight=5, slots=16, prompt_tokens=700)
    assert (f.kv_blocks_total, f.kv_blocks_charged) == (100, 40)
    assert f.ttft_s is not None and 0.0 < f.ttft_s <= 0.1  # p90 of nine 50 ms and one 3 s
    assert f.tpot_s is not None and f.tpot_s <= 0.025
    # The next read counts only what came after: ten slow first tokens.
    for _ in range(10):
        metrics.ttft.observe(4.0)
    g = scraper.read_text(generate_latest(metrics.registry).decode(), at=17.0)
    assert g.ttft_s is not None and g.ttft_s > 2.0
    assert g.tpot_s is None  # no token between the two scrapes


def test_several_routers_pages_read_as_one_routers():
    """Two routers in front of the same pools (``up --num-routers 2 --autoscale``): their
    requests add up, the nodes they both see do not."""
    one, _ = _router_page([0.05] * 10, [0.01] * 10, queued=3)
    other, _ = _router_page([3.0] * 10, [0.01] * 10, queued=4)
    f = Scraper("http://a/metrics,http://b/metrics").read_text([one, other], at=1.0)
    assert f.queue_length == 7 and f.queue_prompt_tokens == 240
    assert f.prefill == PoolFigures(nodes=2, in_flight=10, slots=16, prompt_tokens=1400)
    assert (f.kv_blocks_total, f.kv_blocks_charged) == (100, 80)
    assert f.prefill_tokens_per_s == 900 and f.oldest_wait_s == 0.75
    # Twenty first tokens, half of them slow: the p90 is a slow one's.
    assert f.ttft_s is not None and f.ttft_s > 2.0


def test_quantile_of_bucket_deltas():
    assert quantile({0.1: 0.0, 1.0: 0.0, math.inf: 0.0}, None) is None
    assert quantile({0.1: 10.0, 1.0: 10.0, math.inf: 10.0}, None) == pytest.approx(0.09)
    assert quantile({0.1: 10.0, 1.0: 20.0, math.inf: 20.0}, {0.1: 10.0, 1.0: 10.0}) > 0.1
    assert quantile({0.1: 0.0, 1.0: 0.0, math.inf: 5.0}, None) == 1.0  # past the last bucket


@pytest.mark.parametrize("num_gpus", [1, 2, 3, 8])
def test_placement_fills_gpus_evenly_and_never_past_their_room(num_gpus):
    gpus = list(range(10, 10 + num_gpus))
    max_nodes = 6
    cap = placement.per_gpu(max_nodes, num_gpus)
    used: dict[int, int] = {}
    for _ in range(max_nodes):
        gpu = placement.pick_gpu(gpus, used, cap)
        assert gpu is not None
        used[gpu] = used.get(gpu, 0) + 1
        assert max(used.values()) - min(used.get(g, 0) for g in gpus) <= 1
    assert sum(used.values()) == max_nodes and max(used.values()) <= cap
    assert placement.node_share(max_nodes, num_gpus) * cap <= placement.DEFAULT_GPU_SHARE
    if cap * num_gpus == max_nodes:
        assert placement.pick_gpu(gpus, used, cap) is None  # full
    used[gpus[0]] -= 1  # a node on the first GPU drained: the next one goes there
    assert placement.pick_gpu(gpus, used, cap) == gpus[0]


def test_placement_refuses_nonsense():
    with pytest.raises(ValueError):
        placement.per_gpu(0, 2)
    assert placement.device_of(None, "cpu") == "cpu" and placement.device_of(3, "cuda") == "cuda:3"


def test_compose_actuator_scales_both_services_every_time():
    calls = []
    running = {"prefill": ["llm_prefill_1 1"], "decode": ["llm_decode_2 2", "llm_decode_1 1"]}

    def run(argv, env):
        calls.append((list(argv), env))
        if argv[:2] == ["podman", "ps"]:
            service = argv[-1].rsplit("=", 1)[1]
            return "\n".join(sorted(running[service])) + "\n"
        return ""

    act = ComposeActuator(["/srv/llm/compose.cpu.yaml"], "podman-compose", run=run)
    assert act.current() == Counts(1, 2)
    assert calls[0][0][:3] == ["podman", "ps", "--format"]
    assert calls[0][0][4:] == [
        "--filter", "label=com.docker.compose.project=llm",
        "--filter", "label=com.docker.compose.service=prefill",
    ]  # fmt: skip
    act.scale("decode", 3)
    act.wait()
    argv, env = calls[-1]
    assert argv[:6] == ["podman-compose", "-f", "/srv/llm/compose.cpu.yaml", "-p", "llm", "up"]
    assert argv[6:] == [
        "-d", "--no-recreate", "--no-deps",
        "--scale", "prefill=1", "--scale", "decode=3", "prefill", "decode",
    ]  # fmt: skip
    assert env == {"SPLITSERVE_NUM_PREFILL": "1", "SPLITSERVE_NUM_DECODE": "3"}
    assert act.current() == Counts(1, 3)
    running["decode"].append("llm_decode_3 3")
    calls.clear()
    act.scale("decode", 2)  # the newest replica is drained (stop: SIGTERM, 45 s) and removed
    act.wait()
    assert [c[0] for c in calls[1:3]] == [
        ["podman", "stop", "-t", "45", "llm_decode_3"],
        ["podman", "rm", "llm_decode_3"],
    ]
    assert "decode=2" in calls[-1][0] and act.current() == Counts(1, 2)
    docker = ComposeActuator(["compose.yaml"], project="Prod", run=run)
    assert docker.base == ["docker", "compose", "-f", "compose.yaml", "-p", "prod"]


class FakeApps:
    def __init__(self) -> None:
        self.replicas = {"splitserve-prefill": 1, "splitserve-decode": 2}
        self.patches = []

    def read_namespaced_deployment_scale(self, name, namespace):
        from kubernetes.client import V1Scale, V1ScaleSpec

        return V1Scale(spec=V1ScaleSpec(replicas=self.replicas[name]))

    def patch_namespaced_deployment_scale(self, name, namespace, body):
        self.patches.append((name, namespace, body))
        self.replicas[name] = body["spec"]["replicas"]


def test_kubernetes_actuator_patches_the_scale_subresource():
    pytest.importorskip("kubernetes")
    api = FakeApps()
    act = KubernetesActuator("llm", api=api)
    assert act.current() == Counts(1, 2)
    act.scale("prefill", 3)
    assert api.patches == [("splitserve-prefill", "llm", {"spec": {"replicas": 3}})]
    assert act.current() == Counts(3, 2)


class FakeActuator:
    name = "fake"

    def __init__(self, counts: Counts) -> None:
        self.counts = counts

    def current(self) -> Counts:
        return self.counts

    def scale(self, role: str, count: int) -> None:
        self.counts = self.counts._replace(**{role: count})


class FakeScraper:
    url = "http://router/metrics"

    def __init__(self, seq):
        self.seq = list(seq)

    def read(self) -> Figures:
        if not self.seq:
            raise OSError("connection refused")
        return self.seq.pop(0)


def test_a_planner_round_acts_logs_and_exports(caplog, tmp_path):
    short = [
        Figures(at=t, queue_length=4, oldest_wait_s=1.0, decode=PoolFigures(1, 8, 4))
        for t in (0.0, 1.0)
    ]
    act = FakeActuator(Counts(1, 1))
    planner = Planner(
        FakeScraper(short),  # type: ignore[arg-type]
        act,
        Bounds(1, 2, 1, 3),
        AIM,
        interval_s=1.0,
        record=str(tmp_path / "trace.jsonl"),
    )
    planner.config = planner.config.__class__(out_after_s=1.0)
    with caplog.at_level(logging.INFO, logger="splitserve.planner.loop"):
        planner.step()
        planner.step()
        assert planner.step() is None  # the router did not answer: nothing changes
    assert act.counts == Counts(1, 3)
    assert "planner: decode 1 -> 3: scale out: decode load 2.00" in caplog.text
    assert "cannot read http://router/metrics" in caplog.text
    page = generate_latest(planner.registry).decode()
    assert 'splitserve_planner_wanted_nodes{role="decode"} 3.0' in page
    assert 'splitserve_planner_decisions_total{direction="up",role="decode"} 1.0' in page
    assert 'splitserve_planner_decisions_total{direction="down",role="prefill"} 0.0' in page
    assert len((tmp_path / "trace.jsonl").read_text().splitlines()) == 2


def test_a_planner_round_holds_when_the_router_answers_a_page_that_is_not_metrics(caplog):
    """A proxy's error page (or any body that is not Prometheus text) on the metrics port: the
    round holds and says why, like a router that does not answer; the planner goes on. (The
    page is handed to the real parser; tests/unit opens no socket.)"""

    class ErrorPage(Scraper):
        def read(self) -> Figures:
            return self.read_text("<html>502 bad gateway</html>", 0.0)

    act = FakeActuator(Counts(1, 1))
    planner = Planner(ErrorPage("http://router/metrics"), act, Bounds(1, 2, 1, 3), AIM)
    with caplog.at_level(logging.WARNING, logger="splitserve.planner.loop"):
        assert planner.step() is None
    assert "cannot read http://router/metrics" in caplog.text
    assert "invalid metric name" in caplog.text
    assert act.counts == Counts(1, 1)


def test_planner_and_up_autoscale_command_lines():
    args = build_parser().parse_args(
        ["planner", "--actuator", "kubernetes", "--namespace", "llm", "--max-decode", "4",
         "--slo", "ttft=0.5,tpot=0.05", "--cooldown", "120"]
    )  # fmt: skip
    bounds, slo, config = policy_from(args)
    assert bounds == Bounds(1, 1, 1, 4) and slo == Slo(0.5, 0.05)
    assert config.cooldown_s == 120 and config.out_after_s == args.interval == 5.0
    up = build_parser().parse_args(
        ["up", "--model", "tiny", "--autoscale", "--max-prefill", "3", "--max-decode", "3"]
    )
    assert up.autoscale and policy_from(up, 1, 1)[0] == Bounds(1, 3, 1, 3)
    for bad in ("ttft=0", "ttfb=1", "ttft=fast"):
        with pytest.raises(ValueError):
            Slo.parse(bad)
    # One Slo (runtime.slo) for the router and the planner: the planner fills a bound left out.
    assert aim(None) == AIM == Slo(2.0, 0.1)
    assert aim("ttft=1") == Slo(1.0, 0.1) and aim("tpot=20ms") == Slo(2.0, 0.02)
    with pytest.raises(ValueError, match="give both bounds"):
        Slo(1.0, None).both()
    with pytest.raises(ValueError):
        Bounds(min_prefill=2, max_prefill=1)


def test_the_launcher_places_elastic_nodes_on_gpus_with_room():
    import shutil

    from splitserve.launcher import ClusterSpec, LocalCluster

    spec = ClusterSpec(model_path="tiny", device="cuda", gpus="0,1,2", num_prefill=1)
    cluster = LocalCluster(spec, max_nodes=6)  # 2 nodes a GPU at most, 0.45 of its memory each
    try:
        assert cluster._placement(2) == [("cuda:0", 0.45), ("cuda:1", 0.45)]
        assert cluster._place([0, 1, 2], {0: 1, 1: 1}) == ("cuda:2", 0.45)
        assert cluster._place([0, 1, 2], {0: 2, 1: 1, 2: 2}) == ("cuda:1", 0.45)
        with pytest.raises(RuntimeError, match="holds 2 nodes already"):
            cluster._place([0, 1, 2], {0: 2, 1: 2, 2: 2})
        with pytest.raises(RuntimeError, match="started cluster"):
            cluster.add_node("decode")
        assert cluster.drain_node("decode") is None  # nothing started: nothing to drain
    finally:
        shutil.rmtree(cluster._workdir, ignore_errors=True)
    fixed = LocalCluster(spec)  # without max_nodes: the fixed placement, as before
    try:
        assert fixed._placement(2) == spec.placement(0)
    finally:
        shutil.rmtree(fixed._workdir, ignore_errors=True)
