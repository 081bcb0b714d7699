"""KV bytes measured per cache kind (`replicas.engine.kv.layout`), on built-in random-weight
models in mlx-lm's own classes: MLA (DeepSeek V3), sliding window (gpt-oss), linear attention
(Qwen3-Next) and SSM (Nemotron-H), each loaded through the production path.

For each: what the replica measured at load predicts, within 5%, what a prefill really
takes (MLX's active memory before and after, an independent reading); admission lets in
exactly the number of requests the budget holds by that layout; and greedy text alone
equals mlx-lm's own generation.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Iterator

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from replicas.builtin.recipe import CACHE_KINDS
from replicas.contract import Finished, GenerationRequest, SamplingParams, TextDelta, TokenPrompt
from replicas.engine.config import EngineConfig
from replicas.engine.kv.layout import CACHE_STEP, KvLayout
from replicas.replica import ModelReplica, ReplicaOptions
from tests.streams import collect, stream_events

NAMES = [recipe.name for recipe in CACHE_KINDS]
FIT = 3  # requests the test budget holds at once, one cache step each
PROMPT, OUTPUT = 12, 40


def _replica(name: str, budget: int | None = None) -> ModelReplica:
    rep = ModelReplica(ReplicaOptions(model_id=name, source=f"builtin:{name}",
                                      engine=EngineConfig(kv_budget_bytes=budget,
                                                          prompt_cache_bytes=0)))
    rep.start()
    return rep


@pytest.fixture(scope="module", params=NAMES)
def replica(request: pytest.FixtureRequest) -> Iterator[ModelReplica]:
    rep = _replica(request.param)
    yield rep
    rep.shutdown()


def _layout(rep: ModelReplica) -> KvLayout:
    return rep._engine.kv_budget.layout  # noqa: SLF001 - what the replica measured at load


def _prefill_bytes(rep: ModelReplica, tokens: int) -> int:
    """Active memory a fresh cache holds after `tokens - 1` tokens of prefill and one decode
    step (a sliding-window layer trims to its window there), everything else released."""
    model = rep.model.model
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    cache = make_prompt_cache(model)
    for chunk in (list(range(1, tokens)), [3]):
        out = model(mx.array([chunk]), cache=cache)
        mx.eval(out)
        del out
    mx.eval([c.state for c in cache])
    gc.collect()
    mx.clear_cache()
    used = mx.get_active_memory() - before
    del cache
    return used


@pytest.mark.parametrize("tokens", [2 * CACHE_STEP, 3 * CACHE_STEP])
def test_measured_bytes_match_what_a_prefill_takes(replica: ModelReplica, tokens: int) -> None:
    predicted = _layout(replica).bytes_for(tokens)
    used = _prefill_bytes(replica, tokens)
    assert abs(used - predicted) <= 0.05 * predicted, (replica.options.model_id, used, predicted)


def test_the_layout_is_the_kind_it_should_be(replica: ModelReplica) -> None:
    layout = _layout(replica)
    config = replica.model.config
    name = replica.options.model_id
    if name == "arch-mla":  # one latent plus the rope key per token and layer
        per_layer = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4
        assert (layout.per_token, layout.windows, layout.per_sequence) == \
            (per_layer * config["num_hidden_layers"], (), 0)
        # The plain-attention guess (K and V of every head, each layer) is 2.7 times more.
        plain = 2 * config["num_key_value_heads"] * config["head_dim"] * 4 * 2
        assert layout.per_token * 2.5 <= plain
    elif name == "arch-sliding":
        assert [w for w, _ in layout.windows] == [config["sliding_window"]]
        assert layout.per_sequence == 0
    else:  # linear attention and SSM: a fixed state per sequence besides attention layers
        assert layout.per_sequence > 0 and layout.windows == ()


def _request(rid: str, first: int, max_tokens: int = OUTPUT) -> GenerationRequest:
    return GenerationRequest(request_id=rid, model="m",
                             prompt=TokenPrompt(tuple(range(first, first + PROMPT))),
                             sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens))


def _text(events: list[object]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def test_greedy_text_is_mlx_lm_s(replica: ModelReplica) -> None:
    prompt = mx.array(list(range(7, 7 + PROMPT)))
    ids = [int(token) for token, _ in zip(
        (t for t, _ in generate_step(prompt, replica.model.model,
                                     sampler=make_sampler(temp=0.0))), range(OUTPUT))]
    events = stream_events(replica, _request("alone", 7))
    assert isinstance(events[-1], Finished)
    assert _text(events) == replica.model.tokenizer.decode(ids)


def test_admission_lets_in_what_the_budget_holds(replica: ModelReplica) -> None:
    name = replica.options.model_id
    # FIT rows of one step each, and not one more (a fourth would need a whole step).
    budget = FIT * _layout(replica).bytes_for(CACHE_STEP) + _layout(replica).bytes_for(1)
    rep = _replica(name, budget)
    try:
        samples: list[int] = []

        async def run() -> list[list[object]]:
            async def watch() -> None:
                while True:
                    samples.append(rep.stats().active)
                    await asyncio.sleep(0.002)

            watcher = asyncio.create_task(watch())
            try:
                return list(await asyncio.gather(
                    *(collect(rep.stream(_request(f"r{i}", 5 + i))) for i in range(FIT + 2))))
            finally:
                watcher.cancel()

        results = asyncio.run(run())
        assert all(isinstance(events[-1], Finished) for events in results)
        assert max(samples) == FIT, (name, max(samples))
    finally:
        rep.shutdown()
