"""Assembles a request's output: token batches from the nodes in, public deltas out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from splitserve.router.detokenizer import IncrementalDetokenizer, StopStringMatcher


class Delta(NamedTuple):
    """What one public stream message carries (plain values; the servicer makes the proto)."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "" while the request goes on


class OutputAssembler:
    """Detokenizes incrementally, applies stop strings and counts completion tokens.

    Tokens are fed one at a time through the detokenizer so that a stop string cuts the token
    list right after the token that completed it (that token is reported; later ones are not).
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        # No tokenizer (a token-id-only model): token ids only, text stays empty.
        self._detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._stop = StopStringMatcher(stop)
        self.num_tokens = 0
        self.finish_reason = ""

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)

    def add(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float] = (),
        finish_reason: str = "",
    ) -> Delta:
        """Feed the node's next tokens; ``finish_reason`` set when the node finished."""
        assert not self.finished, "the request already finished"
        text: list[str] = []
        taken: list[int] = []
        for token_id in token_ids:
            taken.append(token_id)
            piece = self._detok.add((token_id,)) if self._detok is not None else ""
            out, stopped = self._stop.add(piece)
            text.append(out)
            if stopped:
                self.finish_reason = "stop"
                break
        if finish_reason and not self.finished:
            out, stopped = self._stop.add(self._detok.flush() if self._detok is not None else "")
            text.append(out)
            if not stopped:
                text.append(self._stop.flush())
            self.finish_reason = "stop" if stopped else finish_reason
        self.num_tokens += len(taken)
        return Delta("".join(text), taken, list(logprobs[: len(taken)]), self.finish_reason)
