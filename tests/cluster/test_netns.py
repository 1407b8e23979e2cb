"""Nodes as in separate containers of one host, on CPU: the prefill and the decode node each in a
network namespace and a UTS namespace of its own (own host name, own address on a bridge, one
kernel), the router in this one. Each pair's KV path is read from the nodes' counters — gloo
``dist`` with the defaults, the raw ``tcp`` path when only it is allowed — and the greedy output
is token-exact with transformers on both. Skipped where network namespaces cannot be made (needs
root, iproute2's ``ip`` and util-linux's ``unshare``); tests/cluster/test_node_hostnames.py covers
the host-name half without root networking, tests/cluster/test_transfer_tcp.py the tcp path on
loopback."""

from __future__ import annotations

import os
import random
import shutil
import subprocess

import pytest
from support.kv_pools import make_pool
from support.processes import node_stats, start_cli, start_router
from support.reference import hf_greedy

from splitserve.client import Client
from splitserve.models.tiny import write_random_checkpoint
from splitserve.transfer import Endpoint, local_endpoint

SUBNET = "10.213.57"  # bridge .1 (this namespace), nodes .2, .3
TAG = f"ss{os.getpid() % 100000}"


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def _why_not() -> str | None:
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("unshare")):
        return "making network namespaces needs root, iproute2 (ip) and util-linux (unshare)"
    probe = _run("ip", "netns", "add", f"{TAG}probe")
    if probe.returncode != 0:
        return f"ip netns add failed: {probe.stderr.strip()[-200:]}"
    _run("ip", "netns", "del", f"{TAG}probe")
    return None


pytestmark = pytest.mark.skipif((_reason := _why_not()) is not None, reason=_reason or "")


def _check(*cmd: str) -> None:
    done = _run(*cmd)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")


@pytest.fixture(scope="module")
def bridge():
    """A bridge here and two namespaces on it; yields {name: (namespace, address)}."""
    br = f"{TAG}br"
    hosts = {"prefill-host": (f"{TAG}a", f"{SUBNET}.2"), "decode-host": (f"{TAG}b", f"{SUBNET}.3")}
    try:
        _check("ip", "link", "add", br, "type", "bridge")
        _check("ip", "addr", "add", f"{SUBNET}.1/24", "dev", br)
        _check("ip", "link", "set", br, "up")
        for i, (ns, address) in enumerate(hosts.values()):
            outer, inner = f"{TAG}v{i}", f"{TAG}p{i}"
            _check("ip", "netns", "add", ns)
            _check("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            _check("ip", "link", "set", inner, "netns", ns)
            _check("ip", "link", "set", outer, "master", br)
            _check("ip", "link", "set", outer, "up")
            _check("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", inner)
            _check("ip", "-n", ns, "link", "set", inner, "up")
            _check("ip", "-n", ns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for ns, _ in hosts.values():
            _run("ip", "netns", "del", ns)  # takes its veth end, and so the pair, with it
        _run("ip", "link", "del", br)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_checkpoint(
        tmp_path_factory.mktemp("netns") / "m", seed=5, with_tokenizer=True, num_hidden_layers=2
    )


def _start_in(hosts, name: str, role: str, model, tmp, kv_transfer: str):
    ns, address = hosts[name]
    prefix = ("ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
              f'hostname {name} && exec "$@"', "sh")  # fmt: skip
    args = [role, "--model", str(model), "--kv-cache-mb", "64", "--host", address,
            "--kv-transfer", kv_transfer]  # fmt: skip
    return start_cli(role, args, tmp, prefix=prefix, host=address)


@pytest.mark.parametrize(("kv_transfer", "path"), [("ipc,dist,tcp", "dist"), ("tcp", "tcp")])
def test_nodes_in_their_own_namespaces_pick_a_path_and_stay_token_exact(
    bridge, model_dir, tmp_path, kv_transfer, path
):
    prefill = _start_in(bridge, "prefill-host", "prefill", model_dir, tmp_path, kv_transfer)
    decode = _start_in(bridge, "decode-host", "decode", model_dir, tmp_path, kv_transfer)
    router = start_router(model_dir, tmp_path, [prefill.address], [decode.address])
    try:
        offered = Endpoint.from_bytes(node_stats(decode).transfer_endpoint)
        assert offered.hostname == "decode-host"
        assert offered.same_host(local_endpoint("here", make_pool(4)))  # one kernel
        rng = random.Random(1)
        prompts = [[rng.randrange(256) for _ in range(n)] for n in (21, 48, 70)]
        with Client(router.address) as client:
            # A first request sets the pair's path up (it may ship as bytes while that runs).
            client.generate(prompt_token_ids=[1, 2, 3], max_tokens=1, temperature=0.0)
            before = node_stats(decode).counters
            for prompt in prompts:
                out = client.generate(
                    prompt_token_ids=prompt, max_tokens=5, temperature=0.0, ignore_eos=True
                )
                assert list(out.token_ids) == hf_greedy(model_dir, prompt, 5)
        after = node_stats(decode).counters
        moved = {k: after[k] - before.get(k, 0) for k in after if k.startswith("transfers")}
        assert moved[f"transfers_{path}"] == moved["transfers"] == len(prompts), moved
    finally:
        for proc in (router, prefill, decode):
            proc.stop()
