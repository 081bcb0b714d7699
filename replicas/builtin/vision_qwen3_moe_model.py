"""`builtin:vision-qwen3-moe`: a tiny vision-language model laid out as Qwen3-VL's MoE
(`qwen3_vl_moe`): `builtin:vision-qwen3`'s vision tower, tokenizer, template and processor
(vision_qwen3_model.py), with a text model whose MLPs are a mixture of experts (mlx-lm reads
its `text_config` as `qwen3_moe`). Interleaved M-RoPE and DeepStack as in the dense model.

Random weights made by mlx-vlm's own `qwen3_vl_moe` classes, under the names mlx-vlm saves
(the experts stacked in `switch_mlp`, which mlx-lm's `qwen3_vl_moe` reads as they are). Four
experts, two per token, so the router's choice changes the answer; the last layer keeps a
dense MLP (`mlp_only_layers`), as a checkpoint may. The head is untied: mlx-lm's
`qwen3_vl_moe` reads `language_model.lm_head`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from .build import ensure_scripted
from .chat_template import chat_template
from .vision_qwen3_model import RECIPE as DENSE_RECIPE
from .vision_qwen3_model import TEXT, VISION, build_qwen3_vl_layout
from .vision_qwen_model import IMAGE_PART, MROPE_SECTION


NAME = "vision-qwen3-moe"
RECIPE = replace(DENSE_RECIPE, name=NAME)
MOE: dict[str, Any] = {
    "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
    "mlp_only_layers": [TEXT.num_hidden_layers - 1], "moe_intermediate_size": 64,
    "norm_topk_prob": True,
}
SEED = 20251207


def ensure_vision_qwen3_moe_model(cache_dir: Path | None = None) -> Path:
    """The cached directory of `builtin:vision-qwen3-moe`, built first if missing (seconds)."""
    return ensure_scripted(
        NAME, RECIPE, repr(sorted(VISION.items())) + repr(sorted(MOE.items()))
        + repr(MROPE_SECTION) + chat_template(IMAGE_PART), build_vision_qwen3_moe_model,
        cache_dir)


def build_vision_qwen3_moe_model(out_dir: Path, scripts: str, key: str) -> None:
    build_qwen3_vl_layout(
        out_dir, scripts, key, name=NAME, seed=SEED, model_type="qwen3_vl_moe",
        architecture="Qwen3VLMoeForConditionalGeneration",
        text={**MOE, "model_type": "qwen3_vl_moe_text", "rope_theta": 5000000.0,
              "tie_word_embeddings": False,
              "rope_scaling": {"rope_type": "default", "mrope_section": MROPE_SECTION,
                               "mrope_interleaved": True}},
        drop=("architectures",), vision={**VISION, "model_type": "qwen3_vl_moe"}, tied=False)
