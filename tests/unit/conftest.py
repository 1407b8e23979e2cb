"""tests/unit's rule, enforced: a test here starts no process and opens no socket.

Each test runs with process creation (``subprocess``, ``multiprocessing``, ``os.fork``), a
stream socket's ``connect`` and any ``listen``, and gRPC servers replaced by a failure naming what
was attempted; a test that needs one of them belongs in tests/cluster/ (or tests/containers/).
Asking the kernel for a free port (``bind`` to port 0, as ``free_port`` does) or for the route to
an address (a UDP ``connect``, as ``local_address_towards`` does) sends nothing and is allowed.
gRPC channels are not guarded: they connect lazily, so making one (as the channel cache's tests
do) opens nothing.
"""

from __future__ import annotations

import multiprocessing.process
import os
import socket
import subprocess

import grpc
import grpc.aio
import pytest


class LayerViolation(AssertionError):
    """A test in tests/unit tried to start a process or open a socket."""


def _refuse(what: str):
    def refused(*_args, **_kwargs):
        raise LayerViolation(
            f"tests/unit starts no process and opens no socket, and this test tried {what}: "
            "move it to tests/cluster/ (or tests/containers/)"
        )

    return refused


_stream_connect = socket.socket.connect
_stream_connect_ex = socket.socket.connect_ex


def _datagram_only(method, what: str):
    refused = _refuse(what)

    def connect(sock: socket.socket, *args, **kwargs):
        if sock.type == socket.SOCK_DGRAM:
            return method(sock, *args, **kwargs)
        return refused()

    return connect


GUARDED = [
    (subprocess.Popen, "__init__", "subprocess.Popen"),
    (multiprocessing.process.BaseProcess, "start", "multiprocessing's Process.start"),
    (os, "fork", "os.fork"),
    (os, "posix_spawn", "os.posix_spawn"),
    (socket.socket, "listen", "socket.listen"),
    (grpc, "server", "grpc.server"),
    (grpc.aio, "server", "grpc.aio.server"),
]


@pytest.fixture(autouse=True)
def _no_processes_no_sockets(monkeypatch):
    for owner, name, what in GUARDED:
        if hasattr(owner, name):
            monkeypatch.setattr(owner, name, _refuse(what))
    monkeypatch.setattr(
        socket.socket, "connect", _datagram_only(_stream_connect, "a stream socket's connect")
    )
    monkeypatch.setattr(
        socket.socket, "connect_ex", _datagram_only(_stream_connect_ex, "a stream socket's connect")
    )
