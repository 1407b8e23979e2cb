"""OpenAI's JSON in: a ``/v1/completions`` or ``/v1/chat/completions`` body becomes one
``GenerateInput`` per choice (prompts x ``n``); errors go out in OpenAI's error JSON (the
response objects are ``router.http``'s). Plain functions, no I/O (``router.http`` serves them).

Value checks stay where the gRPC API has them (``router.request``): this module only checks what
JSON can get wrong (types, shapes, unsupported fields) and names the field in its message.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import uuid
from dataclasses import dataclass
from typing import Any

from splitserve.models.sampling_params import SamplingParams
from splitserve.router.request import GenerateInput, ModelInfo
from splitserve.runtime.failure import Failure
from splitserve.runtime.slo import SLO_SYNTAX, Slo

MAX_CHOICES = 128  # prompts x n in one HTTP request
# The request's own SLO, in Slo.parse's syntax (the body's "slo" wins where both set a bound),
# and the seconds the client will wait for the whole answer (gRPC: the call's deadline).
SLO_HEADER = "x-splitserve-slo"
TIMEOUT_HEADER = "x-request-timeout"
SLO_BODY_SYNTAX = '{"ttft": SECONDS, "tpot": SECONDS} (either may be left out)'
CHAT_ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role

# A failure → HTTP status and OpenAI error type (the one mapping to HTTP).
HTTP_STATUS = {
    Failure.INVALID: (400, "invalid_request_error"),
    Failure.OUT_OF_RANGE: (400, "invalid_request_error"),
    Failure.PRECONDITION: (400, "invalid_request_error"),
    Failure.NOT_FOUND: (404, "not_found_error"),
    Failure.REFUSED: (429, "rate_limit_error"),
    # A client that cancels gets no answer, and the HTTP front's own API key check answers 401
    # itself: these codes come from the nodes (a cluster token that does not match, a node
    # stopping mid-call).
    Failure.UNAUTHENTICATED: (502, "server_error"),
    Failure.PERMISSION_DENIED: (502, "server_error"),
    Failure.CANCELLED: (502, "server_error"),
    Failure.UNAVAILABLE: (503, "service_unavailable_error"),
    Failure.DEADLINE: (504, "timeout_error"),
}

# Fields OpenAI defines that the engine does not do: refused unless given their no-op value.
UNSUPPORTED = {
    "suffix": (None, ""),
    "best_of": (None, 1),
    "echo": (None, False),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "audio": (None,),
    "prediction": (None,),
}
# Sampling fields taken as they are (OpenAI's and the usual serving extensions).
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "seed",
)
INT32_FIELDS = frozenset({"max_tokens", "top_k", "min_tokens"})  # int32 in common.proto


class ApiError(Exception):
    """An error answered in OpenAI's error JSON."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    @classmethod
    def bad(cls, message: str, param: str | None = None) -> ApiError:
        return cls(400, message, "invalid_request_error", param)

    @property
    def failure(self) -> Failure:
        """The failure the request metrics count a refusal of the HTTP front under."""
        return {
            400: Failure.INVALID,
            404: Failure.NOT_FOUND,
            401: Failure.UNAUTHENTICATED,
            413: Failure.REFUSED,
        }.get(self.status, Failure.INTERNAL)

    @classmethod
    def of_failure(cls, failure: Failure, message: str) -> ApiError:
        status, kind = HTTP_STATUS.get(failure, (500, "server_error"))
        return cls(status, message, kind)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass(frozen=True, slots=True)
class ApiRequest:
    """A checked HTTP request: one GenerateInput per choice, and how to answer."""

    chat: bool
    requests: list[GenerateInput]  # choice i is requests[i]
    n: int  # choices per prompt
    stream: bool
    include_usage: bool
    logprobs: bool  # report the chosen tokens' log-probabilities
    return_token_ids: bool
    request_id: str


def _typed(body: dict, name: str, kind: type) -> Any:
    """The body's ``name`` (None: absent or null), checked to be a ``kind``."""
    value = body.get(name)
    if value is None:
        return None
    what = {bool: "true or false", int: "an integer", str: "a string"}[kind]
    if isinstance(value, bool) and kind is not bool:  # True is an int in Python, not in JSON
        raise ApiError.bad(f"{name} must be {what}, got {value!r}", name)
    if not isinstance(value, kind):
        raise ApiError.bad(f"{name} must be {what}, got {type(value).__name__}", name)
    return value


def _int_list(value: Any) -> bool:
    """A list of token ids: ints in [0, 2**32) (what the protobuf field holds)."""
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in value
    )


def _noop(value: Any, allowed: tuple) -> bool:
    """``value`` is one of ``allowed``, type included (``True`` is not ``1`` here)."""
    return any(type(value) is type(a) and value == a for a in allowed)


def _prompts(body: dict) -> list[GenerateInput]:
    """/v1/completions' ``prompt``: a text, token ids, or a list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (_int_list(prompt) and prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError.bad(
            "prompt must be a string, a list of token ids, or a non-empty list of either", "prompt"
        )
    if not all(isinstance(p, str) or _int_list(p) for p in prompt):
        raise ApiError.bad(
            "each prompt must be a string or a list of token ids (ints >= 0)", "prompt"
        )
    return [
        GenerateInput(text=p) if isinstance(p, str) else GenerateInput(token_ids=tuple(p))
        for p in prompt
    ]


def _content(message: dict, i: int) -> str:
    if "content" not in message:
        raise ApiError.bad(f"messages[{i}] has no content: give it a string", "messages")
    content = message["content"]
    if content is None:
        if message.get("role") != "assistant":  # OpenAI's: only an assistant's may be null
            raise ApiError.bad(f"messages[{i}].content is null: give it a string", "messages")
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text ones
        if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
            raise ApiError.bad(
                f"messages[{i}].content: only parts of type text are supported", "messages"
            )
        return "".join(str(part.get("text", "")) for part in content)
    raise ApiError.bad(f"messages[{i}].content must be a string or a list of parts", "messages")


def _conversation(body: dict) -> GenerateInput:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError.bad("messages must be a non-empty list of {role, content}", "messages")
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError.bad(f"messages[{i}] must be an object with a role", "messages")
        chat.append((CHAT_ROLE_ALIASES.get(m["role"], m["role"]), _content(m, i)))
    return GenerateInput(messages=tuple(chat))


def _sampling(body: dict, chat: bool, model: ModelInfo, logprobs: bool) -> SamplingParams:
    """The body's sampling fields, each checked here for its JSON type and for what its field in
    the nodes' protocol holds (``common.proto``), and for its range by ``SamplingParams`` (the
    message names the field either way)."""
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    # OpenAI's defaults: 16 for a completion, a chat reply may fill the context.
    default = model.max_model_len if chat else 16
    max_tokens = next((body[n] for n in names if body.get(n) is not None), default)
    fields = [("max_tokens", max_tokens), *((f, body.get(f)) for f in SAMPLING_FIELDS)]
    values: dict[str, Any] = {}
    for field, value in fields:
        if value is None:
            continue
        if isinstance(value, bool) != (field == "ignore_eos"):
            what = "true or false" if field == "ignore_eos" else "a number"
            raise ApiError.bad(f"{field} must be {what}, got {json.dumps(value)}", field)
        if field in INT32_FIELDS or field == "seed":
            if not isinstance(value, int):
                raise ApiError.bad(f"{field} must be an integer, got {json.dumps(value)}", field)
            if field == "seed":
                value %= 2**64  # a negative seed as its two's complement (the field is unsigned)
            elif not -(2**31) <= value < 2**31:
                raise ApiError.bad(f"{field} is out of range (a 32-bit integer): {value}", field)
        elif field != "ignore_eos":
            if not isinstance(value, int | float):
                raise ApiError.bad(f"{field} must be a number, got {json.dumps(value)}", field)
            value = _float32(value)
        values[field] = value
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not _int_list(stop_ids):
            raise ApiError.bad("stop_token_ids must be a list of token ids", "stop_token_ids")
        values["stop_token_ids"] = tuple(stop_ids)
    try:
        return SamplingParams(**values, logprobs=logprobs)
    except ValueError as exc:
        raise ApiError.bad(str(exc)) from None


def _float32(value: float) -> float:
    """``value`` as the nodes receive it (a 32-bit float; beyond its range, infinite)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def _logprobs(body: dict, chat: bool) -> bool:
    if chat:
        wanted = bool(_typed(body, "logprobs", bool))
        top = _typed(body, "top_logprobs", int)
    else:  # /v1/completions: logprobs is how many alternatives per position
        top = _typed(body, "logprobs", int)
        wanted = top is not None
    if top:  # None or 0: none asked for
        raise ApiError.bad(
            "top log-probabilities are not supported: the engine reports the chosen token's "
            "(completions: logprobs 0; chat: logprobs true, top_logprobs 0)",
            "top_logprobs" if chat else "logprobs",
        )
    return wanted


def _body_slo(value: Any) -> Slo | None:
    """The body's ``slo``: ``{"ttft": 2, "tpot": 0.1}`` (seconds; null or absent: unset) or a
    string in the header's syntax."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return Slo.parse(value)
        except ValueError as exc:
            raise ApiError.bad(f"slo: {exc}; the syntax is {SLO_SYNTAX}", "slo") from None
    if not isinstance(value, dict):
        raise ApiError.bad(f"slo must be an object {SLO_BODY_SYNTAX}", "slo")
    unknown = sorted(set(value) - {"ttft", "tpot"})
    if unknown:
        raise ApiError.bad(f"slo.{unknown[0]} is not a bound: give {SLO_BODY_SYNTAX}", "slo")
    bounds = {}
    for key in ("ttft", "tpot"):
        x = value.get(key)
        if x is not None and not (
            isinstance(x, int | float) and not isinstance(x, bool) and 0 < x < math.inf
        ):
            raise ApiError.bad(
                f"slo.{key} is {json.dumps(x)}: give a positive number of seconds, as in "
                f"{SLO_BODY_SYNTAX}",
                "slo",
            )
        bounds[key] = None if x is None else float(x)
    return Slo.checked(bounds["ttft"], bounds["tpot"])


def request_slo(body: dict, header: str | None) -> Slo | None:
    """An HTTP request's own SLO: the ``x-splitserve-slo`` header (``Slo.parse``'s syntax), each
    bound the body's ``slo`` sets taking its place; None when neither sets one. ``ApiError``
    (400) saying the syntax on a bad value."""
    try:
        from_header = Slo.parse(header)
    except ValueError as exc:
        raise ApiError.bad(f"{SLO_HEADER} header: {exc}; the syntax is {SLO_SYNTAX}") from None
    from_body = _body_slo(body.get("slo"))
    return from_body.within(from_header) if from_body is not None else from_header


def request_timeout(header: str | None) -> float | None:
    """The ``x-request-timeout`` header: the seconds the client will wait (None: absent);
    ``ApiError`` (400) unless a number > 0."""
    if header is None or not header.strip():
        return None
    try:
        seconds = float(header)
    except ValueError:
        seconds = math.nan
    if not (0 < seconds < math.inf):
        raise ApiError.bad(
            f"{TIMEOUT_HEADER} header is {header[:40]!r}: give the seconds the client will wait "
            "for the answer, a number > 0 (e.g. 30 or 2.5)"
        )
    return seconds


def parse_body(
    body: Any,
    chat: bool,
    model_name: str,
    model: ModelInfo,
    salt: str,
    request_id: str | None,
    slo_header: str | None = None,
) -> ApiRequest:
    """Check an HTTP request's JSON (``slo_header``: the ``x-splitserve-slo`` header's value);
    raise ``ApiError`` (400, 404) on what is wrong."""
    if not isinstance(body, dict):
        raise ApiError.bad("the request body must be a JSON object")
    name = body.get("model")
    if name is not None and name != model_name:
        raise ApiError(404, f"model {str(name)[:100]!r} does not exist; this server serves "
                       f"{model_name!r} (GET /v1/models)", "not_found_error", "model")  # fmt: skip
    for field, allowed in UNSUPPORTED.items():
        if field in body and not _noop(body[field], allowed):
            raise ApiError.bad(f"{field} is not supported by this server: leave it out", field)
    n = _typed(body, "n", int)
    n = 1 if n is None else n
    prompts = [_conversation(body)] if chat else _prompts(body)
    if n < 1 or n * len(prompts) > MAX_CHOICES:
        raise ApiError.bad(f"n must be >= 1 and n x prompts at most {MAX_CHOICES}", "n")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError.bad("stop must be a string or a list of strings", "stop")
    logprobs = _logprobs(body, chat)
    sampling = _sampling(body, chat, model, logprobs)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError.bad("stream_options must be an object", "stream_options")
    stream = bool(_typed(body, "stream", bool))
    # The header (set by a trusted proxy, per tenant) wins over what the client's body says.
    salt = salt or _typed(body, "cache_salt", str) or _typed(body, "user", str) or ""
    slo = request_slo(body, slo_header)
    rid = request_id or uuid.uuid4().hex
    requests = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            choice = sampling
            if n > 1 and sampling.seed is not None:  # choices differ, reproducibly
                choice = dataclasses.replace(sampling, seed=(sampling.seed + j) % 2**64)
            request = dataclasses.replace(
                prompt,
                request_id=rid if len(prompts) * n == 1 else f"{rid}-{i * n + j}",
                sampling=choice,
                max_tokens_set=True,  # OpenAI's defaults are set above
                stop=tuple(stop or ()),
                cache_salt=salt,
                slo=slo,
            )
            requests.append(request)
    return ApiRequest(
        chat=chat,
        requests=requests,
        n=n,
        stream=stream,
        include_usage=stream and bool(options.get("include_usage")),
        logprobs=logprobs,
        return_token_ids=bool(_typed(body, "return_token_ids", bool)),
        request_id=rid,
    )
