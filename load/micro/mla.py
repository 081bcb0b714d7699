"""What one verifying pass costs on MLA models: mlx-lm's attention against Orchard's
(`replicas.engine.model.mla`), in the same run, on each family's own mlx-lm class.

A pass of W positions (the pending token and W - 1 drafts) over a cached context: mlx-lm
0.32.2 decompresses every cached latent for all heads when W > 1, Orchard attends in the
latent space. W = 1 is mlx-lm's own absorbed step in both: the baseline a verifying pass
should stay near. With `--kv-bits`, Orchard's passes also run over a packed cache (mlx-lm's
MLA cannot read one, so that row has no baseline).

    python -m load.micro.mla
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import deepseek_v3, glm4_moe_lite, mistral4
from mlx_lm.models.cache import make_prompt_cache

from replicas.engine.model.mla import absorb_short_passes, mla_attentions
from replicas.engine.kv.quantized import make_quantized_prompt_cache

# `bench`'s width and depth (hidden 512, 8 layers), dense, DeepSeek V3's latent proportions.
SHAPE = dict(vocab_size=1024, hidden_size=512, num_attention_heads=8, kv_lora_rank=256,
             q_lora_rank=384, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
             intermediate_size=1536, moe_intermediate_size=64, num_hidden_layers=8,
             num_key_value_heads=8, n_routed_experts=4, num_experts_per_tok=2,
             first_k_dense_replace=9)
FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "deepseek_v3": lambda: deepseek_v3.Model(deepseek_v3.ModelArgs(
        **SHAPE, model_type="deepseek_v3", n_group=1, topk_group=1)),
    "glm4_moe_lite": lambda: glm4_moe_lite.Model(glm4_moe_lite.ModelArgs(**SHAPE)),
    "mistral4": lambda: mistral4.Model(mistral4.ModelArgs(
        **SHAPE, model_type="mistral4", n_shared_experts=1, routed_scaling_factor=1.0,
        norm_topk_prob=True, max_position_embeddings=32768, rms_norm_eps=1e-6, topk_group=1,
        n_group=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                    "llama_4_scaling_beta": 0.1,
                                    "original_max_position_embeddings": 8192})),
}


def pass_ms(model: nn.Module, make_cache: Callable[[], list[Any]], context: int, width: int,
            rounds: int) -> float:
    """The median time of one `width`-position forward over `context` cached tokens."""
    prompt = mx.array([[3 + i % 1000 for i in range(context)]])
    step = mx.array([[7 + i for i in range(width)]])
    times = []
    for _ in range(rounds):
        cache = make_cache()
        mx.eval(model(prompt, cache=cache))
        start = time.perf_counter()
        mx.eval(model(step, cache=cache))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def mlx_lms(model: nn.Module) -> list[tuple[nn.Module, type]]:
    """Every MLA attention put back in mlx-lm's own class; returns how to undo it."""
    undo = [(a, type(a)) for a in mla_attentions(model)]
    for attention, cls in undo:
        attention.__class__ = cls.__mro__[2]  # past Orchard's mixin
    return undo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=512, help="cached tokens")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 5],
                        help="positions per pass")
    parser.add_argument("--rounds", type=int, default=3, help="timed passes per figure")
    parser.add_argument("--kv-bits", type=int, choices=[4, 8], default=8,
                        help="Orchard's packed-cache row (groups of 64)")
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES),
                        default=sorted(FAMILIES))
    return parser


def main() -> None:
    args = build_parser().parse_args()
    print(f"one forward of W positions over {args.context} cached tokens, bfloat16, "
          f"median of {args.rounds} (ms); ratio: mlx-lm / Orchard")
    for name in args.families:
        mx.random.seed(0)
        model = FAMILIES[name]()
        model.set_dtype(mx.bfloat16)
        mx.eval(model.parameters())
        absorb_short_passes(model)
        plain = lambda: make_prompt_cache(model)  # noqa: E731
        packed = lambda: make_quantized_prompt_cache(model, args.kv_bits, 64)  # noqa: E731
        ours = {w: pass_ms(model, plain, args.context, w, args.rounds) for w in args.widths}
        ours_q = {w: pass_ms(model, packed, args.context, w, args.rounds)
                  for w in args.widths}
        undo = mlx_lms(model)
        theirs = {w: pass_ms(model, plain, args.context, w, args.rounds) for w in args.widths}
        for attention, cls in undo:
            attention.__class__ = cls
        for w in args.widths:
            print(f"{name:14s} W={w:<3d} mlx-lm {theirs[w]:7.1f}  Orchard {ours[w]:7.1f}  "
                  f"ratio {theirs[w] / ours[w]:5.2f}   Orchard kv_bits {args.kv_bits} "
                  f"{ours_q[w]:7.1f}")


if __name__ == "__main__":
    main()
