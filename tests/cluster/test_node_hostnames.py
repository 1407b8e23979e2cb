"""One container per node, emulated with processes: each node under its own host name (a UTS
namespace) on one kernel. The nodes still know they share a host — by the kernel's boot id, not
the host name — and KV moves by the transfer layer (gloo `dist` on CPU), with the output the
same as on the byte path. Skipped where UTS namespaces cannot be made (needs root and unshare)."""

import os
import shutil
import subprocess

import grpc
import pytest
from support.kv_pools import make_pool

from splitserve.client import Client
from splitserve.launcher import ClusterSpec, LocalCluster
from splitserve.transfer import Endpoint, local_endpoint
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc


def _why_not() -> str | None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "making UTS namespaces needs root and util-linux's unshare"
    probe = subprocess.run(["unshare", "--uts", "hostname", "probe"], capture_output=True)
    return None if probe.returncode == 0 else f"unshare --uts failed: {probe.stderr[-200:]!r}"


pytestmark = pytest.mark.skipif((_reason := _why_not()) is not None, reason=_reason or "")


def _stats(address: str):
    with grpc.insecure_channel(address) as channel:
        stub = nodes_pb2_grpc.NodeStatsServiceStub(channel)
        return stub.GetStats(nodes_pb2.GetStatsRequest(), timeout=10)


def _outputs(node_hostnames: bool, kv_transfer: str, prompts) -> tuple[list, object]:
    from splitserve.models.tiny import ensure_tiny_model

    spec = ClusterSpec(
        model_path=str(ensure_tiny_model()),
        prefix_index=False,
        node_hostnames=node_hostnames,
        node_args=("--kv-transfer", kv_transfer),
        port=0,  # the router binds a free one (a port picked here could be taken first)
    )
    with LocalCluster(spec) as cluster, Client(cluster.addresses.router) as client:
        got = [
            list(client.generate(prompt_token_ids=p, max_tokens=6, temperature=0.0).token_ids)
            for p in prompts
        ]
        return got, _stats(cluster.addresses.decode[0])


def test_nodes_with_their_own_host_names_know_they_share_a_kernel():
    prompts = [[(3 * i + j) % 250 + 1 for j in range(30 + 11 * i)] for i in range(3)]
    got, stats = _outputs(True, "dist", prompts)
    offered = Endpoint.from_bytes(stats.transfer_endpoint)
    here = local_endpoint("test", make_pool(4))
    assert offered.hostname == "decode-0" != here.hostname  # its own host name...
    assert offered.same_host(here)  # ...on this kernel
    assert stats.counters["transfers_dist"] == len(prompts)  # KV moved by gloo, not as bytes
    expected, _ = _outputs(False, "none", prompts)
    assert got == expected
