"""What the benchmarks that start a local cluster share: the model options and the ClusterSpec
(``direct_threshold.py``, ``router_cpu.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline import make_8b

from splitserve.cluster_spec import ClusterSpec


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="a checkpoint (default: the embedded model)")
    ap.add_argument("--make-8b", default=None, metavar="DIR", help="the Llama-3-8B shape (dummy)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--node-hostnames", action="store_true")


def cluster_spec(args: argparse.Namespace, num_prefill: int, num_decode: int = 1) -> ClusterSpec:
    """A local cluster of the model ``args`` name (``add_model_args``) on a free port."""
    node_args: tuple[str, ...] = ()
    if args.make_8b:
        model = make_8b(Path(args.make_8b))
        node_args = ("--load-format", "dummy")
    else:
        from splitserve.models.tiny import ensure_tiny_model

        model = Path(args.model) if args.model else ensure_tiny_model()
    return ClusterSpec(
        model_path=str(model),
        num_prefill=num_prefill,
        num_decode=num_decode,
        port=0,  # the router binds a free port itself
        device=args.device,
        node_args=node_args,
        node_hostnames=args.node_hostnames,
    )
