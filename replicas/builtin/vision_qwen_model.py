"""`builtin:vision-qwen` and `builtin:vision-qwen25`: tiny vision-language models laid out
as Qwen2-VL (`qwen2_vl`) and Qwen2.5-VL (`qwen2_5_vl`: its windowed vision tower), each a
vision tower and patch merger before a Qwen2 text model with multimodal rotary positions,
for tests and benchmarks of M-RoPE families (`replicas.engine.model.mrope`).

Random weights made by mlx-vlm's own `qwen2_vl` / `qwen2_5_vl` classes, the built-in tokenizer with
Qwen2-VL's vision tokens added, and the built-in chat template rendering an image part as
`<|vision_start|><|image_pad|><|vision_end|>`; `preprocessor_config.json` is what
transformers' `Qwen2VLImageProcessor` reads, so mlx-vlm loads the directory as it loads the
real checkpoint. As with `builtin:vision`, the text means nothing but depends on the image.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from .build import ensure_scripted, save_random_model, vlm_initial_weights
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

log = logging.getLogger(__name__)

NAME = "vision-qwen"
NAME_25 = "vision-qwen25"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
IMAGE_PART = VISION_START + IMAGE_PAD + VISION_END  # how the template writes an image
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH = 8, 2, 2
# Pixels: an image is resized to multiples of 16 within these, so at most 16 tokens.
MIN_PIXELS, MAX_PIXELS = 16 * 16, 64 * 64
TEXT = MISTRAL_TEXT.architecture  # 128 wide, 2 layers, 4 heads of 32, 2 KV heads
# Each rotary frequency pair's axis (temporal, height, width): head_dim / 2 = 16 pairs.
MROPE_SECTION = [4, 6, 6]
VISION: dict[str, Any] = {
    "model_type": "qwen2_vl", "depth": 1, "embed_dim": 64, "hidden_size": TEXT.hidden_size,
    "num_heads": 2, "mlp_ratio": 2, "in_channels": 3, "patch_size": PATCH_SIZE,
    "spatial_patch_size": PATCH_SIZE, "spatial_merge_size": MERGE_SIZE,
    "temporal_patch_size": TEMPORAL_PATCH,
}
# Qwen2.5-VL's tower: windows of 32 pixels (2 x 2 merged tokens), its 2nd block attending
# over the whole image.
VISION_25: dict[str, Any] = {
    "model_type": "qwen2_5_vl", "depth": 2, "hidden_size": 64, "intermediate_size": 128,
    "out_hidden_size": TEXT.hidden_size, "num_heads": 2, "in_channels": 3,
    "patch_size": PATCH_SIZE, "spatial_patch_size": PATCH_SIZE,
    "spatial_merge_size": MERGE_SIZE, "temporal_patch_size": TEMPORAL_PATCH,
    "window_size": 32, "fullatt_block_indexes": [1], "tokens_per_second": 2,
}
# name: (model_type, vision config, architecture, processor)
VARIANTS: dict[str, tuple[str, dict[str, Any], str, str]] = {
    NAME: ("qwen2_vl", VISION, "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor"),
    NAME_25: ("qwen2_5_vl", VISION_25, "Qwen2_5_VLForConditionalGeneration",
              "Qwen2_5_VLProcessor"),
}
SEED = 20251205
DTYPE = "float32"
_IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]  # Qwen2-VL's (CLIP's)
_IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]


def ensure_vision_qwen_model(name: str = NAME, cache_dir: Path | None = None) -> Path:
    """The cached directory of `builtin:<name>` (a `VARIANTS` name), built first if missing
    (seconds)."""
    return ensure_scripted(
        name, replace(MISTRAL_TEXT, name=name),
        repr(VARIANTS[name]) + repr(MROPE_SECTION) + chat_template(IMAGE_PART),
        lambda tmp, text, key: build_vision_qwen_model(tmp, text, key, name), cache_dir)


def build_vision_qwen_model(out_dir: Path, scripts: str, key: str, name: str = NAME) -> None:
    model_type, vision, architecture, processor = VARIANTS[name]
    vision_tokens = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
    tokenizer = train_tokenizer(training_texts(parse_scripts(scripts)), 1024, 2,
                                special=(*SPECIAL_TOKENS, *vision_tokens))
    eos = write_tokenizer_files(tokenizer, out_dir, TEXT.max_position_embeddings)
    _tokenizer_config(out_dir, tokenizer, vision_tokens)
    pad = token_id(tokenizer, PAD_TOKEN)
    # Qwen2-VL's config is flat: the text model's fields at the top, the tower's nested.
    config = TEXT.config(tokenizer.get_vocab_size(), eos, pad, DTYPE)
    config.pop("head_dim", None)  # Qwen2's is hidden_size / heads (32 here too)
    config.update({
        "architectures": [architecture], "model_type": model_type,
        "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope",
                                                  "mrope_section": MROPE_SECTION},
        "vision_config": vision,
        "image_token_id": token_id(tokenizer, IMAGE_PAD),
        "video_token_id": token_id(tokenizer, VIDEO_PAD),
        "vision_start_token_id": token_id(tokenizer, VISION_START),
        "vision_end_token_id": token_id(tokenizer, VISION_END),
        "eos_token_id": [eos], "torch_dtype": DTYPE,
    })
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json",
               {"bos_token_id": pad, "eos_token_id": [eos], "pad_token_id": pad})
    write_json(out_dir / "preprocessor_config.json", {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": processor,
        "patch_size": PATCH_SIZE, "temporal_patch_size": TEMPORAL_PATCH,
        "merge_size": MERGE_SIZE, "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS,
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": _IMAGE_MEAN, "image_std": _IMAGE_STD,
        "do_convert_rgb": True, "resample": 3})
    weights = _random_weights(config)
    parameters = save_random_model(out_dir, weights, name=name, key=key, seed=SEED)
    log.info("built builtin:%s (%d parameters)", name, parameters)


def _tokenizer_config(out_dir: Path, tokenizer: Any, tokens: tuple[str, ...]) -> None:
    """The built-in tokenizer config, with the vision tokens and the template that writes
    them."""
    path = out_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = chat_template(IMAGE_PART)
    for token in tokens:
        config["added_tokens_decoder"][str(token_id(tokenizer, token))] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}
    write_json(path, config)


def _random_weights(config: dict[str, Any]) -> dict[str, mx.array]:
    """mlx-vlm's own model of the config's type with its initial (random) weights, under
    the names mlx-vlm saves."""
    weights = vlm_initial_weights(config["model_type"], config, SEED)
    return {name: value.astype(getattr(mx, DTYPE)) for name, value in weights.items()}
