"""MLA's own route (`replicas.engine.model.mla`): a pass of a few positions over a cached context
gives what mlx-lm's decompressing route gives, in each mlx-lm MLA class Orchard absorbs,
and every model the production loader returns takes it; long passes (prefill) keep
mlx-lm's route; over a quantized cache every pass gives what mlx-lm's route gives on the
same KV unpacked."""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import (
    bailing_hybrid,
    bailing_moe_v3,
    deepseek_v32,
    glm4_moe_lite,
    kimi_k3,
    kimi_linear,
    longcat_flash,
    mistral4,
)
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import CacheList, KVCache, make_prompt_cache

from replicas.engine.model.loading import load_model
from replicas.engine.model.mla import ABSORBING, SHORT_PASS, absorb_short_passes, mla_attentions
from replicas.engine.kv.disk import snapshot
from replicas.engine.kv.transfer import decode, encode
from replicas.engine.kv.quantized import QuantizedRowKVCache, make_quantized_prompt_cache
from replicas.sources import resolve_source

CONTEXT = mx.array([[3 + i % 90 for i in range(40)]])


def arch_mla() -> nn.Module:
    return load_model("builtin:arch-mla", resolve_source("builtin:arch-mla")).model


# Each family's own model class at a test's size, random weights: 4 heads over a 32-wide
# latent and a 32-wide rope key.
SHAPE = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, kv_lora_rank=32,
             q_lora_rank=48, qk_rope_head_dim=32, qk_nope_head_dim=16, v_head_dim=16)


def absorbed(model: nn.Module) -> nn.Module:
    absorb_short_passes(model)
    return model


def glm_lite() -> nn.Module:
    """GLM-4.7-Flash's class."""
    mx.random.seed(7)
    return absorbed(glm4_moe_lite.Model(glm4_moe_lite.ModelArgs(
        **SHAPE, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2)))


def longcat() -> nn.Module:
    """LongCat-Flash's class, with both of its latent scales."""
    mx.random.seed(8)
    return absorbed(longcat_flash.Model(longcat_flash.ModelArgs(
        **SHAPE, model_type="longcat_flash", attention_method="MLA",
        zero_expert_type="identity", ffn_hidden_size=96, moe_topk=2,
        expert_ffn_hidden_size=32, n_routed_experts=4, zero_expert_num=2, num_layers=2,
        max_position_embeddings=4096, routed_scaling_factor=1.0, rms_norm_eps=1e-6,
        rope_theta=10000.0, mla_scale_q_lora=True, mla_scale_kv_lora=True,
        attention_bias=False)))


def mistral_small_4() -> nn.Module:
    """Mistral 4's class, its query scale growing past position 16."""
    mx.random.seed(9)
    return absorbed(mistral4.Model(mistral4.ModelArgs(
        **SHAPE, model_type="mistral4", intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
        routed_scaling_factor=1.0, norm_topk_prob=True, max_position_embeddings=4096,
        rms_norm_eps=1e-6, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        n_group=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                    "llama_4_scaling_beta": 0.1,
                                    "original_max_position_embeddings": 16})))


def dsv32() -> nn.Module:
    """DeepSeek V3.2's class (GLM-5's): past 8 cached positions its indexer picks the top 8."""
    mx.random.seed(10)
    return absorbed(deepseek_v32.Model(deepseek_v32.ModelArgs(
        **SHAPE, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1, index_head_dim=32, index_n_heads=2, index_topk=8)))


FAMILIES = [arch_mla, glm_lite, longcat, mistral_small_4, dsv32]
IDS = ["deepseek_v3", "glm4_moe_lite", "longcat_flash", "mistral4", "deepseek_v32"]


def mlx_lms_route(model: nn.Module, run: Callable[[], mx.array]) -> mx.array:
    """`run()` with every MLA attention back in mlx-lm's own class."""
    attentions = mla_attentions(model)
    absorbing = [type(a) for a in attentions]
    for attention in attentions:  # past the mixins: mlx-lm's class
        attention.__class__ = next(c for c in type(attention).__mro__
                                   if c.__module__.startswith("mlx_lm."))
    try:
        return run()
    finally:
        for attention, cls in zip(attentions, absorbing):
            attention.__class__ = cls


def passes(model: nn.Module, width: int, make_cache: Callable[[], list[Any]]
           ) -> Callable[[], mx.array]:
    step = mx.array([[7 + i for i in range(width)]])

    def run() -> mx.array:
        cache = make_cache()
        model(CONTEXT, cache=cache)
        return model(step, cache=cache)
    return run


@pytest.mark.parametrize("build", FAMILIES, ids=IDS)
@pytest.mark.parametrize("width", [2, 5, SHORT_PASS])
def test_a_short_pass_gives_what_mlx_lms_route_gives(build: Callable[[], nn.Module],
                                                     width: int) -> None:
    model = build()
    assert mla_attentions(model)
    assert all(type(a) in ABSORBING.values() for a in mla_attentions(model))
    run = passes(model, width, lambda: make_prompt_cache(model))
    absorbed, decompressed = run(), mlx_lms_route(model, run)
    assert mx.allclose(absorbed, decompressed, atol=1e-4, rtol=1e-4)
    assert mx.argmax(absorbed, -1).tolist() == mx.argmax(decompressed, -1).tolist()


class Unpacked:
    """A quantized cache's layer read back as plain arrays: what mlx-lm's route can take."""

    def __init__(self, layer: Any) -> None:
        self.layer, self.offset = layer, layer.offset
        # DeepSeek V3.2's route ties its indexer's cache to `keys` (`mx.depends`) alone.
        self.keys = mx.zeros((1,))

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return self.layer.make_mask(*args, **kwargs)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        packed = self.layer.update_and_fetch(keys, values)
        self.offset = self.layer.offset
        return tuple(mx.dequantize(*p, group_size=self.layer.group_size,  # type: ignore
                                   bits=self.layer.bits) for p in packed)


def unpacked(layer: Any) -> Any:
    """`Unpacked`, member by member for a `CacheList` (LongCat's two attentions a layer;
    DeepSeek V3.2's indexer keys, never packed, stay as they are)."""
    if isinstance(layer, CacheList):
        return CacheList(*(unpacked(c) for c in layer.caches))
    return Unpacked(layer) if hasattr(layer, "bits") else layer


@pytest.mark.parametrize("build", FAMILIES, ids=IDS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("width", [1, 5, SHORT_PASS + 3])
def test_over_a_quantized_cache_every_pass_reads_the_packed_kv_as_mlx_lm_would_unpacked(
        build: Callable[[], nn.Module], bits: int, width: int) -> None:
    model = build()
    own = passes(model, width, lambda: make_quantized_prompt_cache(model, bits, 32))
    packed = make_quantized_prompt_cache(model, bits, 32)  # made while Orchard's classes hold
    theirs = passes(model, width, lambda: [unpacked(c) for c in packed])
    ours, reference = own(), mlx_lms_route(model, theirs)
    assert mx.allclose(ours, reference, atol=1e-3, rtol=1e-3)
    assert mx.argmax(ours, -1).tolist() == mx.argmax(reference, -1).tolist()


def test_kv_bits_is_refused_in_config_terms_where_the_groups_do_not_fit() -> None:
    model = arch_mla()  # a 64-wide latent, a 32-wide rope key
    with pytest.raises(ValueError, match="kv_group_size 64 must divide both"):
        make_quantized_prompt_cache(model, 8, 64)


def test_kv_bits_is_refused_for_an_mla_class_orchard_does_not_absorb() -> None:
    model = glm_lite()
    for attention in mla_attentions(model):
        attention.__class__ = glm4_moe_lite.Glm4MoeLiteAttention
    with pytest.raises(ValueError, match="reads its KV cache unquantized"):
        make_quantized_prompt_cache(model, 8, 32)


def test_longcats_paired_attentions_are_packed_and_stored_as_mlx_lm_names_them() -> None:
    """LongCat's layer caches a `CacheList` of two attentions' KV: each member is packed,
    and the disk tier's and a pull's bytes (mlx-lm's format) load back as batch rows."""
    model = longcat()
    cache = make_quantized_prompt_cache(model, 8, 32)
    assert all(isinstance(c, CacheList) for c in cache)
    assert all(type(m) is QuantizedRowKVCache for c in cache for m in c.caches)
    model(CONTEXT, cache=cache)
    again = decode(encode(snapshot(cache)))
    assert [[type(m) for m in c.caches] for c in again] == \
        [[QuantizedRowKVCache] * 2 for _ in cache]
    step = mx.array([[9]])
    assert mx.array_equal(model(step, cache=again), model(step, cache=cache))


# The MLA beside linear attention (hybrids, whose caches cannot drop drafts: `kv_bits` is what
# Orchard's route is for there), each class alone at the test's shape, random weights.
MLA_DIMS = dict(kv_lora_rank=32, qk_rope_head_dim=32, qk_nope_head_dim=16, v_head_dim=16)


def kimi_linear_mla() -> nn.Module:
    """Kimi Linear's MLA: no low-rank queries, no position encoding (NoPE)."""
    return kimi_linear.KimiMLAAttention(kimi_linear.ModelArgs(
        model_type="kimi_linear", vocab_size=128, hidden_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=96, head_dim=16,
        rope_theta=10000.0, rms_norm_eps=1e-6, linear_attn_config={}, model_max_length=4096,
        num_experts=4, moe_intermediate_size=32, mla_use_nope=True, **MLA_DIMS))


def kimi_k3_mla() -> nn.Module:
    """Kimi K3's: NoPE, low-rank queries, its output gated per channel."""
    return kimi_k3.KimiK3MLAAttention(kimi_k3.TextArgs(
        hidden_size=64, num_attention_heads=4, q_lora_rank=48, mla_use_nope=True,
        mla_use_output_gate=True, **MLA_DIMS))


def ling_mla() -> nn.Module:
    """Ling's (Bailing hybrid): its output projection named `dense`."""
    return bailing_hybrid.MultiLatentAttention(bailing_hybrid.ModelArgs(
        model_type="bailing_hybrid", hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
        n_group=1, topk_group=1, first_k_dense_replace=1, layer_group_size=2,
        group_norm_size=1, vocab_size=128, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=4096, routed_scaling_factor=1.0, head_dim=16, q_lora_rank=48,
        **MLA_DIMS))


def ling_v3_mla() -> nn.Module:
    """Ling's (Bailing V3): a gate per head before `dense`."""
    return bailing_moe_v3.BailingMLA(bailing_moe_v3.ModelArgs(
        hidden_size=64, num_attention_heads=4, head_dim=16, q_lora_rank=48, **MLA_DIMS))


HYBRIDS = {"kimi_linear": kimi_linear_mla, "kimi_k3": kimi_k3_mla, "bailing_hybrid": ling_mla,
           "bailing_moe_v3": ling_v3_mla}


@pytest.mark.parametrize("build", HYBRIDS.values(), ids=HYBRIDS.keys())
@pytest.mark.parametrize("bits", [None, 8, 4])
@pytest.mark.parametrize("width", [1, 5, SHORT_PASS + 3])
def test_a_hybrids_mla_reads_a_packed_cache_as_mlx_lm_would_unpacked(
        build: Callable[[], nn.Module], bits: int | None, width: int) -> None:
    mx.random.seed(11)
    attention = absorbed(build())
    assert type(attention) in ABSORBING.values()
    context, step = mx.random.normal((1, 40, 64)), mx.random.normal((1, width, 64))

    def run(cache: Any) -> mx.array:
        attention(context, mask=create_causal_mask(40, 0), cache=cache)
        return attention(step, mask=create_causal_mask(width, 40) if width > 1 else None,
                         cache=cache)

    def fresh() -> Any:
        return QuantizedRowKVCache(group_size=32, bits=bits) if bits else KVCache()

    ours = run(fresh())
    packed = fresh()
    reference = mlx_lms_route(attention, lambda: run(Unpacked(packed) if bits else packed))
    assert mx.allclose(ours, reference, atol=1e-4, rtol=1e-4)
