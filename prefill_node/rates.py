"""Fetch or compute a peer's prefix: the cost model and its measured rates."""

from __future__ import annotations

MIN_FETCH_BLOCKS = 2  # fewer than this: computing is cheaper than a round trip to a peer
# Until measured here, per path of the fetch (benchmarks/transfer.py, 256 blocks of the 8B shape
# on an H200 host, 2026-12-01: gRPC block stream 0.22 GB/s, tcp 3.8 GB/s, ipc 384 GB/s; taken
# lower, since a fetch also pays its round trip and the adoption), and a GPU prefill runs at
# ~300 TFLOP/s (2 FLOPs/parameter/token).
FETCH_RATE_PRIOR = {"grpc": 0.25e9, "tcp": 2e9, "ipc": 100e9}  # bytes/s
GPU_PREFILL_FLOPS_PRIOR = 300e12
FETCH_LATENCY_S = 0.002  # a round trip and the adoption, whatever the size
RATE_SAMPLE_MIN_TOKENS = 256  # smaller prefills say more about overheads than about speed
RATE_SAMPLE_MIN_BYTES = 1 << 20  # smaller fetches too


def worth_fetching(
    num_blocks: int,
    block_nbytes: int,
    block_size: int,
    fetch_rate: float,
    compute_rate: float | None,
) -> bool:
    """Fetching ``num_blocks`` from a peer beats computing their tokens here, by the estimated
    times (``fetch_rate`` bytes/s; ``compute_rate`` prefill tokens/s, None: unknown → fetch)."""
    if num_blocks < MIN_FETCH_BLOCKS:
        return False
    if compute_rate is None:
        return True
    fetch_s = FETCH_LATENCY_S + num_blocks * block_nbytes / fetch_rate
    return fetch_s < num_blocks * block_size / compute_rate


def _ema(old: float | None, sample: float, weight: float = 0.5) -> float:
    return sample if old is None else (1 - weight) * old + weight * sample


class Rates:
    """This node's fetch rate (bytes/s) and prefill rate (tokens/s): priors until measured."""

    def __init__(self, block_nbytes: int, block_size: int, compute_rate: float | None) -> None:
        self.block_nbytes, self.block_size = block_nbytes, block_size
        self.fetch_rates = dict(FETCH_RATE_PRIOR)  # per path of the fetch
        self.compute_rate = compute_rate

    @classmethod
    def for_runner(cls, runner, block_nbytes: int, block_size: int) -> Rates:
        """Priors for a model runner: a GPU's prefill rate from the parameter count; on CPU
        unknown (fetch whatever is worth a round trip)."""
        compute_rate = None
        if runner.device.type == "cuda":
            params = sum(p.numel() for p in runner.model.parameters())
            compute_rate = GPU_PREFILL_FLOPS_PRIOR / (2 * params)
        return cls(block_nbytes, block_size, compute_rate)

    def fetch_rate(self, path: str = "grpc") -> float:
        return self.fetch_rates[path]

    def worth_fetching(self, num_blocks: int, path: str = "grpc") -> bool:
        """Fetching ``num_blocks`` over ``path`` (grpc, tcp or ipc) beats computing them."""
        return worth_fetching(
            num_blocks,
            self.block_nbytes,
            self.block_size,
            self.fetch_rates[path],
            self.compute_rate,
        )

    def prefilled(self, computed_tokens: int, seconds: float) -> None:
        """A prefill computed ``computed_tokens`` in ``seconds`` (queueing counts too: a cautious
        estimate)."""
        if computed_tokens >= RATE_SAMPLE_MIN_TOKENS:
            self.compute_rate = _ema(self.compute_rate, computed_tokens / max(seconds, 1e-6))

    def fetched(self, nbytes: int, seconds: float, path: str = "grpc") -> None:
        """A peer fetch over ``path`` moved ``nbytes`` in ``seconds``, round trip and adoption
        included."""
        if nbytes >= RATE_SAMPLE_MIN_BYTES:
            sample = nbytes / max(seconds - FETCH_LATENCY_S, 1e-6)
            self.fetch_rates[path] = _ema(self.fetch_rates[path], sample)
