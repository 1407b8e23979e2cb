"""API keys of the router's HTTP front (``--api-key-file``): who may call the OpenAI API.

The file holds one key a line; blank lines and lines starting with ``#`` are ignored. Each key
is at least 16 printable ASCII characters without spaces (e.g. ``python3 -c "import secrets;
print(secrets.token_urlsafe(32))"``). A request must carry ``Authorization: Bearer <key>``; the
key is compared, in constant time, against every key of the file (as SHA-256 digests, so neither
the key's length nor which key matched shows in the time taken). The file is read again when it
changes (checked at most once a second): keys are added and revoked without a restart; a changed
file that no longer reads (no key, a bad line) is logged and the keys read before are kept.

A key is also the client for the per-client in-flight cap (``--max-requests-per-client``): named
by a digest of it, never by the key itself, so it can be logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

MIN_KEY_CHARS = 16
RELOAD_CHECK_S = 1.0  # the file's modification time is looked at no more often than this


def read_api_keys(path: str) -> tuple[str, ...]:
    """The keys in ``path``; ``ValueError`` saying what to fix (unreadable, a bad line, none)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-key-file {path}: cannot read it ({exc})") from None
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if len(key) < MIN_KEY_CHARS:
            raise ValueError(
                f"--api-key-file {path} line {number}: a key must have at least {MIN_KEY_CHARS} "
                "characters (e.g. `python3 -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
            )
        if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
            raise ValueError(
                f"--api-key-file {path} line {number}: a key must be printable ASCII, no spaces"
            )
        keys.append(key)
    if not keys:
        raise ValueError(f"--api-key-file {path}: no key in it (one a line; # starts a comment)")
    return tuple(keys)


def write_api_key_file(path: str | Path) -> str:
    """A new random key in a new file ``path`` readable by its owner only; returns the key."""
    import secrets

    key = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("# splitserve API key: send it as Authorization: Bearer <key>\n" + key + "\n")
    return key


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class ApiKeys:
    """The keys of one ``--api-key-file``; ``client_of`` checks an Authorization header."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._digests = [_digest(k) for k in read_api_keys(path)]
        self._stamp = _stamp(path)
        self._checked = time.monotonic()

    def __len__(self) -> int:
        return len(self._digests)

    def client_of(self, authorization: str | None) -> str | None:
        """The client a valid ``Authorization: Bearer <key>`` header names (``key-`` and 12 hex
        digits of the key's digest); None when the header is missing or its key is not one of
        the file's."""
        self._reload_if_changed()
        scheme, _, key = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        presented = _digest(key.strip())
        # Every key, whichever matches: no early exit (a matching digest equals ``presented``).
        matched = [hmac.compare_digest(digest, presented) for digest in self._digests]
        return "key-" + presented.hex()[:12] if any(matched) else None

    def _reload_if_changed(self) -> None:
        now = time.monotonic()
        if now - self._checked < RELOAD_CHECK_S:
            return
        self._checked = now
        stamp = _stamp(self.path)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            digests = [_digest(k) for k in read_api_keys(self.path)]
        except ValueError as exc:
            logger.error("%s; keeping the %d keys read before", exc, len(self._digests))
            return
        logger.info("--api-key-file %s read again: %d keys", self.path, len(digests))
        self._digests = digests
