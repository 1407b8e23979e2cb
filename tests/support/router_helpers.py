"""What the router's tests share: the byte tokenizer, a tiny model's info, request messages."""

from __future__ import annotations

from splitserve.models.tiny import build_byte_tokenizer
from splitserve.router.request import GenerateInput, ModelInfo
from splitserve.router.service import input_of
from splitserve.v1 import common_pb2, router_pb2

TOKENIZER = build_byte_tokenizer()
EOS = TOKENIZER.eos_token_id
MODEL = ModelInfo(tokenizer=TOKENIZER, vocab_size=320, max_model_len=64)


def byte_ids(text: str) -> list[int]:
    return list(text.encode())


def request(**kwargs) -> GenerateInput:
    """A public request as the gRPC front hands it on (``router.service.input_of``: it raises
    ``InvalidRequest`` on a sampling value or SLO bound out of range);
    ``prompt``/``prompt_token_ids`` as the client SDK names them."""
    return input_of(request_message(**kwargs))


def request_message(**kwargs) -> router_pb2.GenerateRequest:
    """The ``GenerateRequest`` a client sends."""
    sampling = kwargs.pop("sampling", {})
    if "prompt" in kwargs:
        kwargs["text"] = kwargs.pop("prompt")
    if "prompt_token_ids" in kwargs:
        kwargs["token_ids"] = router_pb2.TokenIds(ids=kwargs.pop("prompt_token_ids"))
    return router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(**sampling), **kwargs)
