"""Fetch or compute a peer's prefix: the cost model and its measured rates."""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.transfer import rate_prior

if TYPE_CHECKING:
    from splitserve.engine.api import EngineInfo

MIN_FETCH_BLOCKS = 2  # fewer than this: computing is cheaper than a round trip to a peer
# Until measured here: each path of the fetch moves what the transfer layer assumes of it
# (``transfer.rate_prior``), and a GPU prefill runs at ~300 TFLOP/s (2 FLOPs/parameter/token).
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
        # Measured, per path of the fetch ("": the byte stream of FetchBlocks).
        self.fetch_rates: dict[str, float] = {}
        self.compute_rate = compute_rate

    @classmethod
    def for_engine(cls, info: EngineInfo) -> Rates:
        """Priors for an engine (``NodeEngine.info``): on a GPU the prefill rate from the model's
        parameter count; on CPU unknown (fetch whatever is worth a round trip)."""
        compute_rate = None
        if info.device.startswith("cuda") and info.num_params > 0:
            compute_rate = GPU_PREFILL_FLOPS_PRIOR / (2 * info.num_params)
        return cls(info.block_nbytes, info.block_size, compute_rate)

    def fetch_rate(self, path: str = "") -> float:
        """Of a fetch over the transfer layer's ``path`` ("": the FetchBlocks byte stream)."""
        rate = self.fetch_rates.get(path)
        return rate if rate is not None else rate_prior(path)

    def worth_fetching(self, num_blocks: int, path: str = "") -> bool:
        """Fetching ``num_blocks`` over ``path`` beats computing them."""
        return worth_fetching(
            num_blocks,
            self.block_nbytes,
            self.block_size,
            self.fetch_rate(path),
            self.compute_rate,
        )

    def compute_seconds(self, num_blocks: int) -> float | None:
        """How long computing ``num_blocks`` blocks' tokens takes here (None: rate unknown)."""
        rate = self.compute_rate
        return num_blocks * self.block_size / rate if rate else None

    def prefilled(self, computed_tokens: int, seconds: float) -> None:
        """A prefill computed ``computed_tokens`` in ``seconds`` (queueing counts too: a cautious
        estimate)."""
        if computed_tokens >= RATE_SAMPLE_MIN_TOKENS:
            self.compute_rate = _ema(self.compute_rate, computed_tokens / max(seconds, 1e-6))

    def fetched(self, nbytes: int, seconds: float, path: str = "") -> None:
        """A peer fetch over ``path`` moved ``nbytes`` in ``seconds``, round trip and adoption
        included."""
        if nbytes >= RATE_SAMPLE_MIN_BYTES:
            sample = nbytes / max(seconds - FETCH_LATENCY_S, 1e-6)
            self.fetch_rates[path] = _ema(self.fetch_rate(path), sample)
