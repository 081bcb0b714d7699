"""A quantized KV cache in the batch (`engine.kv_bits`, `replicas.engine.kv.quantized`), on
the built-in scripted model loaded through the production path.

Bytes per token fall as the formula says (measured by the replica's own probe at load);
greedy output stays within a stated tolerance of the unquantized cache (8-bit: every
script exact); requests batched together equal each alone; the prefix cache serves a
conversation's earlier turn from quantized KV with the output unchanged; and speculation
rolls the quantized cache back exactly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Iterator

import mlx.core as mx
import pytest

from replicas.contract import OutputEvent
from replicas.engine.config import EngineConfig, SpeculativeConfig
from replicas.engine.kv.layout import KvLayout
from replicas.replica import ModelReplica, ReplicaOptions
from tests.integration.test_prompt_cache import CONVERSATION, output
from tests.integration.test_speculative import GREEDY, decode, prompts
from tests.scripted import script_request
from tests.streams import collect, stream_events

SCRIPTS = ["hello", "cities", "planets", "tea-steps", "json-record", "multi-turn",
           "riddle-think", "sum-think", "tool-one", "tool-parallel", "tool-result",
           "count-completion"]
GROUP = 32  # the built-in model's head_dim is 32: a group cannot span heads
# Scripts whose greedy output may differ from the unquantized cache's, at most.
TOLERANCE = {8: 0, 4: 0}  # measured: none of the 12 differs at either width


def make(bits: int | None, cache: bool = True) -> ModelReplica:
    rep = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny", engine=EngineConfig(
        kv_bits=bits, kv_group_size=GROUP, prompt_cache_bytes=(1 << 30) if cache else 0)))
    rep.start()
    return rep


@pytest.fixture(scope="module")
def plain() -> Iterator[ModelReplica]:
    rep = make(None, cache=False)
    yield rep
    rep.shutdown()


@pytest.fixture(scope="module", params=[8, 4])
def quantized(request: pytest.FixtureRequest) -> Iterator[tuple[int, ModelReplica]]:
    rep = make(request.param)
    yield request.param, rep
    rep.shutdown()


def layout(rep: ModelReplica) -> KvLayout:
    return rep._engine.kv_budget.layout  # noqa: SLF001 - what the replica measured at load


def text(rep: ModelReplica, sid: str) -> list[OutputEvent]:
    return output(stream_events(rep, script_request(sid)))


def test_bytes_per_token_fall_as_the_packing_says(plain: ModelReplica,
                                                  quantized: tuple[int, ModelReplica]) -> None:
    bits, rep = quantized
    dtype_bits = 8 * mx.zeros((), dtype=plain.model.model.model.embed_tokens.weight.dtype
                              ).itemsize
    # Each value packs to `bits`; each group of 64 adds a scale and a bias in the model's
    # dtype. 8-bit over a 16-bit model: 8.5 / 16 = 0.53; 4-bit: 0.28.
    expected = (bits + 2 * dtype_bits / GROUP) / dtype_bits
    assert layout(rep).per_token / layout(plain).per_token == pytest.approx(expected, rel=1e-6)


def test_greedy_output_within_the_stated_tolerance(plain: ModelReplica,
                                                   quantized: tuple[int, ModelReplica]) -> None:
    bits, rep = quantized
    differ = [sid for sid in SCRIPTS if text(rep, sid) != text(plain, sid)]
    assert len(differ) <= TOLERANCE[bits], differ


def test_batched_requests_equal_each_alone(quantized: tuple[int, ModelReplica]) -> None:
    _, rep = quantized
    alone = {sid: text(rep, sid) for sid in SCRIPTS[:8]}

    async def together() -> list[list[OutputEvent]]:
        return list(await asyncio.gather(*(collect(rep.stream(script_request(sid)))
                                           for sid in SCRIPTS[:8])))

    assert [output(events) for events in asyncio.run(together())] == list(alone.values())


def check_conversation_from_the_cache(rep: ModelReplica,
                                      make_fresh: Callable[[], ModelReplica]) -> None:
    """Each turn of `CONVERSATION` on `rep` (its prefix cache on) is a fresh replica's (no
    cache, made by `make_fresh` and shut down here), and a later turn is served in part
    from the cache."""
    fresh = make_fresh()
    try:
        expected = [text(fresh, sid) for sid in CONVERSATION]
    finally:
        fresh.shutdown()
    got = []
    for sid in CONVERSATION:  # tool-result's prompt starts with tool-one's prompt and answer
        events = stream_events(rep, script_request(sid))
        got.append(output(events))
        if sid == "tool-result":
            assert events[-1].usage.cached_tokens > 0  # type: ignore[union-attr]
    assert got == expected


def test_the_prefix_cache_serves_an_earlier_turn_from_quantized_kv(
        quantized: tuple[int, ModelReplica]) -> None:
    bits, rep = quantized
    check_conversation_from_the_cache(rep, lambda: make(bits, cache=False))


@pytest.mark.parametrize("bits", [8, 4])
def test_speculation_rolls_a_quantized_cache_back_exactly(bits: int) -> None:
    rows = prompts()
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                             disable_when_slower=False)
    plain, _, _ = decode("builtin:tiny", rows, [GREEDY] * len(rows), None, kv_bits=bits)
    fast, counts, _ = decode("builtin:tiny", rows, [GREEDY] * len(rows), spec, kv_bits=bits)
    assert fast == plain
    assert counts.accepted > 0
