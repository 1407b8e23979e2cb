"""OpenAI's response objects made from the router's output: log-probabilities, usage, and one
choice gathered for a non-streamed answer (``router.http`` assembles the responses)."""

from __future__ import annotations

from typing import Any

from splitserve.router.orchestrator import Step
from splitserve.router.request import ModelInfo


def token_text(model: ModelInfo, token_id: int) -> str:
    if model.tokenizer is None:
        return f"token_id:{token_id}"
    return model.tokenizer.decode([token_id])


def logprobs_json(
    model: ModelInfo, chat: bool, token_ids: list[int], logprobs: list[float]
) -> dict[str, Any]:
    tokens = [token_text(model, t) for t in token_ids]
    if chat:
        return {
            "content": [
                {"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
                for tok, lp in zip(tokens, logprobs, strict=False)
            ]
        }
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None}


def usage_json(usages: list[tuple[int, Any]], n: int) -> dict[str, Any]:
    """OpenAI's usage of a request: each prompt counted once, every choice's completion."""
    prompt = sum(u.prompt_tokens for i, u in usages if i % n == 0)
    cached = sum(u.cached_tokens for i, u in usages if i % n == 0)
    completion = sum(u.completion_tokens for _, u in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class Choice:
    """One choice's output, gathered for a non-streamed answer."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.usage = None

    def add(self, step: Step) -> None:
        self.text.append(step.delta.text)
        self.token_ids.extend(step.delta.token_ids)
        self.logprobs.extend(step.delta.logprobs)
        if step.delta.finish_reason:
            self.finish_reason = step.delta.finish_reason
        if step.usage is not None:
            self.usage = step.usage
