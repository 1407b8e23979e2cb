"""Cross-host path: torch.distributed point-to-point in a two-rank group per (receiver, sender).

No global world: every pair gets its own group, built directly from a ``(store, rank, size=2)``
triple (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on CUDA), on demand, and torn down by
``close(peer)`` or the first failure. Nothing calls ``init_process_group``.

Rendezvous. The receiver (decode node) hosts a ``TCPStore`` and advertises its address. A sender
(prefill node) connects as a store client, takes a join number ``n`` (``add``), announces itself
under ``join/n`` (node id, backend, block layout) and waits for ``ack/n``; the receiver's accept
thread checks the layout, acks, and both sides construct the group on ``PrefixStore("pair/n/")``,
receiver rank 0, sender rank 1. The receiver registers the pair's channel, then sets ``ready/n``;
``connect`` returns after it. ``n`` is the channel's generation: a sender that reconnects gets a
new one, which replaces (and fails) the old channel on both sides.

One transfer. The receiver reserves destination ids (``reserve``: a ``Reservation`` whose ticket
carries ``(gen, seq, block ids)``); the sender gathers its source blocks into one buffer and
sends a header ``[magic, gen, seq, n, block elements, element size]`` then the buffer. The
receiver's ``receive`` receives a header then the data into a staging buffer, and only once the
whole buffer has arrived scatters it into the reservation named by the header's ``seq``
(``index_copy_``; CUDA: synchronized) and ends it. Concurrent transfers on one pair are fine: the
sender sends header+data of one transfer at a time, and receivers waiting on the same channel take
turns receiving whatever comes next and completing the reservation it names; data for a
reservation that ended meanwhile (cancelled, timed out) is received and dropped.

Failures. Every wait has a deadline (``Work.wait(timeout)``; gloo's recv honours it). A sender
killed mid-transfer breaks the connection (``PeerLost``) or stops sending (``TransferTimeout``);
either way the staging buffer is dropped, the pool is untouched, the channel is torn down on this
side and every outstanding reservation on it fails. The next ``connect`` builds a new group.

Modules: ``dist_group`` (backends, the pair group, rendezvous store addresses), ``dist_channel``
(one pair's channel and the header framing), ``dist_receiver`` and ``dist_sender`` (the two
sides). This module re-exports them under the names they had when the path was one file.
"""

from splitserve.transfer.dist_channel import (
    HEADER_LEN,
    MAGIC,
    TAG_DATA,
    TAG_HEADER,
    Channel,
    first_line,
    header,
)
from splitserve.transfer.dist_group import (
    KEY,
    POLL_S,
    check_backend,
    default_backend,
    default_host,
    local_address_towards,
    make_pair_group,
    prepare_backend,
    store_client,
)
from splitserve.transfer.dist_receiver import DistReceiver
from splitserve.transfer.dist_sender import DistSender

# The former private names: transfer.testing frames a header by hand with ``_header``.
_Channel = Channel
_header = header
_first_line = first_line
_client = store_client
_check_backend = check_backend
_local_address_towards = local_address_towards
_POLL_S = POLL_S

__all__ = [
    "HEADER_LEN",
    "KEY",
    "MAGIC",
    "TAG_DATA",
    "TAG_HEADER",
    "DistReceiver",
    "DistSender",
    "default_backend",
    "default_host",
    "make_pair_group",
    "prepare_backend",
]
