"""MLA attention (DeepSeek V3, Kimi K2) in its absorbed form for short passes.

mlx-lm 0.32.2's `DeepseekV3Attention` attends over the compressed latents directly only
for a pass of one position; any longer pass first decompresses every cached latent into
full keys and values for all heads. That suits a prefill, but a speculative verifying pass
(the pending token and a few drafts, `replicas.engine.speculation`) would then pay for the
whole context's decompression every step: O(context) on top of the pass, where the
one-position step pays O(context) only in the latent width. A short pass here takes the
one-position route (queries absorbed into the latent space, the output unembedded after),
which holds for any number of queries given the causal mask: so a verifying pass computes
what the plain steps do, and costs them a few positions more, not a decompression.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.deepseek_v3 import DeepseekV3Attention

# Passes up to this many positions stay in the latent space: a verifying pass is at most
# 1 + num_speculative_tokens (16) wide; prefill chunks are far wider.
SHORT_PASS = 17


class ShortPassMLA(DeepseekV3Attention):
    """mlx-lm's MLA attention, absorbed for passes of up to `SHORT_PASS` positions."""

    def __call__(self, x: mx.array, mask: mx.array | None = None, cache: Any = None
                 ) -> mx.array:
        B, L, _ = x.shape
        if L == 1 or L > SHORT_PASS or mask is None:
            return super().__call__(x, mask, cache)
        # mlx-lm's own steps, as its one-position branch takes them.
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(B, L, self.num_heads, self.q_head_dim).transpose(0, 2, 1, 3)
        q_nope, q_pe = mx.split(q, [self.qk_nope_head_dim], axis=-1)
        compressed, k_pe = mx.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
        k_pe = k_pe.reshape(B, L, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3)
        latent = mx.expand_dims(self.kv_a_layernorm(compressed), axis=1)
        offset = cache.offset if cache is not None else 0
        q_pe, k_pe = self.rope(q_pe, offset), self.rope(k_pe, offset)
        if cache is not None:
            latent, k_pe = cache.update_and_fetch(latent, k_pe)
        pe_scores = (q_pe * self.scale) @ k_pe.swapaxes(-1, -2)
        pe_scores = mx.where(mask, pe_scores,
                             mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype))
        output = scaled_dot_product_attention(self.embed_q(q_nope), latent, latent,
                                              cache=cache, scale=self.scale, mask=pe_scores)
        output = self.unembed_out(output)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


def absorb_short_passes(model: nn.Module) -> None:
    """Every MLA attention of `model` (in place) takes short passes absorbed."""
    for _, module in model.named_modules():
        if type(module) is DeepseekV3Attention:
            module.__class__ = ShortPassMLA
