"""Every environment variable splitserve reads, declared once: its name, the values it takes, its
default and a line of meaning. Code reads a variable only through its declaration here;
tests/unit/test_settings.py fails on a read of the environment anywhere else in the package.
``splitserve env`` lists them all, and docs/deploy.md's last section is that list.

Two sources of declarations:

- the table below: knobs that are not command-line options, the SDK's key, other libraries'
  variables splitserve reads or sets, and the handshakes between its own processes;
- every option of ``splitserve prefill|decode|router``: its ``SPLITSERVE_<OPTION>`` variable is
  declared by the option itself (runtime/options.py reads it through :func:`option_value`).

The lowest layer of the package (it imports nothing of splitserve): kernels read it too.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")

KINDS = {
    "tuning": "a knob with no command-line option: measurement, kernel tilings, limits",
    "client": "read by the client SDK and the benchmark client",
    "library": "another library's variable: read, or set by splitserve unless already given",
    "internal": "handed by a splitserve process to the processes it starts; never set it by hand",
}
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _environ(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


@dataclass(frozen=True, slots=True)
class Setting(Generic[T]):
    """One environment variable: ``get()`` its value (``default`` when unset or empty),
    ``ValueError`` naming the variable and what it takes for a bad one."""

    name: str
    kind: str
    default: T
    takes: str  # the values it takes, as a reader would write them
    help: str
    parse: Callable[[str], T]

    def raw(self, environ: Mapping[str, str] | None = None) -> str:
        """The variable's text, stripped ("" when unset)."""
        return _environ(environ).get(self.name, "").strip()

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        raw = self.raw(environ)
        if not raw:
            return self.default
        try:
            return self.parse(raw)
        except ValueError:
            raise ValueError(f"{self.name}={raw!r}: expected {self.takes}") from None

    def set_default(self, value: str, environ: MutableMapping[str, str] | None = None) -> str:
        """Set the variable unless it is given (another library reads it); the value in force."""
        env = os.environ if environ is None else environ
        return env.setdefault(self.name, value)

    def put(self, value: str, environ: MutableMapping[str, str] | None = None) -> None:
        """Set the variable for this process and those it starts."""
        (os.environ if environ is None else environ)[self.name] = value

    def take(self) -> str:
        """Read and remove (a handshake meant for this process, not for those it starts)."""
        return os.environ.pop(self.name, "").strip()


REGISTRY: dict[str, Setting[Any]] = {}


def _declare(name: str, kind: str, default: T, takes: str, help: str,
             parse: Callable[[str], T]) -> Setting[T]:  # fmt: skip
    assert kind in KINDS and name not in REGISTRY, name
    setting = Setting(name, kind, default, takes, help, parse)
    REGISTRY[name] = setting
    return setting


# What a value takes: each parser raises ValueError for anything else.


def _number(lo: float, hi: float, *, above: bool = False) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        value = float(raw)
        if not ((lo < value) if above else (lo <= value)) or not value <= hi:
            raise ValueError(raw)
        return value

    return parse


def _integer(lo: int, hi: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw)
        if not lo <= value <= hi:
            raise ValueError(raw)
        return value

    return parse


def _choice(*values: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw not in values:
            raise ValueError(raw)
        return raw

    return parse


def _switch(raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(raw)


def _integers(*counts: int) -> Callable[[str], tuple[int, ...]]:
    def parse(raw: str) -> tuple[int, ...]:
        values = tuple(int(x) for x in raw.split(","))
        if len(values) not in counts:
            raise ValueError(raw)
        return values

    return parse


def _text(raw: str) -> str:
    return raw


# -- tuning ---------------------------------------------------------------------------------

ENGINE_STOP_TIMEOUT_S = _declare(
    "SPLITSERVE_ENGINE_STOP_TIMEOUT_S", "tuning", 20.0, "seconds in (0, 3600]",
    "how long stopping a node's engine process may take before it is killed (fit it to a "
    "container's stop grace period)",
    _number(0, 3600, above=True),
)  # fmt: skip
MIN_STEP_MS = _declare(
    "SPLITSERVE_MIN_STEP_MS", "tuning", 0.0, "milliseconds from 0 to 60000",
    "a floor under every engine step (the engine sleeps the rest): a slower GPU, for measuring",
    _number(0, 60_000),
)  # fmt: skip
STEP_PROFILE = _declare(
    "SPLITSERVE_STEP_PROFILE", "tuning", "", "a path prefix",
    "each node's engine times every step's phases and writes PATH.ROLE.PID.json when it "
    "stops (for measurement runs: it keeps a row per step)",
    _text,
)  # fmt: skip
GIL_SWITCH_INTERVAL_MS = _declare(
    "SPLITSERVE_GIL_SWITCH_INTERVAL_MS", "tuning", None, "milliseconds in (0, 1000]",
    "a node's interpreter switch interval (unset: Python's 5 ms)",
    _number(0, 1000, above=True),
)  # fmt: skip
ROUTER_TORCH = _declare(
    "SPLITSERVE_ROUTER_TORCH", "tuning", False, "1/true/yes/on or 0/false/no/off",
    "let the router process import torch (for a tokenizer that needs it; it starts slower)",
    _switch,
)  # fmt: skip
DECODE_FP8_V = _declare(
    "SPLITSERVE_DECODE_FP8_V", "tuning", "pairs", "pairs or bytes",
    "how the decode attention kernel reads an e4m3 cache's V (read at import)",
    _choice("pairs", "bytes"),
)  # fmt: skip
DECODE_ATTENTION_CONFIG = _declare(
    "SPLITSERVE_DECODE_ATTENTION_CONFIG", "tuning", None,
    "block_n,num_warps,num_stages[,max_registers], e.g. 64,4,3",
    "replaces the decode attention kernel's tiling for both KV dtypes (read at import)",
    _integers(3, 4),
)  # fmt: skip
PREFILL_ATTENTION_STAGES = _declare(
    "SPLITSERVE_PREFILL_ATTENTION_STAGES", "tuning", None, "a number of stages from 1 to 8",
    "replaces the pipeline depth of the prefill attention kernel's tilings (read at import)",
    _integer(1, 8),
)  # fmt: skip

# -- client ---------------------------------------------------------------------------------

API_KEY = _declare(
    "SPLITSERVE_API_KEY", "client", "", "an API key",
    "the key the client SDK, `splitserve generate` and `splitserve bench` send when none is "
    "given",
    _text,
)  # fmt: skip
OPENAI_API_KEY = _declare(
    "OPENAI_API_KEY", "client", "", "an API key",
    "`splitserve bench`'s key for an OpenAI-compatible endpoint when neither --api-key nor "
    "SPLITSERVE_API_KEY gives one",
    _text,
)  # fmt: skip

# -- other libraries' -----------------------------------------------------------------------

CUDA_VISIBLE_DEVICES = _declare(
    "CUDA_VISIBLE_DEVICES", "library", "", "GPU indices or UUIDs, comma-separated",
    "the GPUs a node may claim, in the order tried; a node that claims one pins the order here "
    "before CUDA starts",
    _text,
)  # fmt: skip
OTEL_EXPORTER_OTLP_ENDPOINT = _declare(
    "OTEL_EXPORTER_OTLP_ENDPOINT", "library", "", "a URL",
    "turns tracing on without --otlp-endpoint (OpenTelemetry's own variable)",
    _text,
)  # fmt: skip
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT = _declare(
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "library", "", "a URL",
    "as OTEL_EXPORTER_OTLP_ENDPOINT, for traces only",
    _text,
)  # fmt: skip
OTEL_EXPORTER_OTLP_PROTOCOL = _declare(
    "OTEL_EXPORTER_OTLP_PROTOCOL", "library", "http/protobuf", "http/protobuf or grpc",
    "the OTLP exporter's protocol",
    _text,
)  # fmt: skip
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL = _declare(
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "library", "", "http/protobuf or grpc",
    "as OTEL_EXPORTER_OTLP_PROTOCOL, for traces only (wins over it)",
    _text,
)  # fmt: skip
OTEL_SERVICE_NAME = _declare(
    "OTEL_SERVICE_NAME", "library", "", "a name",
    "the traces' service.name (default: the component, e.g. splitserve-router)",
    _text,
)  # fmt: skip
GRPC_ENABLE_FORK_SUPPORT = _declare(
    "GRPC_ENABLE_FORK_SUPPORT", "library", "false", "true or false",
    "set to false by the command line: grpcio's fork handlers can deadlock `splitserve up`'s "
    "forks, and no splitserve process uses gRPC across a fork",
    _text,
)  # fmt: skip
TRANSFORMERS_NO_ADVISORY_WARNINGS = _declare(
    "TRANSFORMERS_NO_ADVISORY_WARNINGS", "library", "", "1",
    "set to 1 in the router, which runs transformers without torch on purpose",
    _text,
)  # fmt: skip
MC_STORE_CLIENT_SETUP_RETRIES = _declare(
    "MC_STORE_CLIENT_SETUP_RETRIES", "library", "", "a number of attempts",
    "set to 1 by a node that opens a Mooncake store: a master that is down costs one attempt "
    "(about 4 s), not twenty (90 s)",
    _text,
)  # fmt: skip
TORCH_NCCL_ASYNC_ERROR_HANDLING = _declare(
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "library", "", "0, 1, 2 or 3",
    "set to 2 by a node that transfers KV over NCCL: a peer failing mid-transfer aborts the "
    "communicator, not the process (3, torch's default, ends the process)",
    _text,
)  # fmt: skip

# -- internal -------------------------------------------------------------------------------

GPU_LOCK_FDS = _declare(
    "SPLITSERVE_GPU_LOCK_FDS", "internal", "", "file descriptors, comma-separated",
    "the GPU locks a node hands its engine process, which holds them while it lives",
    _text,
)  # fmt: skip
PARENT_PID = _declare(
    "SPLITSERVE_PARENT_PID", "internal", "", "a process id",
    "the process a helper (engine process, tensor-parallel rank) must end with",
    _text,
)  # fmt: skip


def problems(*checked: Setting[Any]) -> list[str]:
    """What is wrong with the values of ``checked`` (each a line naming its variable): for a
    command to refuse to start with, before anything reads them deeper in."""
    out = []
    for setting in checked:
        try:
            setting.get()
        except ValueError as exc:
            out.append(str(exc))
    return out


# What a node reads (its engine, the kernels at import), and what a router reads.
NODE_SETTINGS = (
    ENGINE_STOP_TIMEOUT_S,
    MIN_STEP_MS,
    STEP_PROFILE,
    GIL_SWITCH_INTERVAL_MS,
    DECODE_FP8_V,
    DECODE_ATTENTION_CONFIG,
    PREFILL_ATTENTION_STAGES,
)
ROUTER_SETTINGS = (ROUTER_TORCH,)


def option_value(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The text of a command-line option's variable (``SPLITSERVE_<OPTION>``), stripped: declared
    by the option (runtime/options.py), read here."""
    return _environ(environ).get(name, "").strip()


def environment(**overrides: str) -> dict[str, str]:
    """A copy of this process's environment with ``overrides``, for a process it starts."""
    return {**os.environ, **overrides}


def declared() -> Iterator[Setting[Any]]:
    """The declarations of the table above, by kind then name."""
    order = list(KINDS)
    yield from sorted(REGISTRY.values(), key=lambda s: (order.index(s.kind), s.name))
