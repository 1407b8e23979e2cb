"""Checks on /metrics pages shared by tests/unit/test_metric_names.py (in-process nodes) and
tests/cluster/test_cluster_up.py (a cluster started by ``splitserve up``)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

ROLES = ("prefill", "decode")


def families_of(text: str) -> set[str]:
    """The metric family names of a /metrics page (a counter's without ``_total``)."""
    return {family.name for family in text_string_to_metric_families(text)}


def assert_no_name_shared(exported: dict[str, set[str]]) -> None:
    """``exported``: component kind (router, prefill, decode) → its family names. Each node's
    names carry its role's prefix, the router's no role's, and no name is in two kinds."""
    kinds = sorted(exported)
    for i, a in enumerate(kinds):
        for b in kinds[i + 1 :]:
            shared = exported[a] & exported[b]
            assert not shared, f"exported by both {a} and {b}: {sorted(shared)}"
    for role in ROLES:
        stray = {n for n in exported[role] if not n.startswith(f"splitserve_{role}_")}
        assert not stray, f"{role} node metrics without the splitserve_{role}_ prefix: {stray}"
    prefixes = tuple(f"splitserve_{role}_" for role in ROLES)
    stray = {n for n in exported["router"] if n.startswith(prefixes)}
    assert not stray, f"router metrics under a node role's prefix: {stray}"
