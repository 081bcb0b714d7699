"""`builtin:vision-lfm2`: a tiny vision-language model laid out as LFM2-VL (`lfm2-vl`: a
SigLIP2 NaFlex vision tower, a pixel-unshuffle and MLP projector, an LFM2 language model,
a hybrid of gated short convolutions and attention layers), for tests of a family whose
language model keeps a convolution state beside its KV cache and whose image prefix is
plain 1-D positions.

Random weights made by mlx-vlm's own `lfm2_vl` classes; the built-in tokenizer with
LFM2-VL's image tokens (`<image>`, `<|image_start|>`, `<|image_end|>`,
`<|img_thumbnail|>`) and the built-in chat template rendering an image part as `<image>`,
which mlx-vlm's `Lfm2VlProcessor` expands into `<|image_start|>`, one `<image>` per
merged 2x2 patch and `<|image_end|>`. 8-pixel patches and a 16-token budget: a 64x64
image is 16 tokens, a 64x48 one 12 (smart-resized, never tiled at these sizes).
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

NAME = "vision-lfm2"
IMAGE, IMAGE_START, IMAGE_END = "<image>", "<|image_start|>", "<|image_end|>"
THUMBNAIL = "<|img_thumbnail|>"
PATCH_SIZE, MAX_IMAGE_TOKENS, MIN_IMAGE_TOKENS = 8, 16, 4
ARCH = MISTRAL_TEXT.architecture  # 128 wide, 4 heads of 32, 2 KV heads
# Conv, attention, conv: the attention layer sees the image; the conv after it carries it
# on through its state.
TEXT: dict[str, Any] = {
    "model_type": "lfm2", "hidden_size": ARCH.hidden_size, "num_hidden_layers": 3,
    "intermediate_size": ARCH.intermediate_size, "block_ff_dim": ARCH.intermediate_size,
    "block_auto_adjust_ff_dim": False, "block_multiple_of": 64,
    "block_ffn_dim_multiplier": 1.0, "block_dim": ARCH.hidden_size,
    "num_attention_heads": 4, "num_heads": 4, "num_key_value_heads": 2,
    "conv_L_cache": 3, "conv_bias": False, "conv_dim": ARCH.hidden_size,
    "conv_dim_out": ARCH.hidden_size, "norm_eps": 1e-5, "rope_theta": 1_000_000.0,
    "max_position_embeddings": 8192, "tie_word_embeddings": True,
    "layer_types": ["conv", "full_attention", "conv"],
}
VISION: dict[str, Any] = {
    "model_type": "lfm2_vl", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_channels": 3,
    "patch_size": PATCH_SIZE, "num_patches": 64, "layer_norm_eps": 1e-6,
    "vision_use_head": False,
}
SEED = 20251206
DTYPE = "float32"


def ensure_vision_lfm2_model(cache_dir: Path | None = None) -> Path:
    """The cached directory of `builtin:vision-lfm2`, built first if missing (seconds)."""
    return ensure_scripted(
        NAME, replace(MISTRAL_TEXT, name=NAME),
        repr(sorted(TEXT.items())) + repr(sorted(VISION.items())) + chat_template(IMAGE),
        build_vision_lfm2_model, cache_dir)


def build_vision_lfm2_model(out_dir: Path, scripts: str, key: str) -> None:
    images = (IMAGE, IMAGE_START, IMAGE_END, THUMBNAIL)
    tokenizer = train_tokenizer(training_texts(parse_scripts(scripts)), 1024, 2,
                                special=(*SPECIAL_TOKENS, *images))
    eos = write_tokenizer_files(tokenizer, out_dir, TEXT["max_position_embeddings"])
    _tokenizer_config(out_dir, tokenizer, images)
    pad = token_id(tokenizer, PAD_TOKEN)
    vocab = tokenizer.get_vocab_size()
    config = {
        "architectures": ["Lfm2VlForConditionalGeneration"], "model_type": "lfm2-vl",
        "text_config": {**TEXT, "vocab_size": vocab, "eos_token_id": eos},
        "vision_config": VISION, "vocab_size": vocab,
        "image_token_id": token_id(tokenizer, IMAGE),
        "image_start_token_id": token_id(tokenizer, IMAGE_START),
        "image_end_token_id": token_id(tokenizer, IMAGE_END),
        "downsample_factor": 2, "encoder_patch_size": PATCH_SIZE,
        "projector_hidden_size": 128, "projector_hidden_act": "gelu",
        "projector_bias": True, "projector_use_layernorm": True,
        "vision_feature_layer": -1, "max_image_tokens": MAX_IMAGE_TOKENS,
        "min_image_tokens": MIN_IMAGE_TOKENS, "tile_size": 64,
        "max_num_patches": 64, "do_image_splitting": True, "use_thumbnail": True,
        "use_image_special_tokens": True, "tie_word_embeddings": True,
        "eos_token_id": eos, "pad_token_id": pad, "torch_dtype": DTYPE,
    }
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json",
               {"bos_token_id": pad, "eos_token_id": [eos], "pad_token_id": pad})
    write_json(out_dir / "preprocessor_config.json", {
        "image_processor_type": "Lfm2VlImageProcessorFast",
        "processor_class": "Lfm2VlProcessor", "downsample_factor": 2,
        "encoder_patch_size": PATCH_SIZE, "max_image_tokens": MAX_IMAGE_TOKENS,
        "min_image_tokens": MIN_IMAGE_TOKENS, "tile_size": 64, "max_num_patches": 64,
        "max_pixels_tolerance": 2.0, "do_resize": True, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "do_pad": True, "resample": 3})
    write_json(out_dir / "processor_config.json",
               {"processor_class": "Lfm2VlProcessor", "use_image_special_tokens": True})
    weights = _random_weights(config)
    parameters = save_random_model(out_dir, weights, name=NAME, key=key, seed=SEED)
    log.info("built builtin:%s (%d parameters)", NAME, parameters)


def _tokenizer_config(out_dir: Path, tokenizer: Any, images: tuple[str, ...]) -> None:
    """The built-in tokenizer config, with LFM2-VL's image tokens and the template that
    writes `<image>` for an image part."""
    path = out_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = chat_template(IMAGE)
    for token in images:
        config["added_tokens_decoder"][str(token_id(tokenizer, token))] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}
    write_json(path, config)


def _random_weights(config: dict[str, Any]) -> dict[str, mx.array]:
    """mlx-vlm's own `lfm2_vl` model with its initial (random) weights, under the names
    mlx-vlm saves (no output head: both libraries tie it to the token embeddings). The
    layers' output projections and the projector's last linear are scaled by 4: at mlx's
    init each layer adds little to the residual stream, the answers settle on one token
    whatever came before, and two images of different colours answer alike."""
    weights = vlm_initial_weights("lfm2_vl", config, SEED)
    weights.pop("language_model.lm_head.weight", None)
    for name in weights:
        projector = name.startswith("multi_modal_projector.linear_2.")
        layer_out = name.startswith("language_model.") and name.endswith(
            (".out_proj.weight", ".feed_forward.w2.weight"))
        if projector or layer_out:
            weights[name] = weights[name] * 4
    return {name: value.astype(getattr(mx, DTYPE)) for name, value in weights.items()}
