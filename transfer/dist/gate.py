"""The dist rendezvous' front door when the cluster has a token: torch's ``TCPStore`` has no
authentication, so the receiver's store listens on loopback only and this gate, on the advertised
address, lets a connection through to it only once the peer proved it holds the cluster's
rendezvous key (``security.rendezvous_key``, derived from the token). A stranger's bytes never
reach the store: the gate closes its connection, and the pairs built through it carry on.

Every connection, before one byte is spliced (gate G, client C, key K, HMAC-SHA256)::

    G → C   "SSRZ" | version u16 | nonce_g (32 random bytes)
    C → G   nonce_c (32 random bytes) | HMAC(K, "client" | nonce_g | nonce_c)
    G → C   HMAC(K, "gate" | nonce_g | nonce_c)

then G splices the connection to the store on loopback. A fresh ``nonce_g`` per connection makes
a recorded answer useless; the gate's own proof tells the client it reached the cluster's store.
The client side (``open_tunnel``) does this on its own connection and then offers the spliced
connection to its process's ``TCPStore`` client on a one-shot loopback listener (the store
client speaks only its own protocol), which takes the first connection that comes from this
process. Bounded: ``max_pending`` connections in the handshake (``handshake_timeout`` each),
``max_tunnels`` spliced; beyond them a connection is closed at once.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import secrets
import socket
import struct
import threading
import time
from pathlib import Path

from splitserve.transfer.errors import PeerLost
from splitserve.transfer.security import RefusalLog, listen

logger = logging.getLogger("splitserve.transfer.dist")

MAGIC = b"SSRZ"
VERSION = 1
HELLO = struct.Struct("!4sH32s")
NONCE_LEN = MAC_LEN = 32


def _mac(key: bytes, side: bytes, nonce_g: bytes, nonce_c: bytes) -> bytes:
    return hmac.new(key, side + nonce_g + nonce_c, "sha256").digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        got = sock.recv(n - len(data))
        if not got:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += got
    return bytes(data)


class Gate:
    """Listens on ``host:port`` (0: any free port; ``.port``) and splices every connection that
    proves ``key`` to the store at ``127.0.0.1:store_port``."""

    def __init__(
        self,
        host: str,
        port: int,
        key: bytes,
        store_port: int,
        *,
        handshake_timeout: float = 5.0,
        max_pending: int = 64,
        max_tunnels: int = 256,
    ) -> None:
        self.key, self.store_port = key, store_port
        self.handshake_timeout = handshake_timeout
        self.max_pending, self.max_tunnels = max_pending, max_tunnels
        self._listener = listen(host, port)
        self.port = int(self._listener.getsockname()[1])
        self._pending = self._tunnels = 0
        self._refusals = RefusalLog(logger, "rendezvous gate")
        self._mu = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._accept_loop, name="kv-rendezvous-gate", daemon=True).start()

    def shutdown(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError as exc:
                if self._stop.is_set():
                    return
                logger.warning("rendezvous gate: accept failed (%s); retrying", exc)
                time.sleep(0.1)
                continue
            with self._mu:
                full = self._pending >= self.max_pending or self._tunnels >= self.max_tunnels
                if not full:
                    self._pending += 1
            if full:
                self._refuse(conn, peer, "too many connections")
                continue
            try:
                threading.Thread(target=self._admit, args=(conn, peer), daemon=True).start()
            except RuntimeError:  # no thread to be had
                with self._mu:
                    self._pending -= 1
                self._refuse(conn, peer, "no thread to serve it")

    def _admit(self, conn: socket.socket, peer: object) -> None:
        store = None
        try:
            conn.settimeout(self.handshake_timeout)
            nonce_g = secrets.token_bytes(NONCE_LEN)
            conn.sendall(HELLO.pack(MAGIC, VERSION, nonce_g))
            answer = _recv_exact(conn, NONCE_LEN + MAC_LEN)
            nonce_c, mac = answer[:NONCE_LEN], answer[NONCE_LEN:]
            if not hmac.compare_digest(mac, _mac(self.key, b"client", nonce_g, nonce_c)):
                raise PermissionError("it does not hold the cluster token")
            conn.sendall(_mac(self.key, b"gate", nonce_g, nonce_c))
            store = socket.create_connection(("127.0.0.1", self.store_port), timeout=5.0)
        except (OSError, ValueError) as exc:  # PermissionError, timeouts, resets: OSErrors
            with self._mu:
                self._pending -= 1
            if store is not None:
                _close(store)
            self._refuse(conn, peer, str(exc) or type(exc).__name__)
            return
        with self._mu:
            self._pending -= 1
            self._tunnels += 1
        try:
            # NOTE: no timeout from here on: a store client may stay silent for the pair's life.
            conn.settimeout(None)
            store.settimeout(None)
            splice(conn, store)
        finally:
            with self._mu:
                self._tunnels -= 1

    def _refuse(self, conn: socket.socket, peer: object, why: str) -> None:
        _close(conn)
        self._refusals.refused(peer, why)


def open_tunnel(host: str, port: int, key: bytes, timeout: float) -> int:
    """Prove ``key`` to the gate at ``host:port`` and return the port of a one-shot loopback
    listener whose first connection from this process is spliced to the receiver's store (point
    this process's ``TCPStore`` client at ``127.0.0.1`` and it). ``PeerLost`` if the gate cannot
    be reached, refuses the key or does not prove it holds the key itself."""
    where = f"{host}:{port}"
    try:
        gate = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise PeerLost(f"cannot reach the rendezvous at {where}: {exc}") from None
    try:
        magic, version, nonce_g = HELLO.unpack(_recv_exact(gate, HELLO.size))
        if (magic, version) != (MAGIC, VERSION):
            raise PeerLost(f"{where} is not a splitserve rendezvous gate")
        nonce_c = secrets.token_bytes(NONCE_LEN)
        gate.sendall(nonce_c + _mac(key, b"client", nonce_g, nonce_c))
        try:
            proof = _recv_exact(gate, MAC_LEN)
        except ConnectionError:
            raise PeerLost(f"the rendezvous at {where} refused this node's cluster token") from None
        if not hmac.compare_digest(proof, _mac(key, b"gate", nonce_g, nonce_c)):
            raise PeerLost(f"the rendezvous at {where} does not hold this cluster's token")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
    except PeerLost:
        _close(gate)
        raise
    except OSError as exc:
        _close(gate)
        raise PeerLost(f"rendezvous handshake with {where} failed: {exc}") from None
    gate.settimeout(None)
    threading.Thread(
        target=_hand_over, args=(listener, gate, timeout), name="kv-rendezvous-tunnel", daemon=True
    ).start()
    return int(listener.getsockname()[1])


def _hand_over(listener: socket.socket, gate: socket.socket, timeout: float) -> None:
    """Splice the listener's first connection from this process to ``gate``; close everything
    if none comes within ``timeout``."""
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            listener.settimeout(left)
            try:
                conn, _ = listener.accept()
            except OSError:
                break
            if _from_this_process(conn):
                _close(listener)
                conn.settimeout(None)
                splice(conn, gate)
                return
            logger.warning("rendezvous tunnel: dropped a connection from another process")
            _close(conn)
    finally:
        _close(listener)
    _close(gate)


def _from_this_process(conn: socket.socket) -> bool:
    """Whether the loopback connection ``conn`` was opened by a socket of this process (Linux:
    its inode among our descriptors); True where procfs cannot tell."""
    try:
        peer_port, our_port = conn.getpeername()[1], conn.getsockname()[1]
        # NOTE: both tables: torch's store client connects from an IPv6 socket (v4-mapped).
        rows = [row for table in ("tcp", "tcp6") for row in _proc_rows(Path("/proc/net") / table)]
    except OSError:
        return True
    local, remote = f":{peer_port:04X}", f":{our_port:04X}"
    inodes = {
        f"socket:[{cols[9]}]"
        for cols in (row.split() for row in rows)
        if len(cols) > 9 and cols[1].endswith(local) and cols[2].endswith(remote)
    }
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") in inodes:
                return True
    return False


def _proc_rows(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()[1:]
    except FileNotFoundError:  # no IPv6 here
        return []


def splice(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways between ``a`` and ``b`` until either side ends (this thread and one
    more), then close both."""
    done = threading.Event()
    other = threading.Thread(target=_pump, args=(b, a, done), daemon=True)
    other.start()
    _pump(a, b, done)
    other.join()
    _close(a)
    _close(b)


def _pump(src: socket.socket, dst: socket.socket, done: threading.Event) -> None:
    try:
        while not done.is_set():
            data = src.recv(1 << 16)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        done.set()
        for sock in (src, dst):  # wake the other direction's recv
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
