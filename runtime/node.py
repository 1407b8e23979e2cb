"""A prefill or decode node's life: load the model into an engine, serve its gRPC services (plus
the shared NodeStatsService, health, reflection and metrics), publish its cached blocks to Redis,
drain on SIGTERM (the background work and the drain: runtime.node_life); and the helpers the
nodes' servicers share."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import grpc

import splitserve.settings as settings
from splitserve.runtime.auth import TokenCheck, read_token_file, use_token
from splitserve.runtime.config import (
    CPU_KV_CACHE_MB,
    NodeConfig,
    auto_disk_cache_mb,
    auto_host_cache_mb,
)
from splitserve.runtime.failure import Failure
from splitserve.runtime.node_life import NodeLife, NodeService, index_publisher
from splitserve.runtime.protocol import sampling_from_proto
from splitserve.runtime.server import Server
from splitserve.runtime.tls import TlsFiles, use_tls
from splitserve.v1 import nodes_pb2, nodes_pb2_grpc

if TYPE_CHECKING:
    import torch

    from splitserve.engine.api import EngineFigures, EngineInfo, KVSpec, NodeEngine
    from splitserve.engine.core import LLMEngine
    from splitserve.engine.kv_store import StoreClient
    from splitserve.engine.local import LocalEngine
    from splitserve.kvstore import ModelIdentity
    from splitserve.models.sampling_params import SamplingParams
    from splitserve.runtime.metrics import LoadFigures

logger = logging.getLogger(__name__)

STATS_SERVICE_NAME = nodes_pb2.DESCRIPTOR.services_by_name["NodeStatsService"].full_name


def use_device(device: str, make_current: bool = True) -> torch.device:
    """Check that ``device`` ("cpu", "cuda" or "cuda:N") exists here and make it the current
    device (unless not ``make_current``); ``ValueError`` says what to change. NOTE: the current
    CUDA device must be the node's before any kernel runs — Triton launches on the current
    device, and a node on cuda:1 with cuda:0 current fails at warm-up ("Pointer argument
    cannot be accessed from Triton")."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r}: give cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"--device {device!r}: give cpu, cuda or cuda:N")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"--device {device}: this machine has no CUDA device visible")
    index = 0 if dev.index is None else dev.index
    if index >= count:
        raise ValueError(
            f"--device {device}: no such device, this process sees {count} CUDA device(s) "
            f"(cuda:0..cuda:{count - 1})"
        )
    if make_current:
        torch.cuda.set_device(index)
    return torch.device("cuda", index)


def node_identity(config: NodeConfig) -> ModelIdentity:
    """The model identity of a node of this config: the router computes the same from its own
    --model, --dtype, --block-size and --quantization."""
    from splitserve.kvstore import ModelIdentity

    return ModelIdentity.for_checkpoint(
        config.model_path,
        config.dtype,
        config.block_size,
        quantization=config.quantization,
        kv_cache_dtype=config.kv_cache_dtype,
    )


def kv_pool_bytes(config: NodeConfig) -> int | None:
    """The KV pool's size as given (None: measured, on CUDA only)."""
    if config.kv_cache_mb is not None:
        return config.kv_cache_mb << 20
    return None if config.device.startswith("cuda") else CPU_KV_CACHE_MB << 20


def host_cache_blocks(config: NodeConfig, block_bytes: int) -> int:
    """Blocks of the node's host KV tier (0: none), said once in the log."""
    mb = config.kv_host_cache_mb
    auto = mb is None
    if auto:
        if config.tensor_parallel_size > 1 or not config.enable_prefix_caching:
            return 0  # (not yet at TP > 1; nothing to keep without prefix caching)
        mb = auto_host_cache_mb()
    blocks = (mb << 20) // block_bytes
    if blocks:
        logger.info(
            "host KV tier: up to %d MiB, %d blocks%s (--kv-host-cache-mb; 0: off)",
            mb,
            blocks,
            " (a quarter of the memory available now)" if auto else "",
        )
    return blocks


def disk_cache_bytes(config: NodeConfig) -> int:
    """The disk KV tier's size (0 without a folder), said once in the log."""
    if not config.kv_disk_cache_dir:
        return 0
    mb = config.kv_disk_cache_mb
    if mb is None:
        mb = auto_disk_cache_mb(config.kv_disk_cache_dir)
    logger.info(
        "disk KV tier: up to %d MiB in %s%s", mb, config.kv_disk_cache_dir,
        "" if config.kv_disk_cache_mb else " (half its free space now)",
    )  # fmt: skip
    return mb << 20


def kv_store_client(config: NodeConfig) -> StoreClient | None:
    """A client of the shared KV store, or None: none configured, or its library is missing
    (said in the log). A store not reached at start is tried again as the node runs; until then
    the node computes what it would have given."""
    if not config.kv_store:
        return None
    from splitserve.engine.kv_store import MooncakeStore, StoreError

    try:
        client = MooncakeStore(config.kv_store, config.advertised_host())
    except StoreError as exc:
        logger.warning("KV store: %s; this node runs without it", exc)
        return None
    try:
        client.connect()
    except StoreError as exc:  # (tried again as the node runs)
        logger.warning("KV store: %s", exc)
    logger.info("KV store: %s (this node puts what it computes, reads what any put)", client.url)
    return client


def build_engine(config: NodeConfig, prefill_only: bool) -> tuple[LLMEngine, ModelIdentity]:
    """Load the model of a node and wrap it in an engine (blocking: call before serving)."""
    import torch

    from splitserve.engine.core import LLMEngine
    from splitserve.models.loader import load_model
    from splitserve.models.parallel import SINGLE
    from splitserve.models.runner import ModelRunner, RunnerConfig

    device = use_device(config.device)  # cuda → cuda:I, the current device
    if config.device == "cpu":
        # Several node processes share the machine's cores; one thread each avoids thrashing.
        torch.set_num_threads(1)
    runner_config = RunnerConfig(
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        gpu_memory_utilization=config.gpu_memory_utilization,
        kv_cache_bytes=kv_pool_bytes(config),
        use_cuda_graph=not config.enforce_eager,
        kv_cache_dtype=config.kv_cache_dtype,
    )
    tp, ranks = SINGLE, None
    if config.tensor_parallel_size > 1:
        tp, ranks = start_tensor_parallel(config, str(device), runner_config)
    try:
        model_config, model = load_model(
            config.model_path,
            dtype=config.dtype,
            device=device,
            load_format=config.load_format,
            tp=tp,
            quantization=config.quantization,
        )
        runner = ModelRunner(model_config, model, runner_config)
    except BaseException:
        if ranks is not None:
            ranks.stop(timeout=5.0)
        raise
    if ranks is not None:
        runner.closers.append(ranks.stop)
        runner.on_group_error = ranks.group_failed
    identity = node_identity(config)
    if identity.dtype != str(runner.dtype).removeprefix("torch."):  # the router computes the same
        raise RuntimeError(f"{identity} does not match the loaded dtype {runner.dtype}")
    host_blocks = host_cache_blocks(config, runner.transfer_block_bytes)
    if config.kv_store and not host_blocks:
        logger.warning("KV store: not used without a host tier (tensor parallel size > 1?)")
    engine = LLMEngine(
        runner,
        identity,
        host_cache_blocks=host_blocks,
        disk_cache_dir=config.kv_disk_cache_dir,
        disk_cache_bytes=disk_cache_bytes(config),
        kv_store=kv_store_client(config) if host_blocks else None,
        prefill_only=prefill_only,
        enable_prefix_caching=config.enable_prefix_caching,
        enable_kv_events=config.redis_url is not None,
        async_scheduling={"auto": None, "on": True, "off": False}[config.async_scheduling],
    )
    return engine, identity


def start_tensor_parallel(config: NodeConfig, device: str, runner_config: Any) -> tuple[Any, Any]:
    """Start the node's other tensor-parallel ranks (engine.ranks) and join their group as
    rank 0: (``TPGroup``, ``Ranks``)."""
    import dataclasses

    from splitserve.engine.ranks import RankSpec, rank_devices, start_ranks
    from splitserve.runtime import gpus

    devices = rank_devices(device, config.tensor_parallel_size)
    if device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count()
        if int(devices[-1].partition(":")[2]) >= count:
            raise ValueError(
                f"--tensor-parallel-size {config.tensor_parallel_size} from {device} needs "
                f"{devices[0]}..{devices[-1]}; this process sees {count} CUDA device(s)"
            )
    spec = RankSpec(
        model_path=config.model_path,
        dtype=config.dtype,
        load_format=config.load_format,
        devices=devices,
        runner=dataclasses.asdict(runner_config),
        quantization=config.quantization,
    )
    return start_ranks(spec, pass_fds=gpus.held_locks())


async def serve_node(
    config: NodeConfig,
    role: str,
    make_service: Callable[[NodeEngine, ModelIdentity, NodeConfig, str], NodeService],
    add_servicer: Callable[[Any, grpc.aio.Server], None],
    service_name: str,
) -> None:
    """Run one prefill or decode node until SIGTERM/SIGINT, then drain it.

    ``make_service(engine, identity, config, address)`` builds the servicer (``address``: the
    node's advertised host:port, its id in Redis); ``add_servicer`` adds it to the gRPC server.
    The engine runs in a process of its own (``--engine-process``, runtime.engine_process) or in
    this one; either way the services reach it only through ``engine.api.NodeEngine``.

    Drain: health NOT_SERVING, the node leaves the registry and withdraws its index entries (no
    router sends it new work), new work is refused with UNAVAILABLE (the router retries
    elsewhere), in-flight requests finish (up to ``drain_timeout_s``), then the process exits 0.
    """
    engine, identity = await start_engine(config, role)
    try:
        token, tls = use_credentials(config)
        server = Server(
            config.host,
            config.port,
            [service_name, STATS_SERVICE_NAME],
            interceptors=[TokenCheck(token)] if token else (),
            tls=tls,
        )
        address = f"{config.advertised_host()}:{server.port}"
        await engine.open_kv(kv_spec(config, role, address))
        service = make_service(engine, identity, config, address)
        add_servicer(service, server.server)
        nodes_pb2_grpc.add_NodeStatsServiceServicer_to_server(service, server.server)
        serve_node_metrics(config, role, service, engine.info.tensor_parallel_size)
        publisher = index_publisher(config, role, engine, identity, address)
        life = NodeLife(config, service, engine, publisher)
    except BaseException:
        await engine.stop()
        raise
    await server.run(config.port_file, life.stop, drain=life.drain)


async def start_engine(config: NodeConfig, role: str) -> tuple[NodeEngine, ModelIdentity]:
    """The node's engine, started: in an engine process of its own (``--engine-process``) or
    on a thread of this one. The model identity is computed here as the router computes it and
    checked against the engine's."""
    identity = node_identity(config)
    if uses_engine_process(config):
        from splitserve.runtime.engine_process import spawn_engine

        engine: NodeEngine = await spawn_engine(config, role)
    else:
        engine = local_engine(config, role)
    if engine.info.root_hash != identity.root_hash:
        await engine.stop()
        raise RuntimeError(f"{identity} does not match the engine's {engine.info.identity}")
    logger.info("%s node: %s (engine in process %d)", role, identity, engine.info.pid)
    return engine, identity


def uses_engine_process(config: NodeConfig) -> bool:
    """``--engine-process``: on, off, or auto (on for a GPU node: its steps then never wait for
    the gRPC front's Python; off on a CPU, where the forward holds the interpreter anyway and a
    second process per node only costs start-up time)."""
    if config.engine_process == "auto":
        return config.device.startswith("cuda")
    return config.engine_process == "on"


def local_engine(
    config: NodeConfig, role: str, deliver=None, fail=None, bounded_stop: bool = True
) -> LocalEngine:
    """Load the model and start an engine on a thread of this process (steps run once the
    loop is this one). ``deliver``/``fail``: an engine process's sinks (``LocalEngine``)."""
    from splitserve.engine.client import stop_timeout_s
    from splitserve.engine.local import LocalEngine

    # In the node's own process its stop is bounded (engine.client's timeout; a bad value fails
    # here, before the model loads); an engine process is bounded by its node, which kills it.
    timeout = stop_timeout_s() if bounded_stop else None
    core, _ = build_engine(config, prefill_only=role == "prefill")
    set_gil_switch_interval()
    # SPLITSERVE_STEP_PROFILE=PATH: the engine thread times every step's phases and writes them
    # to PATH.<role>.<pid>.json when the node stops (engine.step_profile). For measurement runs:
    # it keeps a row (and two CUDA events) per step until then.
    profile = settings.STEP_PROFILE.get()
    profile_path = f"{profile}.{role}.{os.getpid()}.json" if profile else None
    engine = LocalEngine(core, profile_path, deliver=deliver, fail=fail, stop_timeout_s=timeout)
    engine.start()
    return engine


def kv_spec(config: NodeConfig, role: str, address: str) -> KVSpec:
    """The transfer sides the node's engine opens (``--kv-transfer``, its TLS files, the
    cluster token's rendezvous key)."""
    from splitserve.engine.api import KVSpec
    from splitserve.transfer import rendezvous_key

    paths = transfer_paths(config)
    has_tls = bool(config.tls_cert and config.tls_key and config.tls_ca)
    if has_tls and not config.trust_kv_network and "dist" in config.kv_transfer:
        logger.info("KV transfer: dist not offered (plaintext; --tls-* without --trust-kv-network)")
    token = read_token_file(config.auth_token_file) if config.auth_token_file else None
    return KVSpec(
        role=role,
        address=address,
        paths=paths,
        host=config.advertised_host(),
        tls_cert=config.tls_cert if has_tls else None,
        tls_key=config.tls_key if has_tls else None,
        tls_ca=config.tls_ca if has_tls else None,
        trust_network=config.trust_kv_network,
        rendezvous_key=rendezvous_key(token) if token else None,
        stream_layers=config.kv_stream_min_tokens > 0,
    )


def set_gil_switch_interval() -> None:
    """The engine thread and the event loop share the GIL; a thread that wants it waits up to the
    interpreter's switch interval (5 ms by default) for the holder to let go. A knob to measure
    that with (docs/benchmarks-history.md, "A node's steps against the engine's: where the
    colocated layout lost, and two fixes, one H200 (2026-12-01)"); unset, Python's default
    stands."""
    switch_ms = settings.GIL_SWITCH_INTERVAL_MS.get()
    if switch_ms is not None:
        sys.setswitchinterval(switch_ms / 1000)


def use_credentials(config: NodeConfig) -> tuple[str | None, TlsFiles | None]:
    """The node's cluster token and mTLS files, also made those of its own calls to peers."""
    token = read_token_file(config.auth_token_file) if config.auth_token_file else None
    use_token(token)  # its own calls to peers carry it too
    tls = TlsFiles.load(config.tls_cert, config.tls_key, config.tls_ca)
    use_tls(tls)  # and go over mTLS when it has an identity
    return token, tls


def serve_node_metrics(
    config: NodeConfig, role: str, service: NodeService, tensor_parallel_size: int = 1
) -> None:
    """Serve the node's load figures and counters at ``--metrics-port`` (if given)."""
    if config.metrics_port is None:
        return
    from prometheus_client import CollectorRegistry

    from splitserve.runtime.counter_names import for_role
    from splitserve.runtime.metrics import NodeCollector, serve_metrics

    registry = CollectorRegistry()
    text = "Ranks (GPUs) the node's model is split over"
    fixed = {"tensor_parallel_size": (text, tensor_parallel_size)}
    # Every counter the node may count is exported from the start, at 0 until it counts: a
    # dashboard shows 0 rather than no data, and rate() sees the first increments.
    zeros = dict.fromkeys(for_role(role, transfer_paths(config)), 0.0)

    def counters() -> dict[str, float]:
        return {**zeros, **service.all_counters()}

    registry.register(NodeCollector(role, service.load, counters, fixed))
    port = serve_metrics(config.metrics_port, registry, config.host)
    if config.metrics_port_file:
        from splitserve.runtime.server import write_port_file

        write_port_file(config.metrics_port_file, port)


def transfer_paths(config: NodeConfig) -> tuple[str, ...]:
    """The KV transfer paths a node may use (``--kv-transfer``); gRPC bytes always remain."""
    from splitserve.transfer import parse_paths

    return parse_paths(config.kv_transfer, config.device)


def check_kv_tls(config: NodeConfig) -> None:
    """Build the tcp path's TLS contexts once (``ValueError`` for files TLS cannot use, e.g. a
    key that does not fit its certificate), before the engine starts."""
    if config.tls_cert and config.tls_key and config.tls_ca:
        from splitserve.transfer import KVTls

        KVTls(config.tls_cert, config.tls_key, config.tls_ca)


def checked_request(
    info: EngineInfo, request: nodes_pb2.PrefillRequest | nodes_pb2.GenerateOnNodeRequest
) -> tuple[SamplingParams, list[int]]:
    """A request's sampling parameters and prompt (a PrefillRequest or GenerateOnNodeRequest:
    ``request_id``, ``sampling``, ``prompt_token_ids``); ``ValueError`` saying what is wrong."""
    if not request.request_id:
        raise ValueError("request_id is empty")
    return sampling_from_proto(request.sampling), info.check_prompt(request.prompt_token_ids)


def failure_code(exc: BaseException) -> Failure:
    """The status of a request the engine failed: a prompt that can never fit the KV cache is
    RESOURCE_EXHAUSTED (another node may have room), an engine process that went (the node exits
    next) UNAVAILABLE (the router retries elsewhere), anything else INTERNAL."""
    from splitserve.engine.core import RequestDoesNotFit

    if isinstance(exc, RequestDoesNotFit):
        return Failure.REFUSED
    if isinstance(exc, ConnectionError):  # engine.protocol.EngineGone
        return Failure.UNAVAILABLE
    return Failure.INTERNAL


def node_stats(
    role: str,
    info: EngineInfo,
    figures: EngineFigures,
    load: LoadFigures,
    counters: Mapping[str, float],
    **extra: Any,
) -> nodes_pb2.GetStatsResponse:
    """A node's ``GetStats`` answer: its identity, load figures (splitserve.metrics.LoadFigures)
    and counters; ``extra``: role-specific fields."""
    return nodes_pb2.GetStatsResponse(
        role=role,
        model_root_hash=info.root_hash,
        model_identity=info.identity,
        num_blocks=load.num_blocks,
        num_free_blocks=load.num_free_blocks,
        num_cached_blocks=figures.num_cached_blocks,
        running=load.running,
        waiting=load.waiting,
        prefill_tokens_waiting=load.prefill_tokens_waiting,
        pending_transfers=load.pending_transfers,
        max_num_seqs=info.max_num_seqs,
        max_num_batched_tokens=info.max_num_batched_tokens,
        kv_tokens_held=load.kv_tokens_held,
        kv_token_slots=load.kv_token_slots,
        counters=counters,
        tier_block_load_s=figures.tier_block_load_s,
        **extra,
    )
