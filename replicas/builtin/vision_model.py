"""`builtin:vision`: a tiny vision-language model laid out as Mistral Small 3.x is
(`mistral3`: a Pixtral vision tower, a patch-merging projector, a Mistral text model), for
tests and benchmarks of images in every API.

Random weights, the built-in tokenizer with Pixtral's three image tokens added, and the
built-in chat template rendering an image part as `[IMG]`; `preprocessor_config.json` and
`processor_config.json` are what Pixtral's processor reads, so mlx-vlm loads the directory
as it loads the real checkpoint, and Orchard finds the model kind from its files
(`replicas.vision`). The text means nothing, but the image changes it: two different images
give two different greedy answers, which is what the tests check. Nothing here is trained.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx

from .build import ensure_scripted, save_random_model, vlm_initial_weights
from .chat_template import chat_template
from .recipe import Architecture, RandomInit, Recipe
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

log = logging.getLogger(__name__)

NAME = "vision"
IMAGE_TOKEN, IMAGE_BREAK, IMAGE_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
PATCH_SIZE = 8
SPATIAL_MERGE = 2
LONGEST_EDGE = 64  # pixels: at most (64 / 8 / 2)^2 = 16 image tokens, plus breaks
TEXT = Recipe(
    name=NAME,
    architecture=Architecture(
        hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=8192,
        tie_word_embeddings=False, model_type="qwen3",  # `model_type` is rewritten below
    ),
    weights=RandomInit(logit_std=5.0),
    seed=20251125,
)
VISION: dict[str, Any] = {
    "model_type": "pixtral", "hidden_size": 64, "num_hidden_layers": 1,
    "intermediate_size": 128, "num_attention_heads": 2, "head_dim": 32,
    "image_size": LONGEST_EDGE, "patch_size": PATCH_SIZE, "num_channels": 3,
    "rope_theta": 10000.0, "hidden_act": "silu",
}
_IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]  # CLIP's, as Pixtral's processor has
_IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]


def ensure_vision_model(cache_dir: Path | None = None) -> Path:
    """The cached directory of `builtin:vision`, built first if missing (a few seconds)."""
    return ensure_scripted(NAME, TEXT, repr(sorted(VISION.items())) + chat_template(IMAGE_TOKEN),
                           build_vision_model, cache_dir)


def build_vision_model(out_dir: Path, scripts: str, key: str) -> None:
    arch = TEXT.architecture
    tokenizer = train_tokenizer(training_texts(parse_scripts(scripts)), 1024, 2,
                                special=(*SPECIAL_TOKENS, IMAGE_TOKEN, IMAGE_BREAK, IMAGE_END))
    eos = write_tokenizer_files(tokenizer, out_dir, arch.max_position_embeddings)
    _vision_tokenizer_config(out_dir, tokenizer)
    pad = token_id(tokenizer, PAD_TOKEN)
    text = arch.config(tokenizer.get_vocab_size(), eos, pad, TEXT.dtype)
    text.update(model_type="mistral", architectures=["MistralForCausalLM"])
    config = {
        "architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
        "text_config": text, "vision_config": VISION,
        "image_token_index": token_id(tokenizer, IMAGE_TOKEN),
        "spatial_merge_size": SPATIAL_MERGE, "vision_feature_layer": -1,
        "multimodal_projector_bias": False, "projector_hidden_act": "gelu",
        "eos_token_id": [eos], "torch_dtype": TEXT.dtype,
    }
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json",
               {"bos_token_id": pad, "eos_token_id": [eos], "pad_token_id": pad})
    write_json(out_dir / "preprocessor_config.json", {
        "image_processor_type": "PixtralImageProcessor", "patch_size": PATCH_SIZE,
        "size": {"longest_edge": LONGEST_EDGE}, "do_resize": True, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": _IMAGE_MEAN,
        "image_std": _IMAGE_STD, "do_convert_rgb": True, "resample": 3})
    write_json(out_dir / "processor_config.json", {
        "processor_class": "PixtralProcessor", "patch_size": PATCH_SIZE,
        "spatial_merge_size": SPATIAL_MERGE, "image_token": IMAGE_TOKEN,
        "image_break_token": IMAGE_BREAK, "image_end_token": IMAGE_END})
    weights = _random_weights(config)
    parameters = save_random_model(out_dir, weights, name=NAME, key=key, seed=TEXT.seed)
    log.info("built builtin:%s (%d parameters)", NAME, parameters)


def _vision_tokenizer_config(out_dir: Path, tokenizer: Any) -> None:
    """The built-in tokenizer config, with the image tokens and the template that writes
    them."""
    path = out_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = chat_template(IMAGE_TOKEN)
    for token in (IMAGE_TOKEN, IMAGE_BREAK, IMAGE_END):
        config["added_tokens_decoder"][str(token_id(tokenizer, token))] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}
    write_json(path, config)


def _random_weights(config: dict[str, Any]) -> dict[str, mx.array]:
    """mlx-vlm's own `mistral3` model with its initial (random) weights, under the names
    mlx-vlm saves; scaled so the image moves the answer (see the module's docstring)."""
    weights = vlm_initial_weights("mistral3", config, TEXT.seed)
    return {name: value.astype(getattr(mx, TEXT.dtype)) for name, value in weights.items()}
