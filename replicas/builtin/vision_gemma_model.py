"""`builtin:vision-gemma3`: a tiny vision-language model laid out as Gemma 3 (`gemma3`: a
SigLIP vision tower, an average-pooling projector, a Gemma 3 text model with sliding and
global attention layers), for tests and benchmarks of Gemma's bidirectional attention over
an image's tokens (`replicas.engine.model.bidirectional`).

Random weights made by mlx-vlm's own `gemma3` classes, the built-in tokenizer with Gemma 3's
three image tokens added (named in `extra_special_tokens`, as Gemma's tokenizer names them
for the processor), and the built-in chat template rendering an image part as
`<start_of_image>`, which the processor expands into `\\n\\n<start_of_image>`, 16 image
tokens and `<end_of_image>\\n\\n`. `preprocessor_config.json` is what transformers'
`Gemma3ImageProcessor` reads, so mlx-vlm loads the directory as it loads the real
checkpoint. As with `builtin:vision`, the text means nothing but depends on the image.
"""

from __future__ import annotations

import json
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

log = logging.getLogger(__name__)

NAME = "vision-gemma3"
BOI, EOI, IMAGE_TOKEN = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
IMAGE_SIZE, PATCH_SIZE = 64, 8  # 8 x 8 patches, pooled 2 x 2: 16 tokens an image
TOKENS_PER_IMAGE = 16
ARCH = MISTRAL_TEXT.architecture  # 128 wide, 4 heads of 32, 2 KV heads
TEXT: dict[str, Any] = {
    "model_type": "gemma3_text", "hidden_size": ARCH.hidden_size, "num_hidden_layers": 2,
    "intermediate_size": ARCH.intermediate_size, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "query_pre_attn_scalar": 32,
    "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_global_base_freq": 1_000_000.0,
    "rope_local_base_freq": 10_000.0, "rope_scaling": None,
    # Layer 0 slides (a RotatingKVCache), layer 1 attends globally, as Gemma 3's 5:1.
    "sliding_window": 512, "sliding_window_pattern": 2,
    "max_position_embeddings": 8192, "mm_tokens_per_image": TOKENS_PER_IMAGE,
}
VISION: dict[str, Any] = {
    "model_type": "siglip_vision_model", "hidden_size": 64, "num_hidden_layers": 1,
    "intermediate_size": 128, "num_attention_heads": 2, "patch_size": PATCH_SIZE,
    "image_size": IMAGE_SIZE, "num_channels": 3, "layer_norm_eps": 1e-6,
}
SEED = 20251206
DTYPE = "float32"


def ensure_vision_gemma_model(cache_dir: Path | None = None) -> Path:
    """The cached directory of `builtin:vision-gemma3`, built first if missing (seconds)."""
    return ensure_scripted(
        NAME, replace(MISTRAL_TEXT, name=NAME),
        repr(sorted(TEXT.items())) + repr(sorted(VISION.items())) + chat_template(BOI),
        build_vision_gemma_model, cache_dir)


def build_vision_gemma_model(out_dir: Path, scripts: str, key: str) -> None:
    tokenizer = train_tokenizer(training_texts(parse_scripts(scripts)), 1024, 2,
                                special=(*SPECIAL_TOKENS, BOI, EOI, IMAGE_TOKEN))
    eos = write_tokenizer_files(tokenizer, out_dir, TEXT["max_position_embeddings"])
    _tokenizer_config(out_dir, tokenizer)
    pad = token_id(tokenizer, PAD_TOKEN)
    vocab = tokenizer.get_vocab_size()
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {**TEXT, "vocab_size": vocab}, "vision_config": VISION,
        "vocab_size": vocab, "hidden_size": TEXT["hidden_size"], "pad_token_id": pad,
        "image_token_index": token_id(tokenizer, IMAGE_TOKEN),
        "boi_token_index": token_id(tokenizer, BOI),
        "eoi_token_index": token_id(tokenizer, EOI),
        "mm_tokens_per_image": TOKENS_PER_IMAGE,
        "eos_token_id": [eos], "torch_dtype": DTYPE,
    }
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json",
               {"bos_token_id": pad, "eos_token_id": [eos], "pad_token_id": pad})
    write_json(out_dir / "preprocessor_config.json", {
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "do_resize": True,
        "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True, "do_pan_and_scan": False})
    write_json(out_dir / "processor_config.json",
               {"processor_class": "Gemma3Processor", "image_seq_length": TOKENS_PER_IMAGE})
    weights = _random_weights(config)
    parameters = save_random_model(out_dir, weights, name=NAME, key=key, seed=SEED)
    log.info("built builtin:%s (%d parameters)", NAME, parameters)


def _tokenizer_config(out_dir: Path, tokenizer: Any) -> None:
    """The built-in tokenizer config, with Gemma's image tokens (named for the processor)
    and the template that writes them."""
    path = out_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = chat_template(BOI)
    config["extra_special_tokens"] = {"boi_token": BOI, "eoi_token": EOI,
                                      "image_token": IMAGE_TOKEN}
    for token in (BOI, EOI, IMAGE_TOKEN):
        config["added_tokens_decoder"][str(token_id(tokenizer, token))] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}
    write_json(path, config)


def _random_weights(config: dict[str, Any]) -> dict[str, mx.array]:
    """mlx-vlm's own `gemma3` model with its initial (random) weights, under the names
    mlx-vlm saves. No output head, as Gemma 3's checkpoints have none: both libraries tie
    it to the token embeddings. Two changes so that the answer depends on what comes
    before it: the embeddings shrink to rows of length about 1 (Gemma multiplies them by
    sqrt(hidden size), and at mlx's init the input token would drown out the attention and
    MLP, which each add an RMS of 2 after their norms), and the projector's weight, ones
    at init (every image feature the same direction), is drawn at random."""
    from mlx_vlm.models import gemma3

    mx.random.seed(SEED)
    model_config = gemma3.ModelConfig.from_dict(config)
    model_config.text_config = gemma3.TextConfig.from_dict(config["text_config"])
    model_config.vision_config = gemma3.VisionConfig.from_dict(config["vision_config"])
    model = gemma3.Model(model_config)
    weights = dict(tree_flatten(model.parameters()))
    del weights["language_model.lm_head.weight"]
    embed = "language_model.model.embed_tokens.weight"
    weights[embed] = weights[embed] / TEXT["hidden_size"] ** 0.5
    projection = "multi_modal_projector.mm_input_projection_weight"
    weights[projection] = mx.random.normal(weights[projection].shape) \
        / VISION["hidden_size"] ** 0.5
    return {name: value.astype(getattr(mx, DTYPE)) for name, value in weights.items()}
