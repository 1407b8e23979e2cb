"""Mutual TLS on every gRPC port and channel of a process (``--tls-cert``, ``--tls-key``,
``--tls-ca``; all three or none): its server presents the certificate and requires a client
certificate signed by the CA; its channels to other components present the same certificate and
check theirs against the CA (and their host names / IP addresses against the certificates'
subject alternative names). One process, one identity: ``use_tls`` at start, then ``channel``
and ``server_credentials`` everywhere. The tcp KV path runs its own TLS with the same files
(``transfer.security.KVTls``); dist cannot, and is then used only where the network is trusted
(docs/security.md, "The KV byte paths").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert: bytes
    key: bytes
    ca: bytes

    @classmethod
    def load(cls, cert: str | None, key: str | None, ca: str | None) -> TlsFiles | None:
        """The three files' contents; None when none is given; ``ValueError`` saying what to fix
        when only some are, or one cannot be read."""
        given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
        if not any(given.values()):
            return None
        missing = [flag for flag, path in given.items() if not path]
        if missing:
            raise ValueError(f"mTLS needs --tls-cert, --tls-key and --tls-ca; missing {missing}")
        paths = {flag: path for flag, path in given.items() if path}  # all three, checked above
        data = {}
        for flag, path in paths.items():
            try:
                data[flag] = Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(f"{flag} {path}: cannot read it ({exc})") from None
            if b"-----BEGIN" not in data[flag]:
                raise ValueError(f"{flag} {path}: not a PEM file")
        return cls(data["--tls-cert"], data["--tls-key"], data["--tls-ca"])

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


_files: TlsFiles | None = None


def use_tls(files: TlsFiles | None) -> None:
    """This process's TLS identity for its channels (None: plaintext)."""
    global _files
    _files = files


def channel(address: str, options: Iterable[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """An asyncio channel to another component: mTLS when this process has an identity."""
    if _files is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, _files.channel_credentials(), options=list(options))


def sync_channel(
    address: str, files: TlsFiles | None = None, options: Iterable[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A blocking channel (health checks, tools): mTLS with ``files`` (default: this process's
    identity, if any)."""
    files = files or _files
    if files is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, files.channel_credentials(), options=list(options))
