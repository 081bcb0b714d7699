"""The output processor: the only place where a request's tokens become events.

The engine hands it each sampled token id (`replicas.engine.request.Generated`) on the
engine thread; it runs the request's decoder (detokenizer, channels, stops, tool calls),
decides why the request ends (an EOS or stop id, a stop string, a finished grammar, the
length limit), and puts the logprob entries and completions' echo on the events. vLLM
v1's output processor plays the same part beside its token-only engine core.
"""

from __future__ import annotations

from typing import Sequence

from replicas.contract import (
    ErrorKind,
    Failed,
    FinishReason,
    OutputEvent,
    TokenIds,
    TokenLogprob,
)
from replicas.engine.delivery import EventSink
from replicas.engine.sampling.logprobs import Picked
from replicas.engine.request import Generated
from replicas.pipeline.control import RequestController
from replicas.pipeline.decoding import RequestDecoder
from replicas.pipeline.logprob_trail import LogprobTrail, echo_delta


class OutputProcessor:
    """One request's `RequestOutput` (`replicas.engine.request`)."""

    def __init__(self, sink: EventSink, decoder: RequestDecoder,
                 controller: RequestController | None, *, prompt_ids: Sequence[int],
                 stop_token_ids: frozenset[int], logprobs: LogprobTrail | None = None,
                 echo: str | None = None, report_tokens: bool = False) -> None:
        """`report_tokens`: each token's events come with its id (`TokenIds`), so the
        client can resume the stream on another replica."""
        self.sink = sink
        self.decoder = decoder
        self.controller = controller
        self._prompt_ids = prompt_ids
        self._stop_token_ids = stop_token_ids
        self._trail = logprobs
        self._echo = echo
        self._report = report_tokens
        self._read = 0  # generated tokens read, replayed ones included

    def replay(self, token_ids: Sequence[int], held: Sequence[TokenLogprob] = ()) -> None:
        """A resumed request: what it generated before goes through every stateful stage
        (budget, grammar, channels, stops, tool calls) as it did then, and the events it
        makes are dropped: the client has them. Its echo was sent then too. `held`: the
        logprob entries still waiting for their text at the cut, which ride out next."""
        self._echo = None
        for token in token_ids:
            if self.controller is not None:
                self.controller.replay(token)
            self.decoder.feed(token)
            self._read += 1
        if self._trail is not None:
            self._trail.restore(held)

    def started(self, prompt_logprobs: Sequence[Picked] | None) -> list[OutputEvent]:
        """Completions' echo: the prompt's text first, with its tokens' logprobs if asked."""
        if self._echo is None:
            return []
        return [echo_delta(self._echo, self._prompt_ids, prompt_logprobs, self._trail)]

    def generated(self, step: Generated) -> tuple[list[OutputEvent], bool]:
        events, done = self._events(step)
        if self._trail is not None:
            events = self._trail.on_token(events, step)
        if self._report:  # `merge_deltas` gathers a batch's ids at its front
            held = self._trail.held if self._trail is not None else ()
            events = [TokenIds((step.token,), held), *events]
        return events, done

    def _events(self, step: Generated) -> tuple[list[OutputEvent], bool]:
        decoder, ctrl, token = self.decoder, self.controller, step.token
        self._read += 1
        if ctrl is not None and ctrl.error is not None:
            return [Failed(ErrorKind.INTERNAL, f"constraint failed: {ctrl.error}")], True

        # A resumed request's cache may also hold what it generated before: not prompt.
        cached = min(step.cached_tokens, len(self._prompt_ids))

        def end(reason: FinishReason, stop: int | None = None) -> list[OutputEvent]:
            return decoder.finish(reason, stop, cached_tokens=cached,
                                  preemptions=step.preemptions)

        if step.ended_by == "stop":  # an EOS or stop token id: it ends generation, no text
            decoder.count(token)
            if token in self._stop_token_ids:
                return end(FinishReason.STOP_TOKEN, token), True
            grammar_done = ctrl is not None and ctrl.grammar_complete(self._read)
            return end(FinishReason.GRAMMAR_COMPLETE if grammar_done else FinishReason.EOS), True
        events = decoder.feed(token)
        if decoder.matched_stop is not None:
            return events + end(FinishReason.STOP_SEQUENCE), True
        if ctrl is not None and ctrl.grammar_complete(self._read):
            return events + end(FinishReason.GRAMMAR_COMPLETE), True
        if step.ended_by == "length":
            return events + end(FinishReason.LENGTH), True
        return events, False
