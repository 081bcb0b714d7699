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

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ..startup import Progress
from .build import cached_build, default_cache_root, save_random_model
from .chat_template import chat_template
from .recipe import cache_key
from .scripts import parse_scripts, scripts_text
from .tokenizer_files import (
    PAD_TOKEN,
    SPECIAL_TOKENS,
    token_id,
    train_tokenizer,
    training_texts,
    write_json,
    write_tokenizer_files,
)
from .vision_qwen3_model import RECIPE as DENSE_RECIPE
from .vision_qwen3_model import TEXT, VISION
from .vision_qwen_model import (
    _IMAGE_MEAN,
    _IMAGE_STD,
    IMAGE_PAD,
    IMAGE_PART,
    MAX_PIXELS,
    MERGE_SIZE,
    MIN_PIXELS,
    MROPE_SECTION,
    PATCH_SIZE,
    TEMPORAL_PATCH,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    _tokenizer_config,
)

log = logging.getLogger(__name__)

NAME = "vision-qwen3-moe"
RECIPE = replace(DENSE_RECIPE, name=NAME)
MOE: dict[str, Any] = {
    "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
    "mlp_only_layers": [TEXT.num_hidden_layers - 1], "moe_intermediate_size": 64,
    "norm_topk_prob": True,
}
SEED = 20251207
DTYPE = "float32"


def ensure_vision_qwen3_moe_model(cache_dir: Path | None = None) -> Path:
    """The cached directory of `builtin:vision-qwen3-moe`, built first if missing (seconds)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    text = scripts_text()
    key = cache_key(RECIPE, text + repr(sorted(VISION.items())) + repr(sorted(MOE.items()))
                    + repr(MROPE_SECTION) + chat_template(IMAGE_PART))

    def make(tmp: Path) -> None:
        with Progress(f"building the built-in model builtin:{NAME}",
                      f"once (cached in {root}), a few seconds"):
            build_vision_qwen3_moe_model(tmp, text, key)

    return cached_build(root, key, make)


def build_vision_qwen3_moe_model(out_dir: Path, scripts: str, key: str) -> None:
    vision_tokens = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
    tokenizer = train_tokenizer(training_texts(parse_scripts(scripts)), 1024, 2,
                                special=(*SPECIAL_TOKENS, *vision_tokens))
    eos = write_tokenizer_files(tokenizer, out_dir, TEXT.max_position_embeddings)
    _tokenizer_config(out_dir, tokenizer, vision_tokens)
    pad = token_id(tokenizer, PAD_TOKEN)
    text = TEXT.config(tokenizer.get_vocab_size(), eos, pad, DTYPE)
    text.update(MOE)
    text.update({
        "model_type": "qwen3_vl_moe_text", "rope_theta": 5000000.0,
        "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "default", "mrope_section": MROPE_SECTION,
                         "mrope_interleaved": True},
    })
    text.pop("architectures")
    config = {
        "architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe",
        "text_config": text, "vision_config": {**VISION, "model_type": "qwen3_vl_moe"},
        "image_token_id": token_id(tokenizer, IMAGE_PAD),
        "video_token_id": token_id(tokenizer, VIDEO_PAD),
        "vision_start_token_id": token_id(tokenizer, VISION_START),
        "vision_end_token_id": token_id(tokenizer, VISION_END),
        "tie_word_embeddings": False, "eos_token_id": [eos], "torch_dtype": DTYPE,
    }
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json",
               {"bos_token_id": pad, "eos_token_id": [eos], "pad_token_id": pad})
    write_json(out_dir / "preprocessor_config.json", {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
        "patch_size": PATCH_SIZE, "temporal_patch_size": TEMPORAL_PATCH,
        "merge_size": MERGE_SIZE, "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": _IMAGE_MEAN, "image_std": _IMAGE_STD,
        "do_convert_rgb": True, "resample": 3})
    weights = _random_weights(config)
    parameters = save_random_model(out_dir, weights, name=NAME, key=key, seed=SEED)
    log.info("built builtin:%s (%d parameters)", NAME, parameters)


def _random_weights(config: dict[str, Any]) -> dict[str, mx.array]:
    """mlx-vlm's own Qwen3-VL MoE model with its initial (random) weights, under the names
    mlx-vlm saves."""
    from mlx_vlm.models import qwen3_vl_moe

    mx.random.seed(SEED)
    model = qwen3_vl_moe.Model(qwen3_vl_moe.ModelConfig.from_dict(dict(config)))
    weights = dict(tree_flatten(model.parameters()))
    return {name: value.astype(getattr(mx, DTYPE)) for name, value in weights.items()}
