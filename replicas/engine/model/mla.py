"""MLA attention (DeepSeek V3, Kimi K2, GLM-4.7-Flash, LongCat-Flash, Mistral Small 4, and
the hybrids' MLA: Kimi Linear, Kimi K3, Ling) in its absorbed form for short passes, and
over a quantized cache (DeepSeek V3.2 and GLM-5, whose sparse indexer picks the positions,
too).

mlx-lm 0.32.2's MLA attention attends over the compressed latents directly only for a pass
of one position; any longer pass first decompresses every cached latent into full keys and
values for all heads. That suits a prefill, but a speculative verifying pass (the pending
token and a few drafts, `replicas.engine.spec.drafter`) would then pay for the whole
context's decompression every step: O(context) on top of the pass, where the one-position
step pays O(context) only in the latent width. A short pass here takes the one-position
route (queries absorbed into the latent space, the output unembedded after), which holds
for any number of queries given the causal mask: so a verifying pass computes what the
plain steps do, and costs them a few positions more, not a decompression.

mlx-lm's MLA also reads its cache as plain arrays, so `kv_bits` (a packed latent and rope
key, `replicas.engine.kv.quantized`) fails in it. Over a quantized cache every pass runs
here: short ones absorbed against the packed latent, long ones on the latent unpacked.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_causal_mask, quantized_scaled_dot_product_attention
from mlx_lm.models.bailing_hybrid import MultiLatentAttention
from mlx_lm.models.bailing_moe_v3 import BailingMLA
from mlx_lm.models.deepseek_v3 import DeepseekV3Attention
from mlx_lm.models.deepseek_v32 import DeepseekV32Attention
from mlx_lm.models.glm4_moe_lite import Glm4MoeLiteAttention
from mlx_lm.models.kimi_k3 import KimiK3MLAAttention
from mlx_lm.models.kimi_linear import KimiMLAAttention
from mlx_lm.models.longcat_flash import LongcatFlashMLA
from mlx_lm.models.mistral4 import Mistral4Attention

# Passes up to this many positions stay in the latent space: a verifying pass is at most
# 1 + num_speculative_tokens (16) wide; prefill chunks are far wider.
SHORT_PASS = 17


class LatentAttention(nn.Module):
    """Mixed in before an mlx-lm MLA attention class (`ABSORBING`): its own route for what
    it does well, Orchard's for short passes and packed caches."""

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        # mlx-lm's layers pass (mask, cache), by position or by name; Mistral 4's pass its
        # per-position query scale first.
        attn_scale = args[0] if len(args) == 3 else None
        given = dict(zip(("mask", "cache"), args[1:] if len(args) == 3 else args)) | kwargs
        mask, cache = given.get("mask"), given.get("cache")
        L = x.shape[1]
        quantized = hasattr(cache, "bits")
        if not quantized and (L == 1 or L > SHORT_PASS or mask is None):
            return super().__call__(x, *args, **kwargs)  # type: ignore[misc]
        offset = cache.offset if cache is not None else 0
        q_nope, q_pe, latent, k_pe = self._project(x, offset, attn_scale)
        if isinstance(mask, str):  # "causal", from a single sequence's cache
            mask = create_causal_mask(L, offset)
        if cache is not None:
            latent, k_pe = cache.update_and_fetch(latent, k_pe)
        if quantized:  # the rope key is narrow (64 of DeepSeek V3's 576): unpack it whole
            k_pe = _unpack(k_pe, cache)
        return self._attend(x, q_nope, q_pe, latent, k_pe, mask, cache)

    def _attend(self, x: mx.array, q_nope: mx.array, q_pe: mx.array, latent: Any,
                k_pe: mx.array, mask: mx.array | None, cache: Any) -> mx.array:
        """The output of the queries over the cached latent (packed where `cache` is) and
        the unpacked rope key, under `mask`."""
        L = q_nope.shape[2]
        pe_scores = (q_pe * self.scale) @ k_pe.swapaxes(-1, -2)
        if mask is not None:
            pe_scores = mx.where(mask, pe_scores,
                                 mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype))
        if L > SHORT_PASS:  # a prefill over a quantized cache: mlx-lm's decompressing route
            latent = _unpack(latent, cache)
            output = mx.fast.scaled_dot_product_attention(
                q_nope, self.embed_q(latent, transpose=False), self.unembed_out(latent),
                scale=self.scale, mask=pe_scores)
        else:
            output = self.unembed_out(self._absorbed(self.embed_q(q_nope), latent,
                                                     pe_scores, cache))
        return self._output(output.transpose(0, 2, 1, 3), x)

    def _output(self, heads: mx.array, x: mx.array) -> mx.array:
        """The layer's output from each head's values (batch, positions, heads, width), as
        mlx-lm's class makes it: DeepSeek V3's output projection (a subclass for others)."""
        return self.o_proj(heads.reshape(*heads.shape[:2], -1))

    def _project(self, x: mx.array, offset: int, attn_scale: mx.array | None,
                 qr: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """The queries' two parts, the latent and the rope key, as mlx-lm's class makes
        them: DeepSeek V3's steps, with LongCat's two scales and Mistral 4's query scale
        where the class has them. `qr`: the queries' low-rank form, where made already."""
        B, L, _ = x.shape
        if getattr(self, "q_lora_rank", None) is None:  # Kimi Linear's has none
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)) if qr is None else qr)
        heads = getattr(self, "num_heads", None) or self.num_attention_heads
        q = q.reshape(B, L, heads, -1).transpose(0, 2, 1, 3)
        if getattr(self, "mla_scale_q_lora", None) is not None:
            q = q * self.mla_scale_q_lora
        q_nope, q_pe = mx.split(q, [self.qk_nope_head_dim], axis=-1)
        compressed, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
        k_pe = k_pe.reshape(B, L, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3)
        latent = self.kv_a_layernorm(compressed)
        if getattr(self, "mla_scale_kv_lora", None) is not None:
            latent = latent * self.mla_scale_kv_lora
        if getattr(self, "rope", None) is not None:  # Kimi's MLA has no position encoding
            q_pe, k_pe = self.rope(q_pe, offset), self.rope(k_pe, offset)
        if attn_scale is not None:
            q_nope, q_pe = q_nope * attn_scale, q_pe * attn_scale
        return q_nope, q_pe, mx.expand_dims(latent, axis=1), k_pe

    def _absorbed(self, queries: mx.array, latent: Any, pe_scores: mx.array, cache: Any
                  ) -> mx.array:
        """Every head's queries against the one latent, `pe_scores` added to the scores."""
        if not hasattr(cache, "bits"):
            return mx.fast.scaled_dot_product_attention(queries, latent, latent,
                                                        scale=self.scale, mask=pe_scores)
        # mlx-lm's quantized attention takes a mask per key head, and the latent is one
        # head under a mask per query head: so the heads ride in the positions' axis.
        B, H, L, _ = queries.shape
        output = quantized_scaled_dot_product_attention(
            queries.reshape(B, 1, H * L, -1), latent, latent, scale=self.scale,
            mask=pe_scores.reshape(B, 1, H * L, -1), group_size=cache.group_size,
            bits=cache.bits)
        return output.reshape(B, H, L, -1)


def _unpack(packed: Any, cache: Any) -> mx.array:
    """A packed (codes, scales, biases) cache part as plain values."""
    codes, scales, biases = packed
    return mx.dequantize(codes, scales, biases, group_size=cache.group_size, bits=cache.bits)


class SparseLatentAttention(LatentAttention):
    """DeepSeek V3.2's MLA (GLM-5's too) over a packed latent. Its indexer, on its own float
    cache (`cache[1]`), picks the cached positions each query attends to: a decode step
    gathers those (packed), as mlx-lm's gathers them unpacked; a longer pass masks the rest.
    Over a float cache every pass is mlx-lm's (speculation is off for this class:
    `speculation.can_roll_back`)."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if cache is None or not hasattr(cache[0], "bits"):
            return super(LatentAttention, self).__call__(x, mask, cache)  # type: ignore[misc]
        latents, index = cache[0], cache[1]
        L = x.shape[1]
        qr = self.q_a_layernorm(self.q_a_proj(x))
        q_nope, q_pe, latent, k_pe = self._project(x, latents.offset, None, qr)
        if isinstance(mask, str):  # "causal", from a single sequence's cache
            mask = create_causal_mask(L, latents.offset)
        packed, pe = latents.update_and_fetch(latent, k_pe)
        k_pe = _unpack(pe, latents)
        top = self.indexer(x, qr, mask, cache=index)  # None while the context fits
        # As mlx-lm's: the next step reads the latent, so the indexer's keys are evaluated
        # then even while no pick uses them (else their graph grows every step).
        codes, *rest = latents.keys
        latents.keys = (mx.depends(codes, (index.keys, index.values)), *rest)
        if top is not None and L == 1:
            at = top[:, :, 0, :, None]  # (batch, 1, top_k, 1): slots along axis 2
            pick = lambda a: mx.take_along_axis(  # noqa: E731
                a, mx.broadcast_to(at, (*at.shape[:-1], a.shape[-1])), axis=2)
            packed, k_pe = tuple(pick(a) for a in packed), pick(k_pe)
            mask = None if mask is None else mx.take_along_axis(mask, top, axis=-1)
        elif top is not None:
            picked = mx.put_along_axis(mx.zeros((*top.shape[:-1], k_pe.shape[2]), mx.bool_),
                                       top, mx.array(True), axis=-1)
            mask = picked if mask is None else picked & mask
        return self._attend(x, q_nope, q_pe, packed, k_pe, mask, latents)


def has_sparse_indexer(model: nn.Module) -> bool:
    """Whether `model` attends through a sparse indexer (DeepSeek V3.2, GLM-5): each layer's
    `CacheList` then holds the latent (`[0]`) and the indexer's own keys (`[1]`)."""
    return any(hasattr(m, "index_topk") for _, m in model.named_modules())


class GatedLatentAttention(LatentAttention):
    """Kimi K3's MLA: its output gated per channel (where the checkpoint says so)."""

    def _output(self, heads: mx.array, x: mx.array) -> mx.array:
        out = heads.reshape(*heads.shape[:2], -1)
        return self.o_proj(out * mx.sigmoid(self.g_proj(x)) if self.use_gate else out)


class DenseLatentAttention(LatentAttention):
    """Ling's MLA (Bailing hybrid, Bailing V3): its output projection is `dense`, after a
    gate per head where the class has one (V3)."""

    def _output(self, heads: mx.array, x: mx.array) -> mx.array:
        if hasattr(self, "g_proj"):
            gate = mx.sigmoid(self.g_proj(x).astype(mx.float32)).astype(heads.dtype)
            heads = heads * gate[..., None]
        return self.dense(heads.reshape(*heads.shape[:2], -1))


# mlx-lm's MLA classes Orchard absorbs, each with the route that absorbs it.
_ROUTES: dict[type, type] = {
    DeepseekV3Attention: LatentAttention, Glm4MoeLiteAttention: LatentAttention,
    LongcatFlashMLA: LatentAttention, Mistral4Attention: LatentAttention,
    KimiMLAAttention: LatentAttention, KimiK3MLAAttention: GatedLatentAttention,
    MultiLatentAttention: DenseLatentAttention, BailingMLA: DenseLatentAttention,
    DeepseekV32Attention: SparseLatentAttention}
ABSORBING: dict[type, type] = {cls: type(f"Absorbing{cls.__name__}", (route, cls), {})
                               for cls, route in _ROUTES.items()}


def absorb_short_passes(model: nn.Module) -> None:
    """Every MLA attention of `model` (in place) that Orchard knows takes short passes and
    quantized caches its own way."""
    for _, module in model.named_modules():
        absorbing = ABSORBING.get(type(module))
        if absorbing is not None:
            module.__class__ = absorbing


def mla_attentions(model: nn.Module) -> list[nn.Module]:
    """`model`'s MLA attention modules (any mlx-lm class with a compressed latent)."""
    return [m for _, m in model.named_modules()
            if hasattr(m, "kv_lora_rank") and hasattr(m, "embed_q")]
