"""How fast Python's ssl moves bytes over loopback, without the KV path around it.

    python benchmarks/tls_loopback.py --pki DIR [--threads 1 2 4 8] [--mib 512]

DIR holds ca.pem, node.pem and node.key (``tests/support/pki.py`` makes them). For each thread
count, that many connections run side by side, each moving ``--mib`` MiB in 16 MiB ``sendall``
calls into a ``recv_into`` loop (the tcp KV path's pattern), in mutual TLS 1.3 and in plaintext.
It tells apart a per-core limit (TLS GB/s growing with threads) from one that serialises the
threads (flat).
"""

from __future__ import annotations

import argparse
import socket
import ssl
import threading
import time
from pathlib import Path

CHUNK = 16 << 20


def contexts(pki: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    for ctx in (server, client):
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(pki / "node.pem", pki / "node.key")
        ctx.load_verify_locations(pki / "ca.pem")
        ctx.verify_mode = ssl.CERT_REQUIRED
    return server, client


def one_pair(tls: tuple[ssl.SSLContext, ssl.SSLContext] | None, nbytes: int, done: list) -> None:
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]

    def receive() -> None:
        conn, _ = lsock.accept()
        if tls is not None:
            conn = tls[0].wrap_socket(conn, server_side=True)
        buf = bytearray(CHUNK)
        view, got = memoryview(buf), 0
        while got < nbytes:
            n = conn.recv_into(view, CHUNK)
            if not n:
                break
            got += n
        done.append(got)
        conn.close()

    rx = threading.Thread(target=receive)
    rx.start()
    sock = socket.create_connection(("127.0.0.1", port))
    if tls is not None:
        sock = tls[1].wrap_socket(sock, server_hostname="127.0.0.1")
    data = bytes(CHUNK)
    for _ in range(nbytes // CHUNK):
        sock.sendall(data)
    rx.join()
    sock.close()
    lsock.close()


def run(tls, threads: int, nbytes: int) -> float:
    done: list[int] = []
    workers = [threading.Thread(target=one_pair, args=(tls, nbytes, done)) for _ in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    assert sum(done) == threads * nbytes, (sum(done), threads * nbytes)
    return threads * nbytes / wall / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pki", required=True, type=Path)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--mib", type=int, default=512)
    args = ap.parse_args()
    tls = contexts(args.pki)
    nbytes = args.mib << 20
    print(f"ssl: {ssl.OPENSSL_VERSION}")
    print("| connections | plaintext GB/s | TLS GB/s |")
    print("|---:|---:|---:|")
    for t in args.threads:
        plain = run(None, t, nbytes)
        secure = run(tls, t, nbytes)
        print(f"| {t} | {plain:.2f} | {secure:.2f} |", flush=True)


if __name__ == "__main__":
    main()
