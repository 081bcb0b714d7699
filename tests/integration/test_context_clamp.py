"""`max_tokens_past_context`: a max_tokens past the context is lowered (clamp, the default)
or refused (reject), at the exact boundary, on the real tiny model."""

from __future__ import annotations

from typing import Iterator

import pytest

from replicas.contract import (
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    TokenPrompt,
)
from replicas.replica import ModelReplica, ReplicaOptions
from tests.streams import stream_events

# Leaves this many tokens of the context after the prompt: a few decode steps only.
ROOM = 3
# A short context (`max_model_len`) keeps prompts that fill it cheap to prefill.
CONTEXT = 256


def _replica(**options: object) -> Iterator[ModelReplica]:
    rep = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny",
                                      max_model_len=CONTEXT, **options))  # type: ignore[arg-type]
    rep.start()
    yield rep
    rep.shutdown()


@pytest.fixture(scope="module")
def replica() -> Iterator[ModelReplica]:
    yield from _replica()


@pytest.fixture(scope="module")
def rejecting() -> Iterator[ModelReplica]:
    yield from _replica(max_tokens_past_context="reject")


def test_max_model_len_caps_the_native_context(replica: ModelReplica) -> None:
    assert replica.model.context_length > CONTEXT == replica.context_length


def _request(replica: ModelReplica, max_tokens: int, prompt_len: int | None = None) -> GenerationRequest:
    context = replica.context_length
    length = context - ROOM if prompt_len is None else prompt_len
    # Token id 5 repeated, an unscripted prompt, and every end-of-text token banned: the
    # model cannot stop on its own, so each generation runs exactly to its (lowered) limit
    # and the tests can say how many tokens that is.
    never_end = {token: -1e4 for token in replica.model.eos_token_ids}
    return GenerationRequest(request_id=f"clamp-{max_tokens}-{length}", model="tiny",
                             prompt=TokenPrompt((5,) * length),
                             sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                     logit_bias=never_end))


def test_max_tokens_that_exactly_fits_is_kept(replica: ModelReplica) -> None:
    finished = stream_events(replica, _request(replica, ROOM))[-1]
    assert isinstance(finished, Finished)
    assert finished.warnings == ()
    # The whole limit, to the last token of the context.
    assert (finished.reason, finished.usage.completion_tokens) == (FinishReason.LENGTH, ROOM)


def test_one_past_the_context_is_clamped_to_what_is_left(replica: ModelReplica) -> None:
    context = replica.context_length
    finished = stream_events(replica, _request(replica, ROOM + 1))[-1]
    assert isinstance(finished, Finished)
    assert finished.warnings == (
        f"max_tokens lowered from {ROOM + 1} to {ROOM}: the prompt has {context - ROOM} "
        f"tokens of this model's {context}-token context",)
    # It ran into the lowered limit: not one token past the context, and not short of it.
    assert (finished.reason, finished.usage.completion_tokens) == (FinishReason.LENGTH, ROOM)


def test_claude_code_sized_max_tokens_is_clamped(replica: ModelReplica) -> None:
    finished = stream_events(replica, _request(replica, 32000))[-1]
    assert isinstance(finished, Finished)
    assert finished.warnings and f"lowered from 32000 to {ROOM}" in finished.warnings[0]
    assert (finished.reason, finished.usage.completion_tokens) == (FinishReason.LENGTH, ROOM)


def test_a_prompt_that_fills_the_context_is_still_an_error(replica: ModelReplica) -> None:
    context = replica.context_length
    failed = stream_events(replica, _request(replica, 10, prompt_len=context))[-1]
    assert isinstance(failed, Failed)
    assert failed.kind.value == "context_length" and failed.param == "max_tokens"


def test_reject_refuses_one_past_the_context(rejecting: ModelReplica) -> None:
    fits = stream_events(rejecting, _request(rejecting, ROOM))[-1]
    assert isinstance(fits, Finished) and fits.warnings == ()
    assert fits.usage.completion_tokens == ROOM
    failed = stream_events(rejecting, _request(rejecting, ROOM + 1))[-1]
    assert isinstance(failed, Failed)
    assert failed.kind.value == "context_length"
    assert "maximum context length" in failed.message
