"""docs/bench.md's JSON schema table, for the checks of `splitserve bench`'s result file
(tests/unit/test_bench.py on the documented options, tests/cluster/test_bench_command.py on a
real run)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def documented_json():
    """docs/bench.md's JSON schema table: (every field path, {field: the names its row lists})."""
    text = (ROOT / "docs" / "bench.md").read_text()
    section = text.split("## The JSON file")[1].split("\n## ")[0]
    rows = re.findall(r"^\| `([\w.]+)` \|(.*)\|$", section, re.M)
    return [path for path, _ in rows], {p: set(re.findall(r"`(\w+)`", w)) for p, w in rows}


def assert_documented(doc):
    """Every field of the schema is in ``doc``, and nothing undocumented is."""
    paths, names = documented_json()
    for path in paths:
        node = doc
        for key in path.split("."):
            assert key in node, f"{path} is documented but not in the JSON"
            node = node[key]
    assert set(doc) == {p.split(".")[0] for p in paths}
    for top in ("target", "results", "timeline", "server_metrics"):
        assert set(doc[top]) == {p.split(".")[1] for p in paths if p.startswith(top + ".")}
    assert set(doc["config"]) == names["config"]
    assert all(set(r) == names["requests"] for r in doc["requests"])
