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

`builtin:vision-gemma4` is the same built by mlx-vlm's `gemma4` classes (`GEMMA4_TEXT`,
`GEMMA4_VISION`): Gemma 4's vision tower (2-D rotary patches, pooled 2 x 2) and embedder,
and a Gemma 4 text model with a sliding and two global layers, the last sharing the KV of
the one before it, per-layer inputs (as Gemma 4's E2B and E4B have both) and images
attending both ways (`use_bidirectional_attention: "vision"`). Its template writes the
image token `<|image|>`, which the processor expands into `<|image>`, as many soft tokens
as the image's size gives (at most 16) and `<image|>`. One builder makes both (`Layout`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

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
GEMMA4_TEXT: dict[str, Any] = {
    "model_type": "gemma4_text", "hidden_size": ARCH.hidden_size, "num_hidden_layers": 3,
    "intermediate_size": ARCH.intermediate_size, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "global_head_dim": 32,
    # As Gemma 4's E2B and E4B: per-layer inputs, and the last layer reading the KV of the
    # last one of its kind before it (no cache of its own).
    "num_kv_shared_layers": 1, "hidden_size_per_layer_input": 16,
    "rms_norm_eps": 1e-6, "sliding_window": 512,
    "layer_types": ["sliding_attention", "full_attention", "full_attention"],
    # Gemma 4's (spelled out: mlx-lm's and mlx-vlm's defaults differ).
    "rope_parameters": {
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0,
                           "rope_type": "proportional"},
        "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 10_000.0,
                              "rope_type": "default"}},
    "max_position_embeddings": 8192, "use_double_wide_mlp": False,
    "final_logit_softcapping": 30.0, "use_bidirectional_attention": "vision",
    "tie_word_embeddings": True,
}
GEMMA4_VISION: dict[str, Any] = {
    "model_type": "gemma4_vision", "hidden_size": 64, "num_hidden_layers": 1,
    "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
    "head_dim": 32, "global_head_dim": 32, "patch_size": PATCH_SIZE,
    "pooling_kernel_size": 2, "default_output_length": TOKENS_PER_IMAGE,
    "position_embedding_size": 64, "rms_norm_eps": 1e-6,
}


@dataclass(frozen=True)
class Layout:
    """What one Gemma generation's built-in takes: its image tokens (the one its template
    writes first), its config.json, processor files and random weights."""

    name: str
    boi: str
    eoi: str
    image_token: str
    placeholder: str  # what the chat template writes per image
    text: dict[str, Any]
    vision: dict[str, Any]
    config: Callable[[Any, int, int], dict[str, Any]]  # (tokenizer, pad, eos)
    processor_files: Callable[[], dict[str, dict[str, Any]]]
    weights: Callable[[dict[str, Any]], dict[str, mx.array]]
    # Further tokens the processor names (`extra_special_tokens` name: token).
    more_tokens: tuple[tuple[str, str], ...] = ()


def ensure_vision_gemma_model(name: str = NAME, cache_dir: Path | None = None) -> Path:
    """The cached directory of `builtin:<name>` (a `LAYOUTS` name), built first if missing
    (seconds)."""
    layout = LAYOUTS[name]
    salt = repr(sorted(layout.text.items())) + repr(sorted(layout.vision.items())) \
        + chat_template(layout.placeholder)
    return ensure_scripted(name, replace(MISTRAL_TEXT, name=name), salt,
                           lambda out, scripts, key: build_vision_gemma_model(
                               out, scripts, key, layout), cache_dir)


def build_vision_gemma_model(out_dir: Path, scripts: str, key: str,
                             layout: Layout | None = None) -> None:
    layout = layout or LAYOUTS[NAME]
    tokens = (layout.boi, layout.eoi, layout.image_token, *(t for _, t in layout.more_tokens))
    tokenizer = train_tokenizer(training_texts(parse_scripts(scripts)), 1024, 2,
                                special=(*SPECIAL_TOKENS, *tokens))
    eos = write_tokenizer_files(tokenizer, out_dir, layout.text["max_position_embeddings"])
    _tokenizer_config(out_dir, tokenizer, layout)
    pad = token_id(tokenizer, PAD_TOKEN)
    config = layout.config(tokenizer, pad, eos)
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json",
               {"bos_token_id": pad, "eos_token_id": [eos], "pad_token_id": pad})
    for file, content in layout.processor_files().items():
        write_json(out_dir / file, content)
    weights = layout.weights(config)
    parameters = save_random_model(out_dir, weights, name=layout.name, key=key, seed=SEED)
    log.info("built builtin:%s (%d parameters)", layout.name, parameters)


def _gemma3_config(tokenizer: Any, pad: int, eos: int) -> dict[str, Any]:
    vocab = tokenizer.get_vocab_size()
    return {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {**TEXT, "vocab_size": vocab}, "vision_config": VISION,
        "vocab_size": vocab, "hidden_size": TEXT["hidden_size"], "pad_token_id": pad,
        "image_token_index": token_id(tokenizer, IMAGE_TOKEN),
        "boi_token_index": token_id(tokenizer, BOI),
        "eoi_token_index": token_id(tokenizer, EOI),
        "mm_tokens_per_image": TOKENS_PER_IMAGE,
        "eos_token_id": [eos], "torch_dtype": DTYPE,
    }


def _gemma3_processor_files() -> dict[str, dict[str, Any]]:
    return {"preprocessor_config.json": {
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "do_resize": True,
        "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True, "do_pan_and_scan": False},
        "processor_config.json": {"processor_class": "Gemma3Processor",
                                  "image_seq_length": TOKENS_PER_IMAGE}}


def _gemma4_config(tokenizer: Any, pad: int, eos: int) -> dict[str, Any]:
    vocab = tokenizer.get_vocab_size()
    text = {**GEMMA4_TEXT, "vocab_size": vocab, "vocab_size_per_layer_input": vocab,
            "pad_token_id": pad}
    return {
        "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
        "text_config": text, "vision_config": GEMMA4_VISION, "audio_config": None,
        "vocab_size": vocab, "hidden_size": text["hidden_size"], "pad_token_id": pad,
        "image_token_id": token_id(tokenizer, G4_IMAGE_TOKEN),
        "boi_token_id": token_id(tokenizer, G4_BOI),
        "eoi_token_id": token_id(tokenizer, G4_EOI),
        # Gemma 4's processor adds its video token to a vocabulary without one: here it is.
        "video_token_id": token_id(tokenizer, G4_VIDEO_TOKEN),
        # No audio or video tokens in this vocabulary: ids no prompt holds.
        "audio_token_id": vocab + 1, "boa_token_id": vocab + 2, "eoa_token_id": vocab + 3,
        "vision_soft_tokens_per_image": TOKENS_PER_IMAGE,
        "eos_token_id": [eos], "torch_dtype": DTYPE, "tie_word_embeddings": True,
    }


def _gemma4_processor_files() -> dict[str, dict[str, Any]]:
    # mlx-vlm's Gemma4Processor reads the image processor's settings from here: images
    # resized, keeping their aspect, to at most 16 soft tokens of 2 x 2 patches of 8 pixels.
    return {"processor_config.json": {
        "processor_class": "Gemma4Processor",
        "image_processor": {"image_processor_type": "Gemma4ImageProcessor",
                            "patch_size": PATCH_SIZE, "max_soft_tokens": TOKENS_PER_IMAGE,
                            "pooling_kernel_size": 2, "do_resize": True, "do_rescale": True,
                            "rescale_factor": 1 / 255, "do_normalize": False}}}


def _tokenizer_config(out_dir: Path, tokenizer: Any, layout: Layout) -> None:
    """The built-in tokenizer config, with Gemma's image tokens (named for the processor)
    and the template that writes them."""
    path = out_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = chat_template(layout.placeholder)
    config["extra_special_tokens"] = {"boi_token": layout.boi, "eoi_token": layout.eoi,
                                      "image_token": layout.image_token,
                                      **dict(layout.more_tokens)}
    for token in (layout.boi, layout.eoi, layout.image_token,
                  *(t for _, t in layout.more_tokens)):
        config["added_tokens_decoder"][str(token_id(tokenizer, token))] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}
    write_json(path, config)


def _gemma3_weights(config: dict[str, Any]) -> dict[str, mx.array]:
    """mlx-vlm's own `gemma3` model with its initial (random) weights, under the names
    mlx-vlm saves. No output head, as Gemma 3's checkpoints have none: both libraries tie
    it to the token embeddings. Two changes so that the answer depends on what comes
    before it: the embeddings shrink to rows of length about 1 (Gemma multiplies them by
    sqrt(hidden size), and at mlx's init the input token would drown out the attention and
    MLP, which each add an RMS of 2 after their norms), and the projector's weight, ones
    at init (every image feature the same direction), is drawn at random."""
    weights = vlm_initial_weights("gemma3", config, SEED)
    del weights["language_model.lm_head.weight"]
    embed = "language_model.model.embed_tokens.weight"
    weights[embed] = weights[embed] / TEXT["hidden_size"] ** 0.5
    projection = "multi_modal_projector.mm_input_projection_weight"
    weights[projection] = mx.random.normal(weights[projection].shape) \
        / VISION["hidden_size"] ** 0.5
    return {name: value.astype(getattr(mx, DTYPE)) for name, value in weights.items()}


def _gemma4_weights(config: dict[str, Any]) -> dict[str, mx.array]:
    """mlx-vlm's own `gemma4` model with its initial (random) weights, under the names
    mlx-vlm saves (no output head: tied). As for Gemma 3 (`_gemma3_weights`), the token
    embeddings shrink to rows of length about 1 (Gemma 4 also multiplies them by
    sqrt(hidden size)), and so do the per-layer embeddings, scaled by sqrt of their width."""
    weights = vlm_initial_weights("gemma4", config, SEED)
    embed = "language_model.model.embed_tokens.weight"
    weights[embed] = weights[embed] / GEMMA4_TEXT["hidden_size"] ** 0.5
    per_layer = "language_model.model.embed_tokens_per_layer.weight"
    weights[per_layer] = weights[per_layer] / GEMMA4_TEXT["hidden_size_per_layer_input"] ** 0.5
    return {name: value.astype(getattr(mx, DTYPE)) for name, value in weights.items()}


G4_BOI, G4_EOI, G4_IMAGE_TOKEN, G4_VIDEO_TOKEN = "<|image>", "<image|>", "<|image|>", "<|video|>"
LAYOUTS: dict[str, Layout] = {
    NAME: Layout(NAME, BOI, EOI, IMAGE_TOKEN, BOI, TEXT, VISION, _gemma3_config,
                 _gemma3_processor_files, _gemma3_weights),
    "vision-gemma4": Layout("vision-gemma4", G4_BOI, G4_EOI, G4_IMAGE_TOKEN, G4_IMAGE_TOKEN,
                            GEMMA4_TEXT, GEMMA4_VISION, _gemma4_config,
                            _gemma4_processor_files, _gemma4_weights,
                            (("video_token", G4_VIDEO_TOKEN),)),
}
VARIANTS: tuple[str, ...] = tuple(LAYOUTS)
