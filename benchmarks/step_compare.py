"""A node's steps against the engine's in process: mean milliseconds per phase of the decode
steps of at least ``--min-seqs`` requests, from step-profile files.

    python benchmarks/engine.py --device cuda --make-8b /tmp/l8 --profile-json /tmp/prof/engine
    SPLITSERVE_STEP_PROFILE=/tmp/prof/node python benchmarks/pipeline.py --device cuda ...
    python benchmarks/step_compare.py /tmp/prof/engine.r0.json /tmp/prof/node.decode.*.json

Each file is a ``StepProfile.dump`` (``engine/step_profile.py``): the in-process engine's
(``benchmarks/engine.py --profile-json``) or a node's (``SPLITSERVE_STEP_PROFILE=PATH``, written
as ``PATH.<role>.<pid>.json`` when the node stops; with an engine process, by that process).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from splitserve.engine.step_profile import PHASES

KEYS = ("wall", "gpu", *PHASES)


def summary(path: Path, min_seqs: int) -> dict | None:
    rows = [
        r
        for r in json.loads(path.read_text())["rows"]
        if not r["prefill"] and r["seqs"] >= min_seqs
    ]
    if not rows:
        return None
    out = {"file": path.name, "steps": len(rows), "seqs": sum(r["seqs"] for r in rows) / len(rows)}
    for key in KEYS:
        out[key] = 1e3 * sum(r[key] for r in rows) / len(rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--min-seqs", type=int, default=192)
    args = ap.parse_args()
    lines = [s for f in args.files if (s := summary(f, args.min_seqs)) is not None]
    print(f"\ndecode steps of >= {args.min_seqs} requests, mean ms per step")
    print("| file | steps | seqs | " + " | ".join(KEYS) + " |")
    print("|---|---|---|" + "---|" * len(KEYS))
    for s in lines:
        cells = " | ".join(f"{s[k]:.2f}" for k in KEYS)
        print(f"| {s['file']} | {s['steps']} | {s['seqs']:.0f} | {cells} |")


if __name__ == "__main__":
    main()
