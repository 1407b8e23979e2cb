"""The prefill node's channel cache is bounded: addresses come from requests, so a stream of new
ones must not grow it without end (prefill_node/channels.py)."""

import asyncio

from splitserve.prefill_node.channels import Channels


def test_the_least_recently_used_channel_is_closed_beyond_the_cap():
    async def run():
        channels = Channels(max_channels=3)
        first = channels.get("127.0.0.1:1")
        for port in range(2, 40):
            channels.get(f"127.0.0.1:{port}")
            channels.get("127.0.0.1:1")  # kept in use: never the least recent
        assert len(channels) == 3
        assert channels.get("127.0.0.1:1") is first
        await channels.close()
        assert len(channels) == 0

    asyncio.run(run())
