"""A request's output step: each batch of its tokens from the decode node in, one public message
out. Incremental detokenizing, stop strings, the completion count and usage, and the request
metrics as the client sees them (time to first token, inter-token latency, how it ended), done
once per batch (``RequestOutput.add``). Plain values out: the fronts make protobuf or JSON."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from splitserve.router.metrics import RouterMetrics
from splitserve.runtime.failure import Failure
from splitserve.runtime.protocol import Usage
from splitserve.runtime.slo import Slo


class Delta(NamedTuple):
    """What one public stream message carries (plain values; the servicer makes the proto)."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "" while the request goes on


class Step(NamedTuple):
    """One public stream message's content; ``usage`` only on the last one."""

    delta: Delta
    usage: Usage | None


class RequestOutput:
    """One request's output step. Tokens go through the detokenizer one at a time so that a stop
    string cuts the token list right after the token that completed it (that token is reported;
    later ones are not). The last step carries the usage; the observer sees every step."""

    def __init__(
        self, tokenizer: Any, stop: Sequence[str], usage: Usage, observer: RequestObserver
    ) -> None:
        # No tokenizer (a token-id-only model): token ids only, text stays empty.
        self._detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._stop = StopStringMatcher(stop)
        self._usage = usage  # completion_tokens filled in at the end
        self._observer = observer
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
    ) -> Step:
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
        delta = Delta("".join(text), taken, list(logprobs[: len(taken)]), self.finish_reason)
        self._observer.tokens(len(taken))
        if not self.finished:
            return Step(delta, None)
        usage = dataclasses.replace(self._usage, completion_tokens=self.num_tokens)
        self._observer.finished(usage)
        return Step(delta, usage)


class RequestObserver:
    """Time to first token, inter-token latency, token counts, and how the request ended."""

    def __init__(self, metrics: RouterMetrics, start: float) -> None:
        self._m = metrics
        self._start = start
        self._last: float | None = None
        self._first: float | None = None
        self._tokens = 0
        self.code = "CANCELLED"  # unless the stream ends otherwise: the client went away
        self.slo: Slo | None = None  # its targets: the stream's end counts met, missed, failed

    def tokens(self, count: int) -> None:
        """``count`` tokens (one message's) are about to reach the client."""
        if not count:
            return
        now = time.monotonic()
        self._tokens += count
        if self._last is None:
            self._first = now
            self._m.ttft.observe(now - self._start)
        else:
            for _ in range(count):  # a batch's tokens share the gap since the previous one
                self._m.itl.observe((now - self._last) / count)
        self._last = now

    def finished(self, usage: Usage) -> None:
        self.code = "OK"
        self._m.prompt_tokens.inc(usage.prompt_tokens)
        self._m.cached_tokens.inc(usage.cached_tokens)
        self._m.generation_tokens.inc(usage.completion_tokens)

    def failed(self, failure: Failure) -> None:
        self.code = failure.value  # the status name /metrics counts endings under

    def end(self) -> None:
        """The stream is over, however it ended."""
        self._m.requests.labels(self.code).inc()
        self._m.latency.observe(time.monotonic() - self._start)
        if self.slo is not None:
            self._m.slo_requests.labels(outcome=self._slo_outcome(self.slo)).inc()

    def _slo_outcome(self, slo: Slo) -> str:
        if self.code != "OK" or self._first is None or self._last is None:
            return "failed"
        ttft = self._first - self._start
        tpot = (self._last - self._first) / (self._tokens - 1) if self._tokens > 1 else 0.0
        late = (slo.ttft_s is not None and ttft > slo.ttft_s) or (
            slo.tpot_s is not None and tpot > slo.tpot_s
        )
        return "missed" if late else "met"


# ------------------------------------------------------------------ detokenizing

# What a byte-level or SentencePiece decoder produces for bytes that do not (yet) form a
# complete UTF-8 character.
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's output tokens, fed one batch at a time, into text deltas.

    Invariant: the concatenation of every delta returned by ``add`` and then ``flush`` equals
    ``tokenizer.decode(all_output_ids, skip_special_tokens=True)`` (no clean-up of spaces).

    A delta never ends inside a character: trailing U+FFFD (bytes of a character not complete
    yet) is held back until a later token completes it, or until ``flush``, which emits
    whatever remains (so genuinely invalid bytes still surface as U+FFFD). Only the tokens not
    yet fully emitted, plus the window before them, are decoded per call.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._decode = tokenizers_decode(tokenizer) or functools.partial(
            tokenizer.decode, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        self._token_ids: list[int] = []
        # NOTE: ids[prefix_offset:read_offset] were emitted in full; they are decoded again as
        # context so that tokenizers which drop a word's leading space at the start of a decode
        # (SentencePiece "▁") still give the space. ids[read_offset:] are pending: their text
        # is emitted up to its last complete character (pending_sent characters so far).
        self._prefix_offset = 0
        self._read_offset = 0
        self._pending_sent = 0

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly complete text (possibly "")."""
        self._token_ids.extend(token_ids)
        return self._take(final=False)

    def flush(self) -> str:
        """The request has ended: return all text not yet emitted, complete or not."""
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        if self._read_offset == len(self._token_ids):
            return ""
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        pending = self._decode(self._token_ids[self._prefix_offset :])[len(prefix_text) :]
        complete = pending if final else pending.rstrip(REPLACEMENT_CHAR)
        delta = complete[self._pending_sent :]
        if final or (pending and complete == pending):
            # Every pending token's text is out: they become the next decode's context.
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._token_ids)
            self._pending_sent = 0
        else:
            self._pending_sent = max(self._pending_sent, len(complete))
        return delta


def tokenizers_decode(tokenizer: Any) -> Callable[[Sequence[int]], str] | None:
    """The tokenizers library's own decode (skipping special tokens), where transformers'
    ``decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)`` is exactly
    that: a fast tokenizer whose ``_decode`` is transformers' own. The same text without
    transformers' per-call conversions, which were most of the router's detokenizing time (it
    decodes twice per token). None otherwise (then ``tokenizer.decode`` is used)."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: the general path
        return None
    if not isinstance(tokenizer, TokenizersBackend):
        return None
    if type(tokenizer)._decode is not TokenizersBackend._decode:
        return None  # a tokenizer that decodes its own way
    backend = tokenizer.backend_tokenizer
    return lambda ids: backend.decode(list(ids), skip_special_tokens=True)


class StopStringMatcher:
    """Cuts the text stream at the stop string that is complete first.

    A stream cannot wait on a longer stop string that began earlier: the first stop string to
    be complete ends the request (as in vLLM and transformers' stop criteria), cut where it
    starts; of several complete in the same piece of text, the one that starts first.

    ``add`` returns ``(text safe to emit, stopped)``. The longest suffix of the text that is
    the start of a stop string is held back until later text rules it out (or completes the
    stop string); ``flush`` releases it once the request has ended. The emitted text never
    contains a stop string nor anything after it.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        assert all(stop), "empty stop strings are rejected during validation"
        self._stop = tuple(stop)
        self._text = ""  # text not emitted yet
        self.stopped = False

    def add(self, text: str) -> tuple[str, bool]:
        assert not self.stopped, "no text after a stop string"
        self._text += text
        # NOTE: a match not found on earlier calls must end in the new text, so it lies
        # within the held-back suffix plus the new text: searching _text is enough.
        hits = [i for i in (self._text.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._release(min(hits)), True
        return self._release(len(self._text) - self._partial_match_len()), False

    def flush(self) -> str:
        return "" if self.stopped else self._release(len(self._text))

    def _partial_match_len(self) -> int:
        """Length of the longest suffix of the text that begins some stop string."""
        best = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(self._text)), best, -1):
                if self._text.endswith(stop[:k]):
                    best = k
                    break
        return best

    def _release(self, end: int) -> str:
        out, self._text = self._text[:end], self._text[end:]
        return out
