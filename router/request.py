"""A public request as either front received it (``GenerateInput``: plain values, no protobuf),
checked and tokenized into what the router sends on (``GenerateParams``) before any node is
asked; and how a request ends when it cannot be served (``GenerateError``)."""

from __future__ import annotations

import json
import logging
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# NOTE: the router validates with the nodes' own SamplingParams (so both agree on what is valid);
# models.sampling_params is plain Python: importing it loads no torch.
import splitserve.settings as settings
from splitserve.kvstore.hashing import MAX_SALT_CHARS
from splitserve.models.sampling_params import SamplingParams
from splitserve.runtime.failure import Failure
from splitserve.runtime.slo import Slo

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string: matching holds back and scans up to this much text
MAX_CHAT_MESSAGES = 1024
CHAT_ROLES = ("system", "user", "assistant")
# What a tokenizer folder holds (any one of them): fast, SentencePiece, BPE, WordPiece, tiktoken.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "tokenizer.tiktoken",
)

logger = logging.getLogger(__name__)


class InvalidRequest(ValueError):
    """A user mistake; the message names the field and says what to change."""


class GenerateError(Exception):
    """Ends a request that cannot be served: its failure (``runtime.failure.Failure``) and a
    message for the client, with a retry hint when refused."""

    def __init__(
        self,
        code: Failure,
        message: str,
        retry_after_s: int | None = None,
        reason: str = "",
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        # A refusal for want of room: when to try again (HTTP Retry-After; gRPC's
        # grpc-retry-pushback-ms trailer). None: not a refusal of that kind.
        self.retry_after_s = retry_after_s
        self.reason = reason  # a refusal's reason as /metrics counts it ("": not a refusal)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the router needs to know about the served model."""

    tokenizer: Any  # a transformers tokenizer; None: token-id prompts only
    vocab_size: int
    max_model_len: int  # max_position_embeddings
    tokenizer_source: str = ""  # the folder it came from (for messages)

    def need_tokenizer(self, what: str) -> Any:
        """The tokenizer, or ``InvalidRequest`` saying that ``what`` needs one."""
        if self.tokenizer is None:
            raise InvalidRequest(
                f"{what} needs a tokenizer and this model has none ({self.tokenizer_source} has "
                "no tokenizer files): send token_ids, or start the router with --tokenizer PATH"
            )
        return self.tokenizer

    @classmethod
    def load(cls, model_path: str | Path, tokenizer_path: str | Path | None = None) -> ModelInfo:
        """Read config.json of a checkpoint folder and the tokenizer (no weights, no torch): from
        ``tokenizer_path`` if given (it must load), else from the checkpoint, where a folder with
        no tokenizer files at all serves token-id prompts only (``tokenizer`` None)."""
        path = Path(model_path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{path} has no config.json: pass a Hugging Face checkpoint folder")
        config = json.loads(config_file.read_text())
        config = config.get("text_config", config)
        if tokenizer_path is not None:
            tokenizer = _load_tokenizer(Path(tokenizer_path))
        elif not any((path / name).exists() for name in TOKENIZER_FILES):
            logger.warning(
                "%s has no tokenizer files: serving token-id prompts only (text and chat "
                "requests are refused); --tokenizer PATH takes one from another folder",
                path,
            )
            tokenizer = None
        else:
            tokenizer = _load_tokenizer(path)
        return cls(
            tokenizer=tokenizer,
            vocab_size=int(config["vocab_size"]),
            max_model_len=int(config.get("max_position_embeddings", 2048)),
            tokenizer_source=str(tokenizer_path or path),
        )

    @property
    def max_prompt_tokens(self) -> int:
        return self.max_model_len - 1  # room for at least one generated token


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """A public request as a front received it, not yet checked: the gRPC servicer makes it from
    a ``GenerateRequest`` (``router.service.input_of``), the HTTP front from OpenAI's JSON
    (``router.openai_api.parse_body``). The prompt is ``token_ids`` when set, else ``messages``
    when set (a chat: (role, content) pairs), else ``text``."""

    request_id: str = ""  # "": the router makes one
    text: str = ""
    token_ids: tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens_set: bool = False  # False: max_tokens is the default, "as many as fit"
    stop: tuple[str, ...] = ()
    cache_salt: str = ""
    slo: Slo | None = None  # the request's own targets (the router's --slo fills the rest)


@dataclass(frozen=True, slots=True)
class GenerateParams:
    """A checked request: what the router sends on to the nodes."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stop: tuple[str, ...]
    cache_salt: str


def parse_request(request: GenerateInput, model: ModelInfo) -> GenerateParams:
    """Check and tokenize ``request``; raise ``InvalidRequest`` on any user mistake."""
    if request.token_ids is not None:
        token_ids = request.token_ids
        field = "token_ids"
        bad = [(i, t) for i, t in enumerate(token_ids) if not 0 <= t < model.vocab_size]
        if bad:
            i, t = bad[0]
            raise InvalidRequest(
                f"token_ids.ids[{i}] = {t} is not a token of this model: ids must be in "
                f"[0, {model.vocab_size}) ({len(bad)} bad id(s))"
            )
    elif request.messages is not None:
        token_ids = chat_token_ids(request.messages, model)
        field = "messages"
    else:
        tokenizer = model.need_tokenizer("a text prompt")
        token_ids = tuple(tokenizer(request.text).input_ids) if request.text else ()
        field = "text"
    if not token_ids:
        raise InvalidRequest("the prompt is empty: give a non-empty text or token_ids")
    if len(token_ids) > model.max_prompt_tokens:
        raise InvalidRequest(
            f"{field} is {len(token_ids)} tokens long; the model's context is "
            f"{model.max_model_len} tokens, so a prompt may have at most "
            f"{model.max_prompt_tokens}: shorten it"
        )
    if len(request.cache_salt) > MAX_SALT_CHARS:
        raise InvalidRequest(
            f"cache_salt has {len(request.cache_salt)} characters; at most {MAX_SALT_CHARS}"
        )
    stop = tuple(request.stop)
    if stop:
        model.need_tokenizer("stop (strings)")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} allowed")
    for i, s in enumerate(stop):
        if not s:
            raise InvalidRequest(f"stop[{i}] is an empty string: remove it")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(f"stop[{i}] has {len(s)} characters; at most {MAX_STOP_CHARS}")
    sampling = request.sampling
    room = model.max_model_len - len(token_ids)
    if sampling.max_tokens > room:
        if request.max_tokens_set and sampling.max_tokens != model.max_model_len:
            raise InvalidRequest(
                f"this model's maximum context length is {model.max_model_len} tokens; you "
                f"requested {len(token_ids) + sampling.max_tokens} ({len(token_ids)} in the "
                f"{field}, {sampling.max_tokens} in the completion): set max_tokens to at most "
                f"{room}, or shorten the prompt"
            )
        # NOTE: the default (16) and a max_tokens of the whole context (the HTTP API's default
        # for a chat reply, as OpenAI's) mean "as many as fit": what the prompt leaves.
        sampling = replace(sampling, max_tokens=room, min_tokens=min(sampling.min_tokens, room))
    return GenerateParams(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_token_ids=token_ids,
        sampling=sampling,
        stop=stop,
        cache_salt=request.cache_salt,
    )


def chat_token_ids(messages: Sequence[tuple[str, str]], model: ModelInfo) -> tuple[int, ...]:
    """A conversation rendered with the tokenizer's chat template (the assistant's turn
    prompted), then tokenized as is: the template writes any special tokens itself."""
    tokenizer = model.need_tokenizer("a chat request")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest(
            f"the tokenizer of {model.tokenizer_source} has no chat template: send text or "
            "token_ids, or start the router with --tokenizer PATH naming one that has"
        )
    if not messages:
        raise InvalidRequest("messages is empty: give at least one message")
    if len(messages) > MAX_CHAT_MESSAGES:
        raise InvalidRequest(f"messages has {len(messages)} entries; at most {MAX_CHAT_MESSAGES}")
    for i, (role, _) in enumerate(messages):
        if role not in CHAT_ROLES:
            raise InvalidRequest(
                f"messages[{i}].role is {role[:32]!r}: it must be one of {', '.join(CHAT_ROLES)}"
            )
    conversation = [{"role": role, "content": content} for role, content in messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # jinja2's TemplateError and what a template raises on purpose
        raise InvalidRequest(f"messages: the model's chat template refused them: {exc}") from None
    return tuple(tokenizer(text, add_special_tokens=False).input_ids)


def keep_torch_out() -> bool:
    """Block torch in this process unless it is already imported or ``$SPLITSERVE_ROUTER_TORCH``
    is 1; True when blocked. Call before anything imports transformers.

    The router runs no model: it tokenizes (transformers' tokenizers over the ``tokenizers``
    library), renders chat templates and hashes prompt blocks, none of which needs torch. But
    transformers imports torch whenever it finds it installed, most of a router's start and
    memory. With ``sys.modules["torch"] = None`` (Python's documented way to block an import)
    transformers takes its torch-less path; the tokens are the same
    (tests/cluster/test_router_no_torch.py compares them with a tokenizer loaded beside torch).
    """
    if "torch" in sys.modules or settings.ROUTER_TORCH.get():
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]  # import torch: ModuleNotFoundError
    # transformers' one advisory at import ("PyTorch was not found ...") is expected here.
    settings.TRANSFORMERS_NO_ADVISORY_WARNINGS.set_default("1")
    return True


def _load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        hint = ""
        if sys.modules.get("torch", False) is None:  # keep_torch_out blocked it
            escape = settings.ROUTER_TORCH.name
            hint = f" (the router loads no torch; {escape}=1 lets it, for a tokenizer needing it)"
        raise ValueError(f"cannot load a tokenizer from {path}: {exc}{hint}") from None
