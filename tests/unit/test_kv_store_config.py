"""The shared KV store's options, checked before anything connects: the URL's form, and the
door it opens (no authentication, no encryption: a node with mTLS takes a store off loopback only
with --trust-kv-network). The store itself runs in tests/cluster/test_kv_store.py."""

import pytest

from splitserve.engine.kv_store import parse_store_url
from splitserve.runtime.config import NodeConfig


def test_a_store_url_names_the_master_and_its_metadata_server():
    assert parse_store_url("mooncake://10.0.0.5") == (
        "10.0.0.5:50051",
        "http://10.0.0.5:8080/metadata",
    )
    assert parse_store_url("mooncake://s:7?metadata=http://m:9/metadata") == (
        "s:7",
        "http://m:9/metadata",
    )
    for bad in ("redis://x", "mooncake://", "embedded", "mooncake://h:99999", "mooncake://h?x=1"):
        with pytest.raises(ValueError, match="--kv-store"):
            parse_store_url(bad)


def test_a_tls_node_refuses_a_store_off_loopback_unless_the_network_is_trusted():
    tls = dict(model_path="m", tls_cert="c", tls_key="k", tls_ca="a")
    NodeConfig(**tls, kv_store="mooncake://127.0.0.1:5")
    with pytest.raises(ValueError, match="--trust-kv-network"):
        NodeConfig(**tls, kv_store="mooncake://10.0.0.5")
    NodeConfig(**tls, kv_store="mooncake://10.0.0.5", trust_kv_network=True)
    NodeConfig(model_path="m", kv_store="mooncake://10.0.0.5")  # no TLS: nothing to lose
    with pytest.raises(ValueError, match="host tier"):
        NodeConfig(model_path="m", kv_store="mooncake://127.0.0.1", kv_host_cache_mb=0)
