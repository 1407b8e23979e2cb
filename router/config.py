"""The router's configuration (``splitserve router``): each option declared once, with its default
and help; the CLI derives its flags and SPLITSERVE_<OPTION> variables from these fields
(``runtime.options``), as it does for the nodes' ``runtime.config.NodeConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.kvstore.hashing import DEFAULT_BLOCK_SIZE, KV_CACHE_DTYPES, QUANTIZATIONS
from splitserve.runtime.config import (
    AUTH_HELP,
    BLOCK_HELP,
    METRICS_FILE_HELP,
    METRICS_HELP,
    OTLP_HELP,
    OTLP_RATIO_HELP,
    PORT_FILE_HELP,
    REDIS_HELP,
    TLS_HELP,
    check_redis_url,
    is_loopback,
    parse_addresses,
    parse_weights,
)
from splitserve.runtime.options import option
from splitserve.runtime.slo import SLO_SYNTAX, Slo


@dataclass(frozen=True, slots=True)
class RouterConfig:
    model_path: str = option(
        help="checkpoint folder or .gguf file, for the tokenizer and the model identity (default: "
        "the embedded SmolLM2-135M-Instruct; `tiny`: the random test model)",
        flag="--model",
        cli_default=None,
    )
    prefill_addresses: tuple[str, ...] = option(
        help="static prefill nodes, host:port,host:port,... (none: the decode nodes prefill "
        "every request themselves)",
        flag="--prefill",
        cli_default="",
        convert=parse_addresses,
    )
    decode_addresses: tuple[str, ...] = option(
        help="static decode nodes, host:port,host:port,...",
        flag="--decode",
        cli_default="",
        convert=parse_addresses,
    )
    host: str = option("127.0.0.1", "listen address")
    port: int = option(0, "listen port (0: a free one)", cli_default=8000)
    port_file: str | None = option(None, PORT_FILE_HELP)
    http_port: int | None = option(
        None, "serve the OpenAI-compatible HTTP API on this port (0: a free one; default: none)"
    )
    http_port_file: str | None = option(None, "write the bound HTTP port here once serving")
    http_host: str | None = option(
        None,
        "listen address of the HTTP API (default: --host; with --tls-* a loopback address "
        "unless the HTTP API has --http-tls-cert/--http-tls-key and --api-key-file too)",
    )
    api_key_file: str | None = option(
        None,
        "a file of API keys, one a line (blank lines and # comments ignored): both public APIs "
        "then answer only requests with a key of it, the HTTP API as Authorization: Bearer <key> "
        "(401 otherwise; /health stays open), the gRPC API as the metadata authorization: Bearer "
        "<key> (UNAUTHENTICATED otherwise; the health service stays open); read again when it "
        "changes (default: none, both APIs are open)",
    )
    http_tls_cert: str | None = option(
        None, "serve the HTTP API over HTTPS with this certificate (chain, PEM; with its key)"
    )
    http_tls_key: str | None = option(None, "the private key of --http-tls-cert (PEM)")
    served_model_name: str | None = option(
        None, "the model's name in the HTTP API (default: the checkpoint folder's name)"
    )
    tokenizer_path: str | None = option(
        None,
        "tokenizer folder (default: the checkpoint's; a checkpoint without tokenizer files "
        "serves token-id prompts only)",
        flag="--tokenizer",
    )
    request_timeout_s: float = option(600.0, "seconds a request may take in all")
    max_attempts: int = option(3, "per stage: a failed or refusing node is retried elsewhere")
    max_requests_per_client: int = option(
        1024,
        "requests one client may have in flight (client: the x-splitserve-client metadata, else "
        "its host); more: RESOURCE_EXHAUSTED",
    )
    max_queue: int = option(
        4096, "requests that may wait for a decode node with room; more: RESOURCE_EXHAUSTED"
    )
    queue_timeout_s: float = option(
        300.0, "how long a request may wait for a decode node with room (RESOURCE_EXHAUSTED)"
    )
    max_loop_lag_s: float = option(
        0.5,
        "refuse new requests at once (RESOURCE_EXHAUSTED, reason router_busy) while the router's "
        "event loop runs this many seconds late: the wait before a request's handler, which its "
        "deadline and TTFT count from the call's arrival either way (0: never refuse for it)",
    )
    slo: Slo | None = option(
        None,
        f"the default latency targets, {SLO_SYNTAX}: a request that must queue and is predicted "
        "to miss its TTFT target, or that waits until it can no longer meet it, is refused at "
        "once (RESOURCE_EXHAUSTED), before any node works on it; a decode node takes a request "
        "only while its batch is predicted within the TPOT target. A request may carry its own "
        "(gRPC: GenerateRequest.slo; HTTP: the x-splitserve-slo header or the body's slo); a "
        "client deadline caps the TTFT target (default: none, requests wait up to their deadline "
        "or --queue-timeout-s)",
        cli_default="",
        convert=Slo.parse,
    )
    client_weights: dict[str, float] | None = option(
        None,
        "weighted fair queuing between clients in the router's queue: CLIENT=WEIGHT,... (a "
        "client is an API key's name, key- and 12 hex digits as logged, else the "
        "x-splitserve-client metadata or header, else the caller's host; unnamed clients weigh "
        "1). Each client gets its weight's share of what the pools let go, so one client's "
        "burst cannot take the others' turns",
        cli_default="",
        convert=parse_weights,
    )
    decode_overcommit: float = option(
        1.5,
        "router requests a decode node may hold, as a multiple of its max_num_seqs (those in "
        "prefill or transfer do not decode yet; the node queues the excess); the rest wait in "
        "the router's queue",
    )
    decode_kv_headroom: float = option(
        0.02,
        "share of each decode node's KV blocks kept out of the router's admission budget: a "
        "request goes to a prefill node only once its decode node can hold its KV (its prompt's "
        "blocks, a block shared with other requests once, and its output's)",
    )
    decode_kv_reserve_tokens: int = option(
        256,
        "output tokens of each request whose KV blocks are charged to its decode node before it "
        "is sent (min with its max_tokens; blocks its output fills beyond are charged as it "
        "grows)",
    )
    prefill_queue_tokens: int = option(
        0,
        "prompt tokens of this router's requests a prefill node may have to compute at once; "
        "beyond, requests wait in the router's queue (0: 4 x the node's --max-num-batched-tokens)",
    )
    direct_prefill_tokens: int = option(
        0,
        "send a request straight to its decode node, which prefills it itself (no KV transfer), "
        "when its prompt has at most this many tokens not cached on that node (0: never; a "
        "cluster without usable prefill nodes always does). Measure the break-even of your "
        "model, GPUs and transfer path with benchmarks before setting it (docs/deploy.md)",
    )
    direct_prefill_backlog_tokens: int = option(
        0,
        "also go direct when every prefill node has at least this many prompt tokens of this "
        "router's requests in flight and the decode node has a free batch slot (0: never)",
    )
    redis_url: str | None = option(None, REDIS_HELP)
    dtype: str | None = option(
        None, "the nodes' dtype, part of the model identity (default: the checkpoint's)"
    )
    quantization: str | None = option(
        None,
        "the nodes' --quantization, part of the model identity (default: the checkpoint's)",
        choices=QUANTIZATIONS,
    )
    kv_cache_dtype: str = option(
        "auto",
        "the nodes' --kv-cache-dtype, part of the model identity",
        choices=KV_CACHE_DTYPES,
    )
    metrics_port: int | None = option(None, METRICS_HELP)
    metrics_port_file: str | None = option(None, METRICS_FILE_HELP)
    otlp_endpoint: str | None = option(None, OTLP_HELP)
    otlp_sample_ratio: float | None = option(None, OTLP_RATIO_HELP)
    auth_token_file: str | None = option(None, AUTH_HELP)
    tls_cert: str | None = option(None, TLS_HELP + "its certificate")
    tls_key: str | None = option(None, TLS_HELP + "its private key")
    tls_ca: str | None = option(None, TLS_HELP + "the CA that signs every component's certificate")
    max_request_bytes: int = option(
        4 << 20, "the largest request the public API accepts, in bytes (RESOURCE_EXHAUSTED above)"
    )
    block_size: int = option(DEFAULT_BLOCK_SIZE, BLOCK_HELP)
    reuse_port: bool = option(
        False,
        "bind the gRPC and HTTP ports with SO_REUSEPORT, so that several routers share one "
        "address (the kernel spreads connections over them; the decode nodes lease their "
        "capacity to each as it needs it)",
    )
    capacity_share: float = option(
        1.0,
        "the most of every node's capacity this router may fill (decode slots and KV blocks, "
        "prefill queued tokens): a cap on the lease it asks decode nodes for; at nodes that grant "
        "no leases (an older version) its whole share, e.g. 1/N each of N routers",
    )

    def __post_init__(self) -> None:
        if self.max_loop_lag_s < 0:
            raise ValueError(f"--max-loop-lag-s: >= 0, got {self.max_loop_lag_s}")
        check_redis_url(self.redis_url)
        if not 0.0 < self.capacity_share <= 1.0:
            raise ValueError(f"--capacity-share: in (0, 1], got {self.capacity_share}")
        if self.direct_prefill_tokens < 0 or self.direct_prefill_backlog_tokens < 0:
            raise ValueError("--direct-prefill-tokens and --direct-prefill-backlog-tokens: >= 0")
        if not 0.0 <= self.decode_kv_headroom < 1.0:
            raise ValueError(f"--decode-kv-headroom: in [0, 1), got {self.decode_kv_headroom}")
        if self.decode_kv_reserve_tokens < 0 or self.prefill_queue_tokens < 0:
            raise ValueError("--decode-kv-reserve-tokens and --prefill-queue-tokens: >= 0")
        if bool(self.http_tls_cert) != bool(self.http_tls_key):
            raise ValueError("--http-tls-cert and --http-tls-key: give both or neither")
        host = self.http_host or self.host
        guarded = bool(self.http_tls_cert and self.api_key_file)
        if self.http_port is not None and self.tls_cert and not guarded and not is_loopback(host):
            raise ValueError(
                "--http-port with --tls-*: an HTTP API without HTTPS and API keys would be an "
                "open door beside the mTLS-only gRPC port; give it --http-tls-cert/--http-tls-key "
                f"and --api-key-file, or listen on loopback (--http-host 127.0.0.1, now {host}) "
                "behind a TLS-terminating, authenticating proxy"
            )
