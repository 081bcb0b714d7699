"""Logprob entries on their way out (OpenAI `logprobs` / `top_logprobs`, completions'
`echo`): each number's token text, and which event carries it. The numbers themselves come
from the engine (`replicas.engine.sampling.logprobs`, `replicas.engine.batch.scoring`)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Sequence

from replicas.contract import Channel, Finished, OutputEvent, TextDelta, TokenLogprob
from replicas.engine.sampling.logprobs import Picked
from replicas.engine.request import Generated
from replicas.pipeline.detokenizer import Decode


class TokenPieces:
    """Each id's text as one token (special tokens kept), cached: top-k lookups repeat the
    same few ids. Shared by a model's requests; the lock makes it safe off the engine thread."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._pieces: dict[int, str] = {}
        self._lock = threading.Lock()

    def __call__(self, token_id: int) -> str:
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._decode([token_id])
            with self._lock:
                if len(self._pieces) > 1 << 18:  # bounded: a huge vocab swept by top-k
                    self._pieces.clear()
                self._pieces[token_id] = piece
        return piece


class LogprobTrail:
    """One request's logprob entries on their way out: each token's entry rides with the
    first text the pipeline emits at or after it (a held token waits for its text), and
    what is left at the end rides in an empty answer delta before `Finished`."""

    def __init__(self, top: int, pieces: TokenPieces) -> None:
        self.top = top
        self._pieces = pieces
        self._pending: list[TokenLogprob] = []

    @property
    def held(self) -> tuple[TokenLogprob, ...]:
        """The entries waiting for their text (`TokenIds.held`: a resume carries them)."""
        return tuple(self._pending)

    def restore(self, held: Sequence[TokenLogprob]) -> None:
        """A resumed request: the entries the failed replica held at the cut wait here."""
        self._pending = list(held)

    def piece(self, token_id: int) -> str:
        return self._pieces(token_id)

    def entry(self, token_id: int, picked: Picked) -> TokenLogprob:
        piece = self._pieces
        return TokenLogprob(piece(token_id), token_id, picked.logprob,
                            tuple((piece(i), v) for i, v in picked.top))

    def on_token(self, events: list[OutputEvent], step: Generated) -> list[OutputEvent]:
        """One token's events with the entries they carry."""
        if step.logprob is None:
            raise RuntimeError("no logprobs for this step")  # fails this request alone
        # An EOS or stop token id ends the turn and is no text: it has no entry (as OpenAI).
        if step.ended_by == "stop":
            return self.attach(events, None)
        return self.attach(events, self.entry(step.token, step.logprob))

    def attach(self, events: list[OutputEvent], entry: TokenLogprob | None) -> list[OutputEvent]:
        """`events` (one token's) with the pending entries on their first text; `entry`:
        this token's, None for a token that is not text (EOS, a stop token id)."""
        if entry is not None:
            self._pending.append(entry)
        if not self._pending:
            return events
        for i, event in enumerate(events):
            if isinstance(event, TextDelta) and event.text:
                out = list(events)
                out[i] = dataclasses.replace(event, logprobs=tuple(self._pending))
                self._pending = []
                return out
        if events and isinstance(events[-1], Finished):
            tail = TextDelta(Channel.ANSWER, "", tuple(self._pending))
            self._pending = []
            return [*events[:-1], tail, events[-1]]
        return events


def echo_delta(text: str, prompt_ids: Sequence[int], picked: Sequence[Picked] | None,
               trail: LogprobTrail | None) -> TextDelta:
    """The prompt as the first answer text; with its logprobs when the request asked."""
    if trail is None or picked is None:
        return TextDelta(Channel.ANSWER, text)
    first = TokenLogprob(trail.piece(prompt_ids[0]), prompt_ids[0], None)
    entries = [trail.entry(t, p) for t, p in zip(prompt_ids[1:], picked)]
    return TextDelta(Channel.ANSWER, text, (first, *entries))
