"""A quantized KV cache on MLA models, loaded through the production path: DeepSeek V3's
class (`builtin:arch-mla`), LongCat-Flash's (`builtin:arch-longcat`), whose layers each
cache two attentions in a `CacheList`, DeepSeek V3.2's (`builtin:arch-dsv32`), whose sparse
indexer keeps its own keys unpacked beside the packed latent, and Kimi Linear's
(`builtin:arch-kimi-linear`), whose MLA layers sit among linear-attention ones. Orchard's
MLA attention reads the packed latent and rope key (`replicas.engine.model.mla`), where mlx-lm's
cannot.

On each: bytes per token fall as the packing says; the top token stays within a stated
tolerance of the unquantized cache's; rows batched together equal each alone; the prefix
cache serves a conversation's earlier turn from it with the output unchanged; and
speculation rolls the packed latent back exactly (where the model speculates at all).
"""

from __future__ import annotations

from typing import Iterator

import mlx.core as mx
import pytest
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

from replicas.engine.config import EngineConfig, SpeculativeConfig
from replicas.engine.kv.quantized import make_quantized_prompt_cache
from replicas.replica import ModelReplica, ReplicaOptions
from tests.integration.test_kv_quantized import check_conversation_from_the_cache, layout, text
from tests.integration.test_prompt_cache import output
from tests.integration.test_speculative import GREEDY, decode, model, prompts
from tests.scripted import script_request
from tests.streams import stream_events

SOURCE = "builtin:arch-mla"
SOURCES = [SOURCE, "builtin:arch-longcat", "builtin:arch-dsv32", "builtin:arch-kimi-linear"]
# DeepSeek V3.2's sparse indexer and Kimi Linear's linear layers decode one token a pass.
ROLLS_BACK = SOURCES[:2]
GROUP = 32  # the built-in MLAs' rope key is 32 wide
# The least share of positions whose top token equals the unquantized cache's, fed the same
# tokens, by model and bits. Measured on these random-weight models (281 positions): DeepSeek
# V3 99.6% at 8 bits, 87% at 4; LongCat 96.8% and 74% (two attentions a layer, both read
# through the packed cache, and both latents scaled: more rounding reaches the logits);
# DeepSeek V3.2 97.5% and 75% (the indexer's picks are computed from float keys, but the
# attention over them reads the packed latent); Kimi Linear 100% and 97% (one MLA layer of
# four, the rest linear attention with float state).
AGREEMENT = {(SOURCE, 8): 0.98, (SOURCE, 4): 0.80,
             ("builtin:arch-longcat", 8): 0.95, ("builtin:arch-longcat", 4): 0.70,
             ("builtin:arch-dsv32", 8): 0.95, ("builtin:arch-dsv32", 4): 0.70,
             ("builtin:arch-kimi-linear", 8): 0.98, ("builtin:arch-kimi-linear", 4): 0.90}


def make(bits: int | None, cache: bool = True, source: str = SOURCE) -> ModelReplica:
    rep = ModelReplica(ReplicaOptions(model_id="mla", source=source, engine=EngineConfig(
        kv_bits=bits, kv_group_size=GROUP, prompt_cache_bytes=(1 << 30) if cache else 0)))
    rep.start()
    return rep


@pytest.fixture(scope="module", params=[(s, b) for s in SOURCES for b in (8, 4)],
                ids=lambda p: f"{p[0].split(':')[1]}-{p[1]}")
def quantized(request: pytest.FixtureRequest) -> Iterator[tuple[int, ModelReplica]]:
    source, bits = request.param
    rep = make(bits, source=source)
    yield bits, rep
    rep.shutdown()


def test_bytes_per_token_fall_as_the_packing_says(quantized: tuple[int, ModelReplica]) -> None:
    bits, rep = quantized
    plain = make(None, cache=False, source=rep.options.source)
    try:
        dtype_bits = 8 * plain.model.model.model.embed_tokens.weight.dtype.size
        packing = (bits + 2 * dtype_bits / GROUP) / dtype_bits
        # Per token and layer: the latent and rope key, packed; DeepSeek V3.2's indexer
        # keys (and the zeros mlx-lm keeps beside them as values) stay in the float dtype.
        args = plain.model.model.args
        latent = args.kv_lora_rank + args.qk_rope_head_dim
        index = 2 * getattr(args, "index_head_dim", 0)
        assert layout(rep).per_token / layout(plain).per_token == pytest.approx(
            (packing * latent + index) / (latent + index), rel=1e-6)
    finally:
        plain.shutdown()


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("bits", [8, 4])
def test_the_top_token_stays_within_the_stated_tolerance(bits: int, source: str) -> None:
    net = model(source)

    def tops(cache: list[object], tokens: list[int]) -> mx.array:
        logits = [net(mx.array([tokens[:16]]), cache=cache)[0, -1]]  # a prefill, then steps
        logits += [net(mx.array([[t]]), cache=cache)[0, -1] for t in tokens[16:]]
        return mx.argmax(mx.stack(logits), axis=-1)

    agree = total = 0
    for row in prompts():
        tokens = (row * 4)[:80]
        same = tops(make_prompt_cache(net), tokens) == tops(
            make_quantized_prompt_cache(net, bits, GROUP), tokens)
        agree, total = agree + int(same.sum().item()), total + same.size
    assert agree / total >= AGREEMENT[source, bits]


@pytest.mark.parametrize("source", SOURCES)
def test_rows_batched_together_equal_each_alone(source: str) -> None:
    rows = prompts()
    together, _, _ = decode(source, rows, [GREEDY] * len(rows), None, kv_bits=8)
    alone = [decode(source, [row], [GREEDY], None, kv_bits=8)[0][0] for row in rows]
    assert together == alone


@pytest.mark.parametrize("source", ROLLS_BACK)
@pytest.mark.parametrize("bits", [8, 4])
def test_speculation_rolls_the_packed_latent_back_exactly(bits: int, source: str) -> None:
    rows = prompts()
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                             disable_when_slower=False)
    plain, _, _ = decode(source, rows, [GREEDY] * len(rows), None, kv_bits=bits)
    fast, counts, _ = decode(source, rows, [GREEDY] * len(rows), spec, kv_bits=bits)
    assert fast == plain
    assert counts.accepted > 0


def test_the_prefix_cache_serves_an_earlier_turn_from_the_packed_latent(
        quantized: tuple[int, ModelReplica]) -> None:
    bits, rep = quantized
    source = rep.options.source

    def fresh() -> ModelReplica:
        return make(bits, cache=False, source=source)

    if can_trim_prompt_cache(make_prompt_cache(rep.model.model)):
        check_conversation_from_the_cache(rep, fresh)
        return
    # Kimi Linear's linear layers keep a state that cannot drop tokens, so an entry serves
    # exactly its own prefix, never a trimmed longer one: a later turn's prompt is kept at
    # its last message boundary, and the earlier turn, whose prompt ends there, reuses it.
    cold = fresh()
    try:
        expected = [text(cold, sid) for sid in ("tool-result", "tool-one")]
    finally:
        cold.shutdown()
    later = stream_events(rep, script_request("tool-result"))
    earlier = stream_events(rep, script_request("tool-one"))
    assert earlier[-1].usage.cached_tokens > 0  # type: ignore[union-attr]
    assert [output(later), output(earlier)] == expected
