"""Test certificates made with the openssl CLI: a CA and one certificate it signs, for 127.0.0.1
and localhost, as server and client (what every component of a test cluster presents). Used by
the TLS tests and by benchmarks/transfer.py's ``--tls`` (as ``support.pki``, tests/ on
``sys.path``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

HAVE_OPENSSL = shutil.which("openssl") is not None


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(folder: Path, name: str = "ca") -> dict[str, str]:
    """A CA named ``name`` and one certificate it signs, valid for 127.0.0.1 and localhost, as
    server and client: {"ca", "cert", "key"} paths."""
    folder.mkdir(parents=True, exist_ok=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", f"/CN={name}", cwd=folder)  # fmt: skip
    _openssl("req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=node",
             cwd=folder)  # fmt: skip
    (folder / "ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    _openssl("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "node.pem", "-days", "2", "-extfile", "ext",
             cwd=folder)  # fmt: skip
    return {k: str(folder / f) for k, f in (("ca", "ca.pem"), ("cert", "node.pem"),
                                            ("key", "node.key"))}  # fmt: skip


def tls_triple(pki: dict[str, str]) -> tuple[str, str, str]:
    """(cert, key, ca): ``transfer.KVTls``'s arguments."""
    return pki["cert"], pki["key"], pki["ca"]
