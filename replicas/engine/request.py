"""What the engine is handed for one request, and what it hands back.

The engine sees token ids only (vLLM v1's engine core): an `EngineRequest` says what to
decode and how to pick each token; a `RequestOutput` (the request pipeline's output
processor) is called once per token on the engine thread and turns it into the contract's
events. Nothing here knows about text, channels, stops or tools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol, Sequence

from replicas.contract import OutputEvent, SamplingParams, Tenancy
from replicas.engine.delivery import EventSink
from replicas.engine.sampling.logprobs import Picked
from replicas.engine.sampling.samplers import LogitsProcessor


@dataclass(frozen=True)
class PromptEmbeddings:
    """Input embeddings for the start of a prompt, prefilled instead of its tokens' own (a
    vision model's image features merged in: `replicas.vision`). The rest of the prompt is
    prefilled as tokens, batched as any other."""

    # The prefix cache's key for the positions they cover: the token ids, with each image
    # token replaced by an id from its image's content.
    key: tuple[int, ...]
    # On the engine thread: the (len(key), hidden) embeddings; with M-RoPE, those and the
    # positions' (3, 1, len(key)) ids (`replicas.engine.model.mrope`).
    compute: Callable[[], Any]
    # With M-RoPE: what every position after the prefix adds to its index (0: 1-D RoPE).
    rope_delta: int = 0
    # (start, end) spans whose tokens attend to each other both ways (Gemma's images,
    # `replicas.engine.model.bidirectional`): a prefill chunk never splits one.
    blocks: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class EngineRequest:
    """One request as the batch runs it; built off the engine thread, pure Python."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]  # the user's; EOS ids come from the model
    boundary: int = 0  # prompt tokens before the last message: their KV is kept once prefilled
    # Run after the sampling parameters' own (penalties, bias), last: e.g. a grammar mask.
    logits_processors: tuple[LogitsProcessor, ...] = ()
    logprobs: int | None = None  # each token's logprob and this many alternatives
    score_prompt: bool = False  # the prompt tokens' own logprobs, before any generation
    # Tokens sampled for this request before (a resumed stream: they end `prompt_ids`); a
    # seeded sampler continues its random stream after them.
    sampled_before: int = 0
    embeddings: PromptEmbeddings | None = None
    # Its tenant's share and its priority: the order it joins the batch in (`fair_share`).
    tenancy: Tenancy = Tenancy()
    adapter: str | None = None  # the LoRA adapter it runs with, by name; None: the base


# mlx-lm's word for why a row ended: "stop" is an EOS or stop token id (not text).
EndedBy = Literal["stop", "length"] | None


@dataclass(frozen=True, slots=True)
class Generated:
    """One sampled token of one request, as the engine hands it to the request's output."""

    token: int
    ended_by: EndedBy
    logprob: Picked | None  # when the request asked for logprobs
    cached_tokens: int  # prompt tokens the prefix cache served
    preemptions: int = 0  # times it left the batch for KV memory so far


class RequestOutput(Protocol):
    """The request's output side, called on the engine thread only; `sink` is where its
    events go (the engine hands them over, at most one wake-up per event loop per step).

    A method that raises fails just this request."""

    sink: EventSink

    def started(self, prompt_logprobs: Sequence[Picked] | None) -> list[OutputEvent]:
        """Events before the first token (completions' echo); `prompt_logprobs` when the
        request asked to score its prompt."""
        ...

    def generated(self, step: Generated) -> tuple[list[OutputEvent], bool]:
        """One token's events, and whether the request is done (its last event terminal)."""
        ...


@dataclass(frozen=True)
class Submitted:
    """A request and its output side, as queued for the engine."""

    request: EngineRequest
    output: RequestOutput

    @property
    def request_id(self) -> str:
        return self.request.request_id


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
