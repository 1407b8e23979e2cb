"""What `splitserve up` hands each component and prints, without starting processes: the
/metrics ports (--metrics-port), the router's HTTP port and tokenizer (--http-port, --tokenizer).
A real `up --metrics-port 0` is in tests/cluster/test_cluster_up.py."""

from __future__ import annotations

import signal

import pytest

from splitserve import launcher
from splitserve.cli import build_parser
from splitserve.launcher import ClusterAddresses, ClusterSpec, LocalCluster


def spec(**kw) -> ClusterSpec:
    return ClusterSpec(model_path="m", **kw)


def test_metrics_ports_follow_the_routers_or_are_bound_by_each_component():
    assert spec().metrics_ports() is None
    given = spec(metrics_port=9100, num_prefill=2, num_decode=3).metrics_ports()
    assert given == [9100, 9101, 9102, 9103, 9104, 9105]  # the router's, 2 prefill, 3 decode
    # 0: each binds a free one itself (a port picked for it could be taken before it binds)
    assert spec(metrics_port=0, num_prefill=2, num_decode=2).metrics_ports() == [0] * 5


def test_bad_ports_are_refused():
    with pytest.raises(ValueError, match="--metrics-port"):
        spec(metrics_port=65534, num_decode=2)
    with pytest.raises(ValueError, match="--metrics-port"):
        spec(metrics_port=-1)
    with pytest.raises(ValueError, match="--http-port"):
        spec(http_port=70000)


def _router_flags(cluster_spec: ClusterSpec) -> list[str]:
    cluster = LocalCluster(cluster_spec)
    try:
        return cluster.router_flags(("p:1",), ("d:1", "d:2"))
    finally:
        cluster.stop()  # removes its run folder


def _value(flags: list[str], flag: str) -> str | None:
    return flags[flags.index(flag) + 1] if flag in flags else None


def test_router_flags():
    plain = _router_flags(spec(port=8001))
    assert plain == ["--port", "8001", "--prefill", "p:1", "--decode", "d:1,d:2"]
    given = _router_flags(spec(http_port=8080, tokenizer_path="/tok"))
    assert _value(given, "--http-port") == "8080" and "--http-port-file" not in given
    assert _value(given, "--tokenizer") == "/tok"
    free = _router_flags(spec(http_port=0))
    assert _value(free, "--http-port") == "0"
    assert _value(free, "--http-port-file").endswith("router-0.http-port")
    # the nodes' dtype, block size, quantization and KV format are part of the model identity the
    # router checks
    node_args = ("--kv-cache-mb", "64", "--dtype", "bfloat16", "--block-size", "32")
    node_args += ("--quantization", "fp8", "--kv-cache-dtype", "fp8")
    shared = _router_flags(spec(node_args=node_args))
    assert _value(shared, "--dtype") == "bfloat16" and _value(shared, "--block-size") == "32"
    assert _value(shared, "--quantization") == "fp8" and _value(shared, "--kv-cache-dtype") == "fp8"
    assert "--kv-cache-mb" not in shared


def test_up_prints_each_components_metrics_url_and_the_http_address(monkeypatch, capsys):
    addresses = ClusterAddresses(
        "127.0.0.1:8000",
        ("127.0.0.1:5001",),
        ("127.0.0.1:5002",),
        "redis://127.0.0.1:6379",
        http="127.0.0.1:8080",
        metrics={
            "127.0.0.1:8000": "http://127.0.0.1:9100/metrics",
            "127.0.0.1:5001": "http://127.0.0.1:9101/metrics",
            "127.0.0.1:5002": "http://127.0.0.1:9102/metrics",
        },
    )
    specs = []

    class Cluster:  # answers with the addresses above instead of starting processes
        def __init__(self, cluster_spec):
            specs.append(cluster_spec)

        def start(self):
            return addresses

        def poll(self):
            return "router (status 1)"

        def stop(self):
            pass

    monkeypatch.setattr(launcher, "LocalCluster", Cluster)
    argv = ["up", "--model", "/m", "--metrics-port", "9100", "--http-port", "8080"]
    argv += ["--tokenizer", "/tok"]
    args = build_parser().parse_args(argv)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        assert args.func(args) == 1  # the fake router "exited"
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    (given,) = specs
    assert (given.metrics_port, given.http_port, given.tokenizer_path) == (9100, 8080, "/tok")
    lines = capsys.readouterr().out.splitlines()
    assert lines[:4] == [
        "router   127.0.0.1:8000 metrics http://127.0.0.1:9100/metrics",
        "http     127.0.0.1:8080 (OpenAI-compatible API)",
        "prefill  127.0.0.1:5001 metrics http://127.0.0.1:9101/metrics",
        "decode   127.0.0.1:5002 metrics http://127.0.0.1:9102/metrics",
    ]


def test_a_decode_only_cluster_and_the_direct_prefill_threshold(capsys):
    assert spec(num_prefill=0).placement(0) == [("cpu", None)]  # one decode node
    for bad in (dict(num_prefill=-1), dict(num_decode=0)):
        with pytest.raises(ValueError, match="--num-"):
            spec(**bad)
    cluster = LocalCluster(spec(num_prefill=0, direct_prefill_tokens=32))
    try:
        flags = cluster.router_flags((), ("d:1",))
    finally:
        cluster.stop()
    assert _value(flags, "--prefill") == "" and _value(flags, "--direct-prefill-tokens") == "32"
    assert "--direct-prefill-tokens" not in _router_flags(spec())
    # The router needs decode nodes (or a registry), not prefill nodes.
    from splitserve import cli

    assert cli.cmd_router(build_parser().parse_args(["router", "--prefill", "p:1"])) == 2
    assert "--decode" in capsys.readouterr().err


def test_several_routers_share_one_port_and_lease_the_nodes_capacity():
    cluster = LocalCluster(spec(num_routers=4, port=0, http_port=0))
    try:
        # The first binds free ports and says which (its port files); the others share them.
        first = cluster.router_flags(("p:1",), ("d:1",), (0, 0))
        flags = cluster.router_flags(("p:1",), ("d:1",), (8123, 8124))
    finally:
        cluster.stop()
    assert _value(first, "--port") == "0" and "--reuse-port" in first
    assert _value(first, "--http-port-file").endswith("router-0.http-port")
    assert _value(flags, "--port") == "8123" and "--reuse-port" in flags
    assert _value(flags, "--http-port") == "8124" and "--http-port-file" not in flags
    # No static split: the decode nodes lease their capacity to the routers as each needs it.
    assert "--capacity-share" not in flags
    with pytest.raises(ValueError, match="--num-routers"):
        spec(num_routers=-1)


def test_num_routers_auto_gives_cpu_clusters_one_and_gpu_pools_enough_for_their_tokens():
    from splitserve.cluster_spec import auto_routers, router_count

    assert router_count("auto") == 0 and router_count("3") == 3
    with pytest.raises(ValueError, match="number or auto"):
        router_count("many")
    assert auto_routers("cpu", 8, 64) == 1
    assert auto_routers("cuda", 1, 16) == 2  # one GPU: two routers still (overload)
    assert auto_routers("cuda:0", 8, 64) == 4  # a router per two decode GPUs
    assert auto_routers("cuda", 8, 8) == 2  # at most one per four cores
    assert auto_routers("cuda", 1, 2) == 1
    assert spec().num_routers == 1  # the default (auto) on CPU
    assert spec(num_routers=3).num_routers == 3


def test_each_node_gets_its_own_kv_tier_folder_and_tp_nodes_no_tier_flags():
    node_args = ("--kv-cache-mb", "8", "--kv-disk-cache-dir", "/d", "--kv-host-cache-mb", "64")
    cluster = LocalCluster(spec(node_args=node_args, decode_tp=2))
    cluster._disk_folder = "/d"
    cluster._tier_flags = [launcher.DISK_CACHE_FLAG, "100"]
    first = cluster._tier_args("prefill", [])
    assert first[-2:] == [launcher.DISK_DIR_FLAG, "/d/prefill-0"] and "100" in first
    held = launcher._Process("prefill-0", None, disk_folder="/d/prefill-0")  # type: ignore[arg-type]
    assert cluster._tier_args("prefill", [held])[-1] == "/d/prefill-1"
    assert cluster._tier_args("prefill", [])[-1] == "/d/prefill-0"  # a drained node's, again
    # TP 2 nodes: no tier yet, so none of its flags (a disk tier without one refuses to start).
    assert cluster._tier_args("decode", []) == ["--kv-cache-mb", "8"]
    assert launcher._flag_value(first, launcher.DISK_DIR_FLAG) == "/d/prefill-0"


def test_an_embedded_store_reaches_tp1_nodes_as_its_url_and_tp_nodes_not_at_all():
    node_args = ("--kv-cache-mb", "8", "--kv-store", "embedded")
    cluster = LocalCluster(spec(node_args=node_args, decode_tp=2))
    url = "mooncake://127.0.0.1:5?metadata=http://127.0.0.1:6/metadata"
    cluster._tier_flags = [launcher.STORE_FLAG, url]  # (what start puts there)
    prefill = cluster._tier_args("prefill", [])
    assert launcher._flag_value(prefill, launcher.STORE_FLAG) == url and "embedded" not in prefill
    assert cluster._tier_args("decode", []) == ["--kv-cache-mb", "8"]
