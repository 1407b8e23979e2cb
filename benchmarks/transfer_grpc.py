"""The grpc row of benchmarks/transfer.py: the services' byte path
(``transfer.grpc_bytes.codec`` messages over a loopback gRPC stream) from this process's pool
into a spawned receiver process's pool."""

from __future__ import annotations

import array
import asyncio
import random
import time

import torch
from support.kv_pools import block_checksums, fill_pool, make_pool
from transfer_cases import RECEIVER_SEED, SENDER_SEED, Case, pick_ids, verify

from splitserve.transfer import GRPC
from splitserve.transfer.reservation import block_nbytes

GRPC_METHOD = "/splitserve.bench.KVTransfer/Ship"


def grpc_receiver_main(conn, pool_spec: dict) -> None:
    """Child process: a minimal gRPC receiver of codec messages into its pool."""
    if pool_spec["device"].startswith("cuda"):
        torch.cuda.set_device(torch.device(pool_spec["device"]))
    pool = fill_pool(make_pool(**pool_spec), RECEIVER_SEED)
    asyncio.run(_grpc_serve(conn, pool))


async def _grpc_serve(conn, pool: torch.Tensor) -> None:
    import grpc

    from splitserve.kernels.layout import write_blocks_bytes
    from splitserve.runtime.server import SERVER_OPTIONS
    from splitserve.transfer.grpc_bytes.codec import decode_blocks
    from splitserve.v1 import nodes_pb2

    nbytes = block_nbytes(pool)

    def commit(ids: list[int], data: bytes) -> None:
        write_blocks_bytes(pool, ids, data)
        if pool.device.type == "cuda":
            torch.cuda.synchronize(pool.device)

    async def ship(request_iterator, context):
        # The first message names the destination ids (little-endian int32; too many for
        # gRPC metadata at 4096 blocks), the others carry codec batches.
        first = await anext(request_iterator)
        dst = array.array("i", first.data).tolist()
        staged: dict[int, bytes] = {}
        async for msg in request_iterator:
            batch = await asyncio.to_thread(decode_blocks, msg.meta, msg.data, nbytes)
            for j, index in enumerate(batch.indices):
                staged[index] = batch.data[j * nbytes : (j + 1) * nbytes]
        order = sorted(staged)
        await asyncio.to_thread(commit, [dst[i] for i in order], b"".join(staged[i] for i in order))
        return b""

    handler = grpc.method_handlers_generic_handler(
        GRPC_METHOD.split("/")[1],
        {
            "Ship": grpc.stream_unary_rpc_method_handler(
                ship,
                request_deserializer=nodes_pb2.BlockData.FromString,
                response_serializer=lambda b: b,
            )
        },
    )
    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    conn.send(("ready", port))
    loop = asyncio.get_running_loop()
    while True:
        try:
            cmd, *args = await loop.run_in_executor(None, conn.recv)
        except EOFError:
            break
        if cmd == "checksums":
            conn.send(("ok", block_checksums(pool, args[0])))
        else:
            conn.send(("ok", None))
            break
    await server.stop(None)


async def grpc_ship(channel, pool: torch.Tensor, src: list[int], dst: list[int]) -> None:
    from splitserve.kernels.layout import read_blocks_bytes
    from splitserve.transfer.grpc_bytes.codec import batch_indices, encode_blocks
    from splitserve.v1 import nodes_pb2

    nbytes = block_nbytes(pool)

    async def messages():
        yield nodes_pb2.BlockData(data=array.array("i", dst).tobytes())
        for run in batch_indices(range(len(src)), nbytes):
            data = await asyncio.to_thread(read_blocks_bytes, pool, [src[i] for i in run])
            meta, data = await asyncio.to_thread(encode_blocks, run, data)
            yield nodes_pb2.BlockData(meta=meta, data=data)

    call = channel.stream_unary(
        GRPC_METHOD,
        request_serializer=nodes_pb2.BlockData.SerializeToString,
        response_deserializer=lambda b: b,
    )
    await call(messages())


def run_grpc(args, spec: dict, counts: list[int], out: list[Case]) -> None:
    import multiprocessing as mp

    import grpc

    from splitserve.runtime.server import CHANNEL_OPTIONS

    device = "cuda:0" if args.device == "cuda" else "cpu"
    pool_blocks = max(counts) + 1
    pool = fill_pool(make_pool(pool_blocks, **spec, device=device), SENDER_SEED)
    nbytes = block_nbytes(pool)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(
        target=grpc_receiver_main,
        args=(child, dict(num_blocks=pool_blocks, **spec, device=device)),
        daemon=True,
    )
    proc.start()
    child.close()
    rng = random.Random(0)
    try:
        if not conn.poll(600):
            raise RuntimeError("the grpc receiver did not start")
        _, port = conn.recv()

        async def measure() -> None:
            async with grpc.aio.insecure_channel(
                f"127.0.0.1:{port}", options=CHANNEL_OPTIONS
            ) as channel:
                for n in counts:
                    case = Case(GRPC, n, n * nbytes)
                    src, dst = pick_ids(pool_blocks, n, rng), pick_ids(pool_blocks, n, rng)
                    for i in range(args.repeats + 1):
                        t0 = time.perf_counter()
                        await grpc_ship(channel, pool, src, dst)
                        if i:
                            case.seconds.append(time.perf_counter() - t0)
                    conn.send(("checksums", dst))
                    _, dst_sums = await asyncio.to_thread(conn.recv)
                    verify(case, block_checksums(pool, src), dst_sums)
                    out.append(case)
                    print(case.row(), flush=True)

        asyncio.run(measure())
    finally:
        try:
            conn.send(("exit",))
            conn.poll(10) and conn.recv()
        except (OSError, EOFError):
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
