"""One gRPC channel per peer address, shared by the shipper and the peer-fetch client; at most
MAX_CHANNELS, the least recently used closed beyond that (addresses come from requests)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import grpc

from splitserve.runtime import tls
from splitserve.runtime.server import CHANNEL_OPTIONS

MAX_CHANNELS = 256
CLOSE_GRACE_S = 30.0  # calls still running on an evicted channel get this long


class Channels:
    def __init__(self, max_channels: int = MAX_CHANNELS) -> None:
        self._channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()
        self._max = max_channels
        self._closing: set[asyncio.Task] = set()

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is not None:
            self._channels.move_to_end(address)
            return channel
        channel = self._channels[address] = tls.channel(address, options=CHANNEL_OPTIONS)
        while len(self._channels) > self._max:
            _, oldest = self._channels.popitem(last=False)
            task = asyncio.ensure_future(oldest.close(CLOSE_GRACE_S))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return channel

    def __len__(self) -> int:
        return len(self._channels)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
