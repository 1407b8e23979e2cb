"""Seeded request streams: what each benchmark request asks for (no downloads).

A workload is an endless iterator of ``BenchRequest``; the runner takes as many as it sends.
Lengths are in tokens for token-id prompts and in words for text prompts (a word is about one
token or two: the servers' own ``usage.prompt_tokens`` is what the report counts).
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CONVERSATION",
    "BenchRequest",
    "LengthDist",
    "conversation",
    "jsonl",
    "random_prompts",
    "shared_prefix",
]

# Words for text prompts: common short English words, most one token in any BPE vocabulary.
_WORD_TEXT = (
    "the of and to in is was for on with as by at from that this it be are an or not have "
    "but all can one has had more new time will about like just over into only first some "
    "also other what when which their there after where made many most well then than them "
    "these long make way work day part place year back good each use water call people"
)
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request: ``prompt`` is text or token ids; ``prompt_len`` its length as generated."""

    prompt: str | tuple[int, ...]
    prompt_len: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A length distribution: ``fixed:n`` (or just ``n``), ``uniform:lo:hi`` (both included),
    ``normal:mean:std`` or ``lognormal:mean:std`` (the mean and std of the lengths themselves).
    Draws are rounded and at least 1."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str | int) -> LengthDist:
        text = str(spec).strip().lower()
        parts = text.split(":")
        try:
            if len(parts) == 1:
                parts = ["fixed", parts[0]]
            kind, *nums = parts
            values = [float(x) for x in nums]
        except ValueError:
            raise ValueError(f"bad length {spec!r}: {cls.__doc__}") from None
        arity = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2}
        if arity.get(kind) != len(values):
            raise ValueError(f"bad length {spec!r}: {cls.__doc__}")
        if values[0] < (0 if kind == "normal" else 1) or min(values) < 0:
            raise ValueError(f"bad length {spec!r}: lengths are positive")
        if kind == "uniform" and values[1] < values[0]:
            raise ValueError(f"bad length {spec!r}: uniform:lo:hi needs lo <= hi")
        return cls(kind, *values)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            x = self.a
        elif self.kind == "uniform":
            return rng.randint(round(self.a), round(self.b))
        elif self.kind == "normal":
            x = rng.gauss(self.a, self.b)
        else:  # lognormal with this mean and std: sigma^2 = ln(1 + std^2/mean^2)
            sigma2 = math.log1p((self.b / self.a) ** 2)
            x = rng.lognormvariate(math.log(self.a) - sigma2 / 2, math.sqrt(sigma2))
        return max(1, round(x))

    @property
    def mean(self) -> float:
        return (self.a + self.b) / 2 if self.kind == "uniform" else self.a


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _words(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(n)]


def _make(parts: list, text: bool, max_tokens: int) -> BenchRequest:
    if text:
        return BenchRequest(" ".join(parts), len(parts), max_tokens)
    return BenchRequest(tuple(parts), len(parts), max_tokens)


def random_prompts(
    input_len: LengthDist, output_len: LengthDist, *, text: bool, vocab: int, seed: int
) -> Iterator[BenchRequest]:
    """Independent prompts of random tokens (or words) with lengths drawn from ``input_len``."""
    rng = random.Random(seed)
    while True:
        n = input_len.sample(rng)
        parts = _words(rng, n) if text else _tokens(rng, n, vocab)
        yield _make(parts, text, output_len.sample(rng))


def shared_prefix(
    num_prefixes: int,
    prefix_len: LengthDist,
    questions: int,
    question_len: LengthDist,
    output_len: LengthDist,
    *,
    text: bool,
    vocab: int,
    seed: int,
) -> Iterator[BenchRequest]:
    """``num_prefixes`` system prompts x ``questions`` questions each: every prompt is one prefix
    followed by one question. The ``num_prefixes * questions`` prompts come in a shuffled order,
    then again in another order, and so on."""
    if num_prefixes < 1 or questions < 1:
        raise ValueError("shared-prefix needs at least one prefix and one question")
    rng = random.Random(seed)

    def draw(dist: LengthDist) -> list:
        n = dist.sample(rng)
        return _words(rng, n) if text else _tokens(rng, n, vocab)

    prefixes = [draw(prefix_len) for _ in range(num_prefixes)]
    prompts = [(p, draw(question_len)) for p in prefixes for _ in range(questions)]
    while True:
        order = list(range(len(prompts)))
        rng.shuffle(order)
        for i in order:
            prefix, question = prompts[i]
            yield _make(prefix + question, text, output_len.sample(rng))


# The conversation mix's fixed parameters: a system prompt, 2-8 turns, user messages and
# answers of lognormal lengths, the whole prompt (history included) capped.
CONVERSATION = {
    "system_len": LengthDist("uniform", 32, 256),
    "turns": (2, 8),
    "user_len": LengthDist("lognormal", 64, 64),
    "answer_len": LengthDist("lognormal", 160, 120),
    "max_prompt_len": 4096,
}


def conversation(
    active: int,
    output_len: LengthDist | None,
    *,
    text: bool,
    vocab: int,
    seed: int,
    params: dict | None = None,
) -> Iterator[BenchRequest]:
    """Multi-turn-like traffic: ``active`` conversations at once, each turn's prompt the
    conversation so far (system prompt, earlier questions and answers) plus a new question, so
    consecutive turns share a growing prefix. The next request is a turn of a conversation
    picked at random; a finished conversation is replaced by a new one. ``output_len`` None:
    each turn asks for its answer's length (the answer then joins the history)."""
    if active < 1:
        raise ValueError("conversation needs at least one active conversation")
    p = {**CONVERSATION, **(params or {})}
    rng = random.Random(seed)

    def draw(dist: LengthDist) -> list:
        n = dist.sample(rng)
        return _words(rng, n) if text else _tokens(rng, n, vocab)

    def new() -> list:
        turns = rng.randint(*p["turns"])
        return [draw(p["system_len"]), turns]

    convs = [new() for _ in range(active)]
    while True:
        i = rng.randrange(active)
        history, turns_left = convs[i]
        question = draw(p["user_len"])
        answer = draw(p["answer_len"])
        prompt = (history + question)[-p["max_prompt_len"] :]
        max_tokens = output_len.sample(rng) if output_len else len(answer)
        yield _make(prompt, text, max_tokens)
        convs[i] = new() if turns_left <= 1 else [history + question + answer, turns_left - 1]


class ConversationUser:
    """One user of the conversation workload who waits for each answer (``--think-time``):
    every turn's prompt is the conversation so far — system prompt, earlier questions and the
    server's own answers, as a chat client sends them back — plus a new question. ``next`` gives
    the turn to send, ``answered`` takes the answer that came back (token ids, or text: its
    words), ``failed`` drops the question; after the conversation's turns a new one starts."""

    def __init__(
        self,
        rng: random.Random,
        output_len: LengthDist | None,
        *,
        text: bool,
        vocab: int,
        params: dict | None = None,
    ) -> None:
        self._rng, self._out, self._text, self._vocab = rng, output_len, text, vocab
        self._p = {**CONVERSATION, **(params or {})}
        self._question: list = []
        self.new_tokens = 0  # of the last turn given: its prompt tokens no earlier turn sent
        self._new()

    def _draw(self, dist: LengthDist) -> list:
        n = dist.sample(self._rng)
        return _words(self._rng, n) if self._text else _tokens(self._rng, n, self._vocab)

    def _new(self) -> None:
        self.history = self._draw(self._p["system_len"])
        self.turns_left = self._rng.randint(*self._p["turns"])
        self.turn = 0
        self._fresh = len(self.history)  # history not yet sent in any prompt

    def next(self) -> BenchRequest:
        self._question = self._draw(self._p["user_len"])
        whole = self.history + self._question
        prompt = whole[-self._p["max_prompt_len"] :]
        # What no earlier turn sent: the question and the answer fed back since (everything
        # once the history is cut from the front: the prefix then shifts).
        cut = len(whole) > len(prompt)
        self.new_tokens = len(prompt) if cut else self._fresh + len(self._question)
        self._fresh = 0
        max_tokens = (self._out or self._p["answer_len"]).sample(self._rng)
        return _make(prompt, self._text, max_tokens)

    def answered(self, answer: list[int] | str) -> None:
        said = answer.split() if isinstance(answer, str) else list(answer)
        self.history = self.history + self._question + said
        self._fresh = len(said)
        self._done_turn()

    def failed(self) -> None:
        self._fresh = 0  # (the history unchanged: all of it was sent before)
        self._done_turn()

    def _done_turn(self) -> None:
        self.turn += 1
        self.turns_left -= 1
        if self.turns_left <= 0:
            self._new()


def jsonl(path: str | Path, output_len: LengthDist, *, seed: int) -> Iterator[BenchRequest]:
    """The prompts of a JSON Lines file, in its order, again from the top when they run out:
    ``{"prompt": "text" | [token ids], "max_tokens": n}`` per line (``max_tokens`` optional:
    drawn from ``output_len`` when absent). Blank lines are skipped."""
    rng = random.Random(seed)
    items: list[tuple[str | tuple[int, ...], int | None]] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                prompt = row["prompt"]
                if isinstance(prompt, list):
                    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                        raise ValueError("a token-id prompt holds integers only")
                    prompt = tuple(prompt)
                elif not isinstance(prompt, str):
                    raise ValueError("prompt is a string or a list of token ids")
                max_tokens = row.get("max_tokens")
                if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
                    raise ValueError("max_tokens is a positive integer")
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{path}:{number}: {exc}") from None
            items.append((prompt, max_tokens))
    if not items:
        raise ValueError(f"{path}: no prompts")
    for prompt, max_tokens in itertools.cycle(items):
        n = len(prompt.split()) if isinstance(prompt, str) else len(prompt)
        yield BenchRequest(prompt, n, max_tokens or output_len.sample(rng))
