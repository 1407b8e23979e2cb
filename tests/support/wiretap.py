"""A recording TCP relay for tests: listens on loopback, forwards every connection to a target
and keeps every byte that passed in each direction (what someone on the wire would read)."""

from __future__ import annotations

import contextlib
import socket
import threading


class Wiretap:
    """``Wiretap((host, port))``: connect to ``127.0.0.1:.port`` instead of the target;
    ``.upstream`` holds what clients sent, ``.downstream`` what the target answered."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.upstream = bytearray()
        self.downstream = bytearray()
        self.connections = 0
        self._mu = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target, timeout=10)
            server.settimeout(None)
            with self._mu:
                self.connections += 1
            for src, dst, log in (
                (client, server, self.upstream),
                (server, client, self.downstream),
            ):
                threading.Thread(target=self._pump, args=(src, dst, log), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, log: bytearray) -> None:
        try:
            while data := src.recv(1 << 16):
                with self._mu:
                    log += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def captured(self) -> bytes:
        with self._mu:
            return bytes(self.upstream) + bytes(self.downstream)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()
