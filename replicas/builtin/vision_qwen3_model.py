"""`builtin:vision-qwen3`: a tiny vision-language model laid out as Qwen3-VL (`qwen3_vl`,
dense), for tests and benchmarks of its two differences from Qwen2.5-VL: interleaved
M-RoPE sections (`replicas.engine.model.mrope`) and DeepStack, features of earlier vision
blocks added to the hidden states at the image positions after the first decoder layers
(`replicas.engine.model.deepstack`).

Random weights made by mlx-vlm's own `qwen3_vl` classes; Qwen3-VL's nested config (a
`text_config` mlx-lm's `qwen3_vl` reads as a Qwen3 text model, a `vision_config` with
`deepstack_visual_indexes`), the built-in tokenizer with the vision tokens and template of
`builtin:vision-qwen` (vision_qwen_model.py), and a `preprocessor_config.json` that
mlx-vlm's `Qwen3VLProcessor` reads. Three text layers and two DeepStack levels, so both
levels reach a later layer's keys and values (an addition after the last layer would
change no answer).
"""

from __future__ import annotations

import copy
import importlib
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from .build import ensure_scripted, save_random_model
from .chat_template import chat_template
from .scripts import parse_scripts
from .tokenizer_files import (
    PAD_TOKEN,
    SPECIAL_TOKENS,
    token_id,
    train_tokenizer,
    training_texts,
    write_json,
    write_tokenizer_files,
)
from .vision_model import TEXT as MISTRAL_TEXT
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

NAME = "vision-qwen3"
RECIPE = replace(MISTRAL_TEXT, name=NAME, architecture=replace(
    MISTRAL_TEXT.architecture, num_hidden_layers=3))
TEXT = RECIPE.architecture  # 128 wide, 3 layers, 4 heads of 32 (q/k norms), 2 KV heads
# Two vision blocks, each one's features a DeepStack level (added after text layers 0, 1).
VISION: dict[str, Any] = {
    "model_type": "qwen3_vl", "depth": 2, "hidden_size": 64, "intermediate_size": 128,
    "out_hidden_size": TEXT.hidden_size, "num_heads": 2, "in_channels": 3,
    "patch_size": PATCH_SIZE, "spatial_merge_size": MERGE_SIZE,
    "temporal_patch_size": TEMPORAL_PATCH, "num_position_embeddings": 64,
    "deepstack_visual_indexes": [0, 1], "hidden_act": "gelu_pytorch_tanh",
}
SEED = 20251206
DTYPE = "float32"


def ensure_vision_qwen3_model(cache_dir: Path | None = None) -> Path:
    """The cached directory of `builtin:vision-qwen3`, built first if missing (seconds)."""
    return ensure_scripted(
        NAME, RECIPE, repr(sorted(VISION.items())) + repr(MROPE_SECTION)
        + chat_template(IMAGE_PART), build_vision_qwen3_model, cache_dir)


def build_vision_qwen3_model(out_dir: Path, scripts: str, key: str) -> None:
    build_qwen3_vl_layout(
        out_dir, scripts, key, name=NAME, seed=SEED, model_type="qwen3_vl",
        architecture="Qwen3VLForConditionalGeneration",
        text={"model_type": "qwen3_vl_text", "rope_theta": 5000000.0,
              "rope_scaling": {"rope_type": "default", "mrope_section": MROPE_SECTION,
                               "mrope_interleaved": True}},
        drop=("architectures",), vision=VISION, tied=TEXT.tie_word_embeddings)


def build_qwen3_vl_layout(out_dir: Path, scripts: str, key: str, *, name: str, seed: int,
                          model_type: str, architecture: str, text: dict[str, Any],
                          drop: tuple[str, ...], vision: dict[str, Any], tied: bool) -> None:
    """One checkpoint of the Qwen3-VL family (Qwen3-VL, its MoE, Qwen3.5): the built-in
    tokenizer with `builtin:vision-qwen`'s vision tokens, `TEXT`'s config with `text` over it
    and `drop` taken out, the `vision` tower, Qwen3-VL's processor, and the random weights
    of mlx-vlm's own `model_type` classes."""
    vision_tokens = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
    tokenizer = train_tokenizer(training_texts(parse_scripts(scripts)), 1024, 2,
                                special=(*SPECIAL_TOKENS, *vision_tokens))
    eos = write_tokenizer_files(tokenizer, out_dir, TEXT.max_position_embeddings)
    _tokenizer_config(out_dir, tokenizer, vision_tokens)
    pad = token_id(tokenizer, PAD_TOKEN)
    text_config = TEXT.config(tokenizer.get_vocab_size(), eos, pad, DTYPE)
    text_config.update(copy.deepcopy(text))  # mlx-vlm's config renames keys in place
    for derived in drop:
        text_config.pop(derived)
    config = {
        "architectures": [architecture], "model_type": model_type,
        "text_config": text_config, "vision_config": vision,
        "image_token_id": token_id(tokenizer, IMAGE_PAD),
        "video_token_id": token_id(tokenizer, VIDEO_PAD),
        "vision_start_token_id": token_id(tokenizer, VISION_START),
        "vision_end_token_id": token_id(tokenizer, VISION_END),
        "tie_word_embeddings": tied, "eos_token_id": [eos], "torch_dtype": DTYPE,
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
    weights = _random_weights(config, seed)
    parameters = save_random_model(out_dir, weights, name=name, key=key, seed=seed)
    log.info("built builtin:%s (%d parameters)", name, parameters)


def _random_weights(config: dict[str, Any], seed: int) -> dict[str, mx.array]:
    """mlx-vlm's own model of `config`'s type with its initial (random) weights, under the
    names mlx-vlm saves."""
    module = importlib.import_module(f"mlx_vlm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelConfig.from_dict(dict(config)))
    weights = dict(tree_flatten(model.parameters()))
    return {name: value.astype(getattr(mx, DTYPE)) for name, value in weights.items()}
