"""Speculation with the checkpoint's MTP layer (`speculative.method: mtp`,
`replicas.engine.spec.mtp`) through a whole replica of a DeepSeek V3 model (MLA, MoE),
and of GLM-4.7-Flash's: every script's request, guided ones included, comes out exactly as
without speculation, alone and eight at once, whether the layer agrees with the model
(`builtin:mtp-agree`, `builtin:mtp-glm-lite`: every draft kept where no grammar masks the
model's choice) or not (`builtin:mtp`, random: nearly every draft rejected). Sampled
requests keep an agreeing layer's sampled drafts by the q/p rule. Rows that decode without
drafting (a large batch under `disable_by_batch_size`) draft again once it shrinks.
Admission counts the layer's cache beside the model's."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import pytest

from replicas.engine.config import EngineConfig, SpeculativeConfig
from replicas.replica import ModelReplica, ReplicaOptions
from tests.integration.test_draft_model import sampled_decode
from tests.integration.test_prompt_cache import output
from tests.integration.test_speculative_replica import requests, together
from tests.streams import stream_events

# DeepSeek V3 with an agreeing and a random layer; GLM-4.7-Flash with an agreeing one.
SOURCES = ["builtin:mtp-agree", "builtin:mtp", "builtin:mtp-glm-lite"]
TOKENS = 48  # untrained models write until max_tokens


def make(source: str, spec: SpeculativeConfig | None) -> ModelReplica:
    rep = ModelReplica(ReplicaOptions(model_id="tiny", source=source,
                                      engine=EngineConfig(speculative=spec)))
    rep.start()
    return rep


def mtp(**overrides: Any) -> SpeculativeConfig:
    return SpeculativeConfig(**{"num_speculative_tokens": 3, "mtp": True,
                                "disable_when_slower": False, **overrides})


def capped(request: Any, tokens: int = TOKENS) -> Any:
    return dataclasses.replace(request, sampling=dataclasses.replace(request.sampling,
                                                                     max_tokens=tokens))


@pytest.fixture(scope="module", params=SOURCES)
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[str, ModelReplica, ModelReplica]]:
    plain, fast = make(request.param, None), make(request.param, mtp())
    yield request.param, plain, fast
    plain.shutdown()
    fast.shutdown()


def test_every_request_alone_and_batched_is_the_output_without_speculation(
        pair: tuple[str, ModelReplica, ModelReplica]) -> None:
    source, plain, fast = pair
    batch = [capped(r) for r in requests()]
    for request in batch:
        assert output(stream_events(fast, request)) == output(stream_events(plain, request)), \
            request.request_id
    eight = batch[-8:]
    assert together(fast, eight) == [output(stream_events(plain, r)) for r in eight]
    decode = fast.stats().decode
    assert decode is not None and decode.speculative and decode.method == "mtp"
    assert decode.drafted > 0
    if source != "builtin:mtp":  # the agreeing layers
        assert decode.tokens >= 2 * decode.passes, decode
        # They keep every draft where no grammar masks the model's choice (a guided
        # request's mask rejects the drafts a random model's unmasked argmax would be).
        free = next(r for r in batch if r.request_id.startswith("test-hello"))
        stream_events(fast, free)
        after = fast.stats().decode
        assert after is not None
        assert after.accepted - decode.accepted == after.drafted - decode.drafted > 0, after
    else:  # random weights guess little right, and cost nothing in correctness
        assert decode.accepted < 0.5 * decode.drafted, decode
    # The layer keeps one more layer's KV per token: the model's are alike (MLA).
    plain_layout, fast_layout = (r.stats().memory.layout  # type: ignore[union-attr]
                                 for r in (plain, fast))
    layers = fast.model.model.args.num_hidden_layers
    assert fast_layout.per_token == plain_layout.per_token * (layers + 1) // layers


def test_sampled_rows_keep_an_agreeing_layers_drafts_by_the_qp_rule() -> None:
    decode = sampled_decode(make("builtin:mtp-agree", mtp()), TOKENS)
    assert decode.drafted > 50, decode
    # Drafts past a row's end count as drafted, never as kept.
    assert decode.accepted >= 0.8 * decode.drafted, decode


def test_rows_that_decoded_without_drafting_draft_again() -> None:
    """Eight rows of different lengths under `disable_by_batch_size: 3`: while more than
    three decode nobody drafts (each row's pairs wait, past the drafter's bound for the
    longest ones, which start over), then the last three draft to their ends."""
    plain, fast = make("builtin:mtp-agree", None), \
        make("builtin:mtp-agree", mtp(disable_by_batch_size=3))
    try:
        batch = [capped(r, 24 + 16 * i) for i, r in enumerate(requests()[:8])]
        assert together(fast, batch) == [output(stream_events(plain, r)) for r in batch]
        decode = fast.stats().decode
    finally:
        plain.shutdown()
        fast.shutdown()
    assert decode is not None and decode.accepted > 0 and decode.tokens > decode.passes, decode
