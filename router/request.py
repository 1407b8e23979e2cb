"""Turning a public ``GenerateRequest`` into a checked plain request, before any node is asked."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# NOTE: the router validates with the nodes' own SamplingParams (so both agree on what is valid);
# models.sampling_params is plain Python: importing it loads no torch.
from splitserve.kvstore.hashing import MAX_SALT_CHARS
from splitserve.models.sampling_params import SamplingParams
from splitserve.runtime.protocol import sampling_from_proto
from splitserve.v1 import router_pb2

MAX_STOP_STRINGS = 16


class InvalidRequest(ValueError):
    """A user mistake; the message names the field and says what to change."""


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the router needs to know about the served model."""

    tokenizer: Any  # a transformers tokenizer
    vocab_size: int
    max_model_len: int  # max_position_embeddings

    @classmethod
    def load(cls, model_path: str | Path) -> ModelInfo:
        """Read the tokenizer and config.json of a checkpoint folder (no weights, no torch)."""
        from transformers import AutoTokenizer

        path = Path(model_path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{path} has no config.json: pass a Hugging Face checkpoint folder")
        config = json.loads(config_file.read_text())
        config = config.get("text_config", config)
        tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(
            tokenizer=tokenizer,
            vocab_size=int(config["vocab_size"]),
            max_model_len=int(config.get("max_position_embeddings", 2048)),
        )

    @property
    def max_prompt_tokens(self) -> int:
        return self.max_model_len - 1  # room for at least one generated token


@dataclass(frozen=True, slots=True)
class GenerateParams:
    """A checked request: what the router sends on to the nodes."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stop: tuple[str, ...]
    cache_salt: str


def parse_request(request: router_pb2.GenerateRequest, model: ModelInfo) -> GenerateParams:
    """Check and tokenize ``request``; raise ``InvalidRequest`` on any user mistake."""
    if request.WhichOneof("prompt") == "token_ids":
        token_ids = tuple(request.token_ids.ids)
        field = "token_ids"
        bad = [(i, t) for i, t in enumerate(token_ids) if t >= model.vocab_size]
        if bad:
            i, t = bad[0]
            raise InvalidRequest(
                f"token_ids.ids[{i}] = {t} is not a token of this model: ids must be in "
                f"[0, {model.vocab_size}) ({len(bad)} bad id(s))"
            )
    else:
        token_ids = tuple(model.tokenizer(request.text).input_ids) if request.text else ()
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
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} allowed")
    for i, s in enumerate(stop):
        if not s:
            raise InvalidRequest(f"stop[{i}] is an empty string: remove it")
    try:
        sampling = sampling_from_proto(request.sampling)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    return GenerateParams(
        request_id=request.request_id or uuid.uuid4().hex,
        prompt_token_ids=token_ids,
        sampling=sampling,
        stop=stop,
        cache_salt=request.cache_salt,
    )
