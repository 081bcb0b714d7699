"""Logits-level control of one request: the thinking budget and the grammar.

mlx-lm calls a request's logits processors once per decode step, with the token history
ending in the token just sampled. This controller tracks the channel at token level (the
request's one `ChannelTracker`, shared with the output pipeline: each token is detokenized
and routed once, by whichever of the two reads it first), forces the
format's end-of-reasoning tokens once the budget is spent, and hands answer-channel tokens
to the guided matcher (tool-call bodies, Channel.TOOL, count as answer here: the tool
grammar began before the call opened). It can also ban ids at every step (the tool
format's markers, under `tool_choice: none`). It runs on the engine thread inside the batch
step, so it never raises: a failure is recorded in `error` and the engine ends just this
request.
"""

from __future__ import annotations

from collections import deque
from typing import Literal, Protocol, cast

import mlx.core as mx

from replicas.contract import Channel
from replicas.families.channel_format import ChannelFormat
from replicas.pipeline.detokenizer import Decode
from replicas.pipeline.tracker import ChannelTracker


class Grammar(Protocol):
    def consume(self, token_id: int) -> None: ...
    def mask(self, logits: mx.array) -> mx.array: ...
    def forced_after(self, token_id: int, limit: int) -> list[int]: ...
    @property
    def is_complete(self) -> bool: ...
    @property
    def error(self) -> str | None: ...


class RequestController:
    def __init__(
        self,
        decode: Decode,
        fmt: ChannelFormat,
        initial: Channel,
        state: str | None,
        *,
        budget: int | None,
        forced_end_ids: tuple[int, ...],
        grammar: Grammar | None,
        reasoning_open_ids: frozenset[int] = frozenset(),
        eos_ids: frozenset[int] = frozenset(),
        banned_ids: tuple[int, ...] = (),
        grammar_start: Literal["answer", "reasoning_end"] = "answer",
        tracker: ChannelTracker | None = None,
        end_ids: frozenset[int] = frozenset(),
    ) -> None:
        """`grammar_start`: when the grammar takes over after reasoning. "answer": at the
        first answer (or tool) token, for grammars over the answer text. "reasoning_end": as
        soon as the reasoning block closes, for grammars that also cover the headers that
        follow it (harmony tool calls); forced tokens after that point go to the grammar.
        `tracker`: the request's, shared with its decoder (else one of its own); `end_ids`:
        the tokens that end the request (EOS, stop ids), which are no text to track."""
        tracker = tracker or ChannelTracker(decode, fmt, initial, state)
        self._cursor = tracker.cursor()
        self._end_ids = end_ids
        self._channel = tracker.router.channel
        self._reasoning_ended = tracker.router.reasoning_ended
        self._budget = budget
        self._forced_end_ids = forced_end_ids
        self._forcing: deque[int] = deque()
        self._grammar = grammar
        self._banned = tuple(sorted(set(banned_ids)))
        self._after_reasoning = grammar_start == "reasoning_end"
        # With the answer channel first, the model may still open a reasoning block with its
        # first token; the grammar starts once it is clear that it did not.
        self._grammar_on = initial is Channel.ANSWER
        self._first_step = True
        self._open_ids = reasoning_open_ids if initial is Channel.ANSWER else frozenset()
        self._eos_ids = tuple(sorted(eos_ids))
        # History length already read: mlx-lm calls a processor with the whole history, and
        # a request the engine preempted and re-queued is called again with a history it
        # has seen (its last token was read while the batch computed one step ahead).
        self._seen: int | None = None
        self.reasoning_tokens = 0
        self.forced = False
        self.error: str | None = None
        self._read = 0  # generated tokens read
        self._complete_at: int | None = None  # tokens read when the grammar completed

    def grammar_complete(self, tokens: int) -> bool:
        """Whether the grammar was complete once the first `tokens` generated tokens were
        read: speculation lets the controller read a step's kept drafts before the output
        sees the first of them, so "complete now" could end the output too early."""
        return self._complete_at is not None and self._complete_at <= tokens

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.error is not None:
            return logits
        try:
            size = tokens.size
            if self._seen is not None and size > self._seen:
                news = [_item_int(tokens[-1])] if size == self._seen + 1 else \
                    cast(list[int], tokens[self._seen:].tolist())
                for token in news:
                    self._on_token(token)
            self._seen = size
            return self._constrain(logits)
        except Exception as exc:  # noqa: BLE001 - isolate this request from the batch
            self.error = f"{type(exc).__name__}: {exc}"
            return logits

    def draft(self, pending: int, limit: int) -> list[int]:
        """What must follow `pending` (the token sampled last, not yet read): the rest of
        a forced end of reasoning, or what the grammar forces after it. Speculation's
        drafts for this row; a plain step reads them one at a time all the same."""
        if self.error is not None or limit <= 0:
            return []
        if self._forcing:  # `pending` is the first forced token
            return list(self._forcing)[1:limit + 1]
        if self._grammar is None or not self._grammar_on or self._first_step:
            return []
        if pending in self._end_ids:
            return []
        return self._grammar.forced_after(pending, limit)

    def replay(self, token: int) -> None:
        """A token a resumed request generated before (on another replica): the budget and
        the grammar move over it as they did then."""
        self._on_token(token)

    def _on_token(self, token: int) -> None:
        forced = bool(self._forcing)
        if forced:
            self._forcing.popleft()
        before = self._channel
        ended_before = self._reasoning_ended
        if token not in self._end_ids:  # the request ends with it: nothing more to route
            routing = self._cursor.read(token)
            self._channel, self._reasoning_ended = routing.after, routing.reasoning_ended
        after = self._channel
        # Harmony's channel stays REASONING in the headers after the analysis message; a
        # grammar that covers those headers makes them answer tokens.
        reasoning = after is Channel.REASONING and not (
            self._after_reasoning and self._reasoning_ended
        )
        # The token that closes reasoning counts as reasoning, unless it opens a tool call.
        if reasoning or (before is Channel.REASONING and after is Channel.ANSWER):
            self.reasoning_tokens += 1
        # Forced end-of-reasoning tokens are the format's, not the answer's: not the grammar's,
        # unless the grammar covers what follows the reasoning block.
        if self._grammar is not None and self._grammar_on and (
            not forced or self._after_reasoning
        ):
            if self._first_step and token in self._open_ids:
                self._grammar_on = False  # the model opened a reasoning block after all
            else:
                self._grammar.consume(token)
                if self._grammar.error is not None:
                    self.error = self._grammar.error
        self._first_step = False
        self._read += 1
        if self._complete_at is None and self._grammar is not None and \
                self._grammar.is_complete:
            self._complete_at = self._read
        if self._after_reasoning:
            if self._reasoning_ended and not ended_before:
                self._grammar_on = True  # reasoning closed: the grammar owns the next token
        elif before is Channel.REASONING and after in _ANSWERS:
            self._grammar_on = True
        if (
            self._budget is not None
            and not self.forced
            and reasoning
            and self.reasoning_tokens >= self._budget
        ):
            self.forced = True
            self._forcing.extend(self._forced_end_ids)

    def _constrain(self, logits: mx.array) -> mx.array:
        if self._forcing:
            return _only(logits, self._forcing[0])
        logits = _without(logits, self._banned)
        if self._grammar is None:
            return logits
        if not self._grammar_on:
            # A constrained answer is still owed: the reasoning may not end the request.
            return _without(logits, self._eos_ids)
        if self._first_step and self._open_ids:
            # The model opens a reasoning block only if that is its own first choice;
            # otherwise the grammar owns the first token.
            top = _item_int(mx.argmax(logits, axis=-1))
            if top in self._open_ids:
                return _only(logits, top)
        return self._grammar.mask(logits)


_ANSWERS = (Channel.ANSWER, Channel.TOOL)


def _without(logits: mx.array, ids: tuple[int, ...]) -> mx.array:
    if not ids:
        return logits
    return logits.at[..., mx.array(ids)].add(-mx.inf)


def _only(logits: mx.array, token: int) -> mx.array:
    keep = mx.arange(logits.shape[-1]) == token
    return mx.where(keep, logits, mx.array(-mx.inf, dtype=logits.dtype))


def _item_int(scalar: mx.array) -> int:
    value = scalar.item()
    assert isinstance(value, int)  # token ids: an integer dtype gives a Python int
    return value
