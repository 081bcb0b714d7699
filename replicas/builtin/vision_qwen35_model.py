"""`builtin:vision-qwen35`: a tiny vision-language model laid out as Qwen3.5 (`qwen3_5`): a
hybrid text model whose layers are linear attention (gated delta: a fixed recurrent state
per sequence) but for every `full_attention_interval`-th (Qwen3.5's 4th, here every 2nd),
full attention with a gated query and partial interleaved M-RoPE; Qwen3-VL's vision tower
without DeepStack. `builtin:vision-qwen35-moe` is the same with Qwen3.5's MoE (`qwen3_5_moe`):
each layer's MLP routed experts plus a gated shared expert.

Random weights made by mlx-vlm's own `qwen3_5` classes, under the names mlx-vlm saves (MLX
layouts, so neither loader shifts the norms or moves the convolution's axes); mlx-lm reads
the `text_config` as its `qwen3_5` text model. `builtin:vision-qwen3`'s tokenizer, template
and processor (vision_qwen3_model.py).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from .build import ensure_scripted
from .chat_template import chat_template
from .vision_qwen3_model import RECIPE as DENSE_RECIPE
from .vision_qwen3_model import VISION, build_qwen3_vl_layout
from .vision_qwen_model import IMAGE_PART


NAME = "vision-qwen35"
MOE_NAME = "vision-qwen35-moe"
# Four layers, linear attention at 0 and 2, full at 1 and 3. Heads of 64 rotated over their
# first 16 dimensions (a quarter, as Qwen3.5's), in interleaved sections of 3, 3 and 2.
HYBRID: dict[str, Any] = {
    "num_hidden_layers": 4, "full_attention_interval": 2, "head_dim": 64,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "mrope_section": [3, 3, 2],
                        "mrope_interleaved": True, "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25},
}
# Qwen3.5's MoE: 4 routed experts, 2 per token, and a shared expert behind a sigmoid gate.
MOE: dict[str, Any] = {
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "norm_topk_prob": True,
}
# name: model type, architecture, what the text config adds
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    NAME: ("qwen3_5", "Qwen3_5ForConditionalGeneration", {}),
    MOE_NAME: ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", MOE),
}
SEED = 20251208


def ensure_vision_qwen35_model(name: str = NAME, cache_dir: Path | None = None) -> Path:
    """The cached directory of `builtin:<name>` (a `VARIANTS` name), built first if missing
    (seconds)."""
    return ensure_scripted(
        name, replace(DENSE_RECIPE, name=name),
        repr(sorted(VISION.items())) + repr(sorted(HYBRID.items())) + repr(VARIANTS[name])
        + chat_template(IMAGE_PART),
        lambda tmp, text, key: build_vision_qwen35_model(tmp, text, key, name), cache_dir)


def build_vision_qwen35_model(out_dir: Path, scripts: str, key: str, name: str = NAME) -> None:
    model_type, architecture, text_extra = VARIANTS[name]
    build_qwen3_vl_layout(
        out_dir, scripts, key, name=name, seed=SEED, model_type=model_type,
        architecture=architecture,
        text={**HYBRID, **text_extra, "model_type": f"{model_type}_text",
              "tie_word_embeddings": False},
        drop=("architectures", "rope_theta"),
        vision={**VISION, "model_type": model_type, "deepstack_visual_indexes": []},
        tied=False)
