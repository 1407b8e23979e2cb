"""What guards a node's KV byte paths: mutual TLS on the tcp path, whether the network between
nodes is trusted with plaintext (dist), and the key that opens the dist rendezvous.

One ``KVSecurity`` per node, built at its start from its ``--tls-*`` files, ``--trust-kv-network``
and cluster token (``runtime.node.kv_spec``; built in ``engine.local``), passed to
``open_receiver`` / ``open_sender``.
Which paths that leaves a node is ``chooser.secured_paths``; the tcp path wraps its connections in
``KVTls``'s contexts; the dist path's rendezvous gate (``dist.gate``) proves ``rendezvous_key``.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass


class KVTls:
    """TLS 1.3 contexts for the tcp path from a node's PEM files (its ``--tls-cert``,
    ``--tls-key``, ``--tls-ca``): the listener presents the certificate and requires a client
    certificate signed by the CA; a sender presents the same certificate and checks the
    listener's against the CA and against the address it dialled (host name or IP in the
    subject alternative names), as the node's gRPC channels do."""

    __slots__ = ("client", "server")

    def __init__(self, cert: str, key: str, ca: str) -> None:
        _log_ktls_once()
        self.server = _context(ssl.PROTOCOL_TLS_SERVER, cert, key, ca)
        # NOTE: no session tickets: each kept connection does one full handshake, and a ticket
        # arriving on an idle connection would read as the listener having closed it.
        self.server.num_tickets = 0
        self.client = _context(ssl.PROTOCOL_TLS_CLIENT, cert, key, ca)


def _context(protocol: int, cert: str, key: str, ca: str) -> ssl.SSLContext:
    """A TLS 1.3-only context with mutual verification; ``ValueError`` naming the file at fault."""
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    # Kernel TLS where Python's ssl offers it (3.12+) and the kernel's tls module is loaded:
    # OpenSSL then hands the record encryption to the kernel (sendfile-like writes, no copy
    # through the interpreter); elsewhere the option is absent or ignored and TLS runs as before.
    ctx.options |= getattr(ssl, "OP_ENABLE_KTLS", 0)
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        why = f"not a usable certificate and key ({exc})"
        raise ValueError(f"--tls-cert {cert} / --tls-key {key}: {why}") from None
    try:
        ctx.load_verify_locations(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--tls-ca {ca}: not a usable CA file ({exc})") from None
    return ctx


def ktls_status() -> str:
    """Whether the tcp path's TLS can run in the kernel here, and if not why (for the log)."""
    if not getattr(ssl, "OP_ENABLE_KTLS", 0):
        return "not available: this Python's ssl has no OP_ENABLE_KTLS (Python 3.12+)"
    try:
        with open("/proc/modules") as f:
            loaded = any(line.split(" ", 1)[0] == "tls" for line in f)
    except OSError:
        loaded = False
    if not loaded and not os.path.isdir("/sys/module/tls"):
        return "requested, but the kernel's tls module is not loaded (modprobe tls on the host)"
    return "requested (the kernel's tls module is loaded)"


_ktls_logged = threading.Event()


def _log_ktls_once() -> None:
    if not _ktls_logged.is_set():
        _ktls_logged.set()
        logging.getLogger("splitserve.transfer.tcp").info(
            "tcp path TLS: kernel TLS %s", ktls_status()
        )


def rendezvous_key(token: str) -> bytes:
    """The key the dist rendezvous gate and its clients prove, derived from the cluster token
    (so the token itself never goes near the store's port)."""
    return hmac.new(token.encode(), b"splitserve dist rendezvous v1", "sha256").digest()


@dataclass(frozen=True, slots=True)
class KVSecurity:
    """A node's KV byte paths' guards (the default: none, every path as before)."""

    tls: KVTls | None = None  # mutual TLS on the tcp path (the node has --tls-* files)
    trust_network: bool = False  # --trust-kv-network: plaintext dist between nodes even with TLS
    rendezvous_key: bytes | None = None  # the cluster token's: the dist store's gate requires it

    @property
    def plaintext_allowed(self) -> bool:
        """Whether KV may cross the network unencrypted (the dist path): without TLS (nothing is
        encrypted then), or where the cluster says its KV network is trusted."""
        return self.tls is None or self.trust_network

    @property
    def unauthenticated_allowed(self) -> bool:
        """Whether a path whose peers are not authenticated at all may carry KV (nixl: UCX
        accepts a write from any agent that learned the receiver's metadata): only where the
        cluster has no token to check (no ``--auth-token-file``) and no TLS, or where it says
        its KV network is trusted."""
        return self.trust_network or (self.tls is None and self.rendezvous_key is None)


class RefusalLog:
    """Logs refused connections at most once per ``every_s`` seconds, with how many were refused
    meanwhile: a port scanner or a flood must not flood the log (nor hide that it happens)."""

    def __init__(self, logger: logging.Logger, what: str, every_s: float = 10.0) -> None:
        self.logger, self.what, self.every_s = logger, what, every_s
        self._since = 0
        self._logged_at = -every_s
        self._mu = threading.Lock()

    def refused(self, peer: object, why: str) -> None:
        now = time.monotonic()
        with self._mu:
            self._since += 1
            if now - self._logged_at < self.every_s:
                return
            count, self._since, self._logged_at = self._since, 0, now
        more = f"; {count - 1} more refused since the last line" if count > 1 else ""
        self.logger.warning("%s: refused %s (%s)%s", self.what, peer, why, more)


def listen(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0: any free port), IPv6 for an IPv6 host: the
    KV listeners' own (the tcp path's, the rendezvous gate's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return sock
