"""Where the local actuator puts a new node: a GPU of ``--gpus`` with room, fewest nodes first.

Every GPU holds at most ``per_gpu`` nodes (enough for the most nodes the bounds allow, spread
evenly), and each node sizes its KV pool from the same share of its GPU, fixed when it starts:
a node never has to shrink when another joins its GPU."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

DEFAULT_GPU_SHARE = 0.9  # of one GPU's memory, split among the nodes it may hold


def per_gpu(max_nodes: int, num_gpus: int) -> int:
    """Nodes one GPU must be able to hold for ``max_nodes`` spread over ``num_gpus``."""
    if max_nodes < 1 or num_gpus < 1:
        raise ValueError("give at least one node and one GPU")
    return math.ceil(max_nodes / num_gpus)


def node_share(max_nodes: int, num_gpus: int) -> float:
    """The memory share (--gpu-memory-utilization) of every node."""
    return round(DEFAULT_GPU_SHARE / per_gpu(max_nodes, num_gpus), 4)


def pick_gpu(gpus: Sequence[int], used: Mapping[int, int], capacity: int) -> int | None:
    """The GPU of ``gpus`` with the fewest nodes (``used``) and room (fewer than ``capacity``);
    ties go to the earlier one in ``gpus``. None: every GPU is full."""
    room = [g for g in gpus if used.get(g, 0) < capacity]
    return min(room, key=lambda g: (used.get(g, 0), gpus.index(g))) if room else None


def device_of(gpu: int | None, device: str) -> str:
    """The --device of a node placed on ``gpu`` (None: not a GPU placement, ``device`` as is)."""
    return device if gpu is None else f"cuda:{gpu}"
