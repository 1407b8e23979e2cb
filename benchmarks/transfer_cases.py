"""What benchmarks/transfer.py measures and prints, shared by its paths: the case (one path and
block count: its times, check and table row), random ids, the pools' seeds."""

from __future__ import annotations

import random
import statistics

SENDER_SEED, RECEIVER_SEED = 11, 12


class Case:
    def __init__(self, path: str, n: int, nbytes: int) -> None:
        self.path, self.n, self.nbytes = path, n, nbytes
        self.seconds: list[float] = []
        self.check = ""
        self.note = ""

    def row(self) -> str:
        mib = self.nbytes / (1 << 20)
        if not self.seconds:
            return f"| {self.path} | {self.n} | {mib:.1f} | – | – | – | {self.note} |"
        med, best = statistics.median(self.seconds), min(self.seconds)
        return (
            f"| {self.path} | {self.n} | {mib:.1f} | {med * 1e3:.3f} | "
            f"{self.nbytes / med / 1e9:.2f} | {self.nbytes / best / 1e9:.2f} | {self.check} |"
        )


def pick_ids(pool_blocks: int, n: int, rng: random.Random) -> list[int]:
    return rng.sample(range(1, pool_blocks), n)


def verify(case: Case, src_sums: list[int], dst_sums: list[int]) -> None:
    case.check = "ok" if src_sums == dst_sums else "MISMATCH"
