"""The tcp path's wire format: raw TCP between a sender and a receiver's listener.

A connection carries chunks, one after the other, from the sender; the receiver answers each
with an ack. A chunk is a fixed header then layers ``[lo, hi)`` of ``count`` blocks of raw pool
bytes (block-major: each block's layers in a row; ``hi`` = ``ALL_LAYERS``: every layer)::

    magic "SSKV" | version u16 | token 16 bytes | first u32 | count u32 | lo u16 | hi u16
        | crc32 u32 | data

``token`` names the reservation (its ticket's random token: only the holder of the ticket can
write into it), ``first``/``count`` the blocks of the reservation the data fills (positions in
its block ids, so the receiver never trusts an id from the wire), ``lo``/``hi`` the layers (a
layer-wise stream sends each block's layers as its prefill writes them; every (block, layer) is
sent exactly once, and the reservation is complete when all are in), ``crc32`` is zlib's CRC-32 of
the data (computed in C over the whole chunk, outside the GIL; inside TLS it is 0 and not
checked: the AEAD tag of every TLS record checks the data). An ack is ``status u8 | length u16
| message``: ``OK`` or ``REFUSED`` with a message; after a refusal the receiver closes the
connection (the data that followed a bad header cannot be skipped safely).

Inside TLS (``security.KVTls``) the same chunks and acks travel in TLS 1.3 records, after one
``OK`` ack by which the listener says it accepted the sender's certificate.
"""

from __future__ import annotations

import socket
import struct
import zlib

MAGIC = b"SSKV"
VERSION = 2  # 2: the layer range (1 had whole blocks only)
TOKEN_LEN = 16
ALL_LAYERS = 0xFFFF  # as ``hi``: every layer of the pool
CHUNK = struct.Struct("!4sH16sIIHHI")
ACK = struct.Struct("!BH")
OK = 0
REFUSED = 1
MAX_MESSAGE = 1024


class WireError(Exception):
    """The peer closed the connection, broke the protocol, or refused a chunk."""


class PeerClosed(WireError):
    """The peer closed the connection (it exited, or dropped us) without an answer."""


def checksum(view: memoryview) -> int:
    return zlib.crc32(view)


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``; False if the peer closed before the first byte, WireError if
    it closed part-way."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0:
                return False
            raise PeerClosed(f"connection closed after {got} of {len(view)} bytes")
        got += n
    return True


def pack_chunk(
    token: bytes, first: int, count: int, crc: int, lo: int = 0, hi: int = ALL_LAYERS
) -> bytes:
    return CHUNK.pack(MAGIC, VERSION, token, first, count, lo, hi, crc)


def unpack_chunk(header: bytes) -> tuple[bytes, int, int, int, int, int]:
    """(token, first, count, lo, hi, crc) of a chunk header; WireError on a wrong magic or
    version."""
    magic, version, token, first, count, lo, hi, crc = CHUNK.unpack(header)
    if magic != MAGIC:
        raise WireError("not a splitserve KV stream (bad magic)")
    if version != VERSION:
        raise WireError(f"unsupported KV stream version {version} (this node speaks {VERSION})")
    return token, first, count, lo, hi, crc


def send_ack(sock: socket.socket, status: int, message: str = "") -> None:
    text = message.encode()[:MAX_MESSAGE]
    sock.sendall(ACK.pack(status, len(text)) + text)


def read_ack(sock: socket.socket) -> None:
    """Read one ack: return on OK, WireError with the receiver's message otherwise."""
    head = bytearray(ACK.size)
    if not recv_exact(sock, memoryview(head)):
        raise PeerClosed("the receiver closed the connection")
    status, length = ACK.unpack(head)
    if length > MAX_MESSAGE:
        raise WireError("malformed ack")
    text = bytearray(length)
    if length and not recv_exact(sock, memoryview(text)):
        raise PeerClosed("the receiver closed the connection")
    if status != OK:
        raise WireError(f"the receiver refused the data: {text.decode(errors='replace')}")
