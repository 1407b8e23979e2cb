"""The transfer interface's contract (tests/support/transfer_contract.py) on the CPU paths that
need sockets: tcp (this process's listener), dist (gloo, a pair group between two threads of
this process, its store on loopback) and nixl (two NIXL agents of this process over UCX; skipped,
saying so, where NIXL is not installed: `pip install 'splitserve[nixl]'`), each as a node's
receiver/sender and as the path's own sides. No process is started. The byte path and a path
added behind the interface: tests/unit/test_transfer_contract.py."""

from __future__ import annotations

import pytest
from support.kv_pools import fill_pool, make_pool
from support.transfer_common import RECEIVER_SEED, SENDER_SEED, SPEC
from support.transfer_contract import *  # noqa: F403 (the contract's tests)
from support.transfer_contract import RECEIVER_ID, SENDER_ID, Rig

from splitserve.transfer import DIST, NIXL, TCP, PathOptions, nixl, open_receiver, open_sender
from splitserve.transfer.dist import DistReceiver, DistSender
from splitserve.transfer.reservation import block_nbytes
from splitserve.transfer.tcp import TcpReceiver, TcpSender

HOST = "127.0.0.1"


def _rig(path: str, node: bool) -> Rig:
    pool = fill_pool(make_pool(**SPEC), RECEIVER_SEED)
    source = fill_pool(make_pool(**SPEC), SENDER_SEED)
    # tcp: 3-block chunks over 2 connections, so a transfer is several chunks.
    tcp = dict(streams=2, chunk_bytes=3 * block_nbytes(pool))
    if node:
        rx = open_receiver(pool, RECEIVER_ID, paths=(path,), host=HOST, connect_timeout=60.0)
        tx = open_sender(source, SENDER_ID, paths=(path,), connect_timeout=60.0, tcp_options=tcp)
    else:
        options = PathOptions(host=HOST, connect_timeout=60.0, tcp_options=tcp)
        receiver, sender = {
            DIST: (DistReceiver, DistSender),
            TCP: (TcpReceiver, TcpSender),
            NIXL: (nixl.NixlReceiver, nixl.NixlSender),
        }[path]
        rx, tx = receiver.open(pool, RECEIVER_ID, options), sender.open(source, SENDER_ID, options)
        assert rx is not None and tx is not None
    # nixl: the sender writes into this pool itself; only it can tell when the blocks are in.
    return Rig(path, rx, tx, pool, source, prefix=path != DIST, waits=path != NIXL)


@pytest.fixture(
    scope="module",
    params=["tcp-node", "tcp-sides", "dist-node", "dist-sides", "nixl-node", "nixl-sides"],
)
def rig(request):
    path, kind = request.param.split("-")
    if path == NIXL and not nixl.available():
        pytest.skip("NIXL is not installed here (pip install 'splitserve[nixl]')")
    rig = _rig(path, kind == "node")
    try:
        rig.connect()
        yield rig
    finally:
        rig.close()
