"""The HTTP front's API keys (router/api_keys.py) and the router's rules for a guarded HTTP front
(runtime/config.py), without a server: one key a line with comments and blank lines ignored, a
bad line or no key a clear error naming the line, only ``Bearer <a key of the file>`` names a
client (by a digest, never the key), a changed file is read again and a broken one keeps the old
keys; with --tls-* a public HTTP front needs both HTTPS and keys. The HTTP front serving them is
in tests/cluster/test_http_auth.py."""

from __future__ import annotations

import os
import secrets

import pytest

from splitserve.router import api_keys
from splitserve.router.api_keys import ApiKeys, read_api_keys, write_api_key_file
from splitserve.router.config import RouterConfig


def test_keys_are_read_one_a_line_and_bad_files_say_which_line(tmp_path):
    path = tmp_path / "keys"
    a, b = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    path.write_text(f"# comment\n\n  {a}  \n# {b} revoked\n{b}\n")
    assert read_api_keys(str(path)) == (a, b)
    for text, says in (
        ("# only a comment\n\n", "no key"),
        (f"{a}\nshort\n", "line 2"),
        (f"{a} {b}\n", "no spaces"),
        ("ключ-" + "x" * 20 + "\n", "printable ASCII"),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=says):
            read_api_keys(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        read_api_keys(str(tmp_path / "missing"))


def test_only_a_bearer_key_of_the_file_names_a_client(tmp_path):
    path = tmp_path / "keys"
    key = write_api_key_file(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    other = secrets.token_urlsafe(24)
    with path.open("a") as f:
        f.write(other + "\n")
    keys = ApiKeys(str(path))
    assert len(keys) == 2
    client = keys.client_of(f"Bearer {key}")
    assert client is not None and client.startswith("key-") and key not in client
    assert keys.client_of(f"bearer  {key} ") == client  # scheme case, surrounding spaces
    assert keys.client_of(f"Bearer {other}") not in (None, client)  # each key its own client
    for header in (
        None,
        "",
        key,
        f"Basic {key}",
        "Bearer ",
        f"Bearer {key}x",
        f"Bearer {key[:-1]}",
    ):
        assert keys.client_of(header) is None, header


def test_a_changed_file_is_read_again_and_a_broken_one_keeps_the_old_keys(tmp_path, monkeypatch):
    path = tmp_path / "keys"
    old, new = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    path.write_text(old + "\n")
    keys = ApiKeys(str(path))
    clock = [1000.0]
    monkeypatch.setattr(api_keys.time, "monotonic", lambda: clock[0])
    keys._checked = clock[0]
    path.write_text(new + "\n")
    assert keys.client_of(f"Bearer {old}") is not None  # looked at once a second at most
    clock[0] += api_keys.RELOAD_CHECK_S
    assert keys.client_of(f"Bearer {new}") is not None
    assert keys.client_of(f"Bearer {old}") is None  # revoked
    path.write_text("# emptied\n")
    clock[0] += api_keys.RELOAD_CHECK_S
    assert keys.client_of(f"Bearer {new}") is not None  # a file without keys is not taken


def _router(**kw) -> RouterConfig:
    return RouterConfig("m", (), ("d:1",), http_port=8080, **kw)


def test_with_mtls_a_public_http_front_needs_https_and_keys():
    mtls = dict(tls_cert="c", tls_key="k", tls_ca="ca")
    https = dict(http_tls_cert="hc", http_tls_key="hk")
    for given in ({}, https, {"api_key_file": "keys"}):
        with pytest.raises(ValueError, match="--http-tls-cert/--http-tls-key and --api-key-file"):
            _router(host="0.0.0.0", **mtls, **given)
    _router(host="0.0.0.0", **mtls, **https, api_key_file="keys")
    _router(host="127.0.0.1", **mtls)  # loopback, behind a proxy: as before
    _router(host="0.0.0.0")  # no mTLS anywhere: the network guards every port alike
    with pytest.raises(ValueError, match="both or neither"):
        _router(http_tls_cert="hc")
