"""Errors of the transfer layer: every failure of a transfer is a ``TransferError``."""

from __future__ import annotations


class TransferError(RuntimeError):
    """A transfer failed; nothing was committed (the receiver's reservation is not complete)."""


class TransferTimeout(TransferError, TimeoutError):
    """The peer did not complete its side of a transfer in time."""


class PeerLost(TransferError):
    """The connection to the peer broke (the peer exited or the network failed)."""


class ChannelClosed(TransferError):
    """The pair's channel was closed (``close(peer)``, a reconnect, or an earlier failure)."""


class NotConnected(TransferError):
    """No channel to that peer: connect first (or use the grpc path)."""


class Incomplete(TransferError):
    """The sender said it finished, but not every block it was to fill has arrived (a sender that
    broke the protocol: the services answer INVALID_ARGUMENT)."""


class StreamFailed(TransferError):
    """A layer-wise stream cannot complete: its request ended without its prefill (aborted,
    preempted, did not fit), or a piece failed to send."""
