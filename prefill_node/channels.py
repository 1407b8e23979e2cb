"""One gRPC channel per peer address, shared by the shipper and the peer-fetch client."""

from __future__ import annotations

import grpc

from splitserve.runtime.server import CHANNEL_OPTIONS


class Channels:
    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(
                address, options=CHANNEL_OPTIONS
            )
        return channel

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
