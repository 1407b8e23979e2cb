"""What the command-line clients (``splitserve generate``, ``splitserve bench``) present to a
guarded router: mTLS files for its gRPC port, a CA and an API key for its HTTPS front.

A router with ``--tls-*`` takes gRPC clients with a certificate of its CA only
(``--tls-cert/--tls-key/--tls-ca``, all three); an HTTPS front is checked against ``--tls-ca``
(default: the system's trusted CAs); a router with ``--api-key-file`` wants an API key on both
doors (gRPC ``authorization`` metadata, HTTP ``Authorization`` header: ``Bearer <key>``):
``--api-key``, else the first key of ``--api-key-file``, else ``$SPLITSERVE_API_KEY``.
"""

from __future__ import annotations

import argparse
import ssl

import grpc


def add_client_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, http: bool = True
) -> None:
    """``--tls-cert/--tls-key/--tls-ca`` and the API key (``--api-key``, ``--api-key-file``);
    ``http``: the client may also call an https:// target."""
    parser.add_argument(
        "--tls-cert", default=None, help="gRPC target with mTLS: this client's certificate (PEM)"
    )
    parser.add_argument("--tls-key", default=None, help="gRPC target with mTLS: its private key")
    parser.add_argument(
        "--tls-ca",
        default=None,
        help="the CA (PEM) the router's certificate is checked against (gRPC: with --tls-cert "
        "and --tls-key; https://: alone, default the system's CAs)",
    )
    what = "gRPC metadata authorization / HTTP header Authorization" if http else "the metadata"
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"a router with API keys: sent as {what}: Bearer <key> (unset: --api-key-file's "
        "first key, else $SPLITSERVE_API_KEY"
        + (", else $OPENAI_API_KEY over HTTP)" if http else ")"),
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        help="a file of API keys as the router's --api-key-file takes (the first is sent)",
    )


def grpc_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """mTLS credentials from ``--tls-*`` (None without); ``ValueError`` saying what to fix."""
    from splitserve.runtime.tls import TlsFiles

    files = TlsFiles.load(args.tls_cert, args.tls_key, args.tls_ca)
    return files.channel_credentials() if files is not None else None


def https_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The client context for an https:// target trusting ``--tls-ca`` (None: the defaults)."""
    if not args.tls_ca:
        return None
    try:
        return ssl.create_default_context(cafile=args.tls_ca)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--tls-ca {args.tls_ca}: cannot load it ({exc})") from None


def api_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else the first key of ``--api-key-file`` (None: neither)."""
    if args.api_key:
        return args.api_key
    if args.api_key_file:
        from splitserve.router.api_keys import read_api_keys

        return read_api_keys(args.api_key_file)[0]
    return None
