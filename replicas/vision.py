"""A model that sees: its images become input embeddings at the start of the prompt, and
everything after them is an ordinary text prompt.

mlx-vlm holds what is particular to a vision-language model: its processor (the image
preprocessing and the expansion of each image token into the image's grid of tokens) and
its vision tower and projector (`get_input_embeddings`: the prompt's embeddings with the
image features merged in). The language model is mlx-lm's own class, loaded by the
production loader and driven by the same batch as any text model. That is the cut: the
engine prefills the image prefix from embeddings once (`replicas.engine.batch.local`), and from
there streaming, stops, channels, guided decoding, tool calls, the prefix cache, admission
and continuous batching are the text path's, unchanged, rather than a second engine
(mlx-vlm's own batch generator) kept in step with the first.

Only the model types checked against mlx-vlm's own generation are served
(`VISION_MODEL_TYPES`); a checkpoint with a vision tower of another type is refused at load,
naming it, unless config says `kind: text`. Qwen-VL's language model takes 3-D rotary
positions (M-RoPE, `MROPE_MODEL_TYPES`): its image prefix is prefilled with mlx-vlm's
positions (`get_rope_index`, returned with the embeddings), and every later token of the row
sits at its offset plus the row's `rope_delta` (`PromptEmbeddings.rope_delta`), which the
batch applies per row through mlx-lm's layers (`replicas.engine.model.mrope`). Qwen3-VL's
prefix also carries DeepStack's features, added after the first layers at its image
tokens (`DEEPSTACK_MODEL_TYPES`, `replicas.engine.model.deepstack`); Qwen3.5's hybrid
language model rotates only in its full-attention layers (its linear-attention layers keep a
recurrent state, prefilled over the prefix like a text prompt's). Gemma 3's
image tokens attend to each other both ways (`BIDIRECTIONAL_MODEL_TYPES`), and Gemma 4's
where its config says so (`use_bidirectional_attention: "vision"`): the prefix
carries each image's span (`PromptEmbeddings.blocks`), which the batch prefills whole under
that mask (`replicas.engine.model.bidirectional`). Gemma 4's prefix embeddings come
scaled, and its per-layer inputs read the pad token at image tokens, as mlx-vlm's
(`replicas.engine.model.gemma4`). LFM2-VL needs none of these: 1-D
positions, and its short convolutions' state prefilled over the prefix as a text prompt's.
"""

from __future__ import annotations

import hashlib
import io
import json
import time
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from replicas.contract import ImageData
from replicas.engine.model.bidirectional import image_blocks
from replicas.engine.model import deepstack, gemma4
from replicas.engine.model.mrope import install
from replicas.engine.request import PromptEmbeddings
from replicas.errors import InvalidRequestError
from replicas.options import ModelKind
from replicas.pipeline.prompt import RenderedPrompt
from replicas.startup import Progress
from replicas.timings import Timings

# Model types served with images: each checked against mlx-vlm's generation
# (tests/integration/test_vision.py on `builtin:vision`, a mistral3; test_vision_qwen.py on
# `builtin:vision-qwen`, `builtin:vision-qwen25`, `builtin:vision-qwen3`,
# `builtin:vision-qwen3-moe`, `builtin:vision-qwen35` and `builtin:vision-qwen35-moe`;
# test_vision_gemma.py on
# `builtin:vision-gemma3` and `builtin:vision-gemma4`; test_vision_lfm2.py on
# `builtin:vision-lfm2`).
VISION_MODEL_TYPES: frozenset[str] = frozenset({"mistral3", "qwen2_vl", "qwen2_5_vl",
                                                "qwen3_vl", "qwen3_vl_moe", "qwen3_5",
                                                "qwen3_5_moe", "gemma3", "gemma4",
                                                "lfm2-vl"})
# Those whose language model takes 3-D rotary positions (`replicas.engine.model.mrope`).
MROPE_MODEL_TYPES: frozenset[str] = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl",
                                              "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"})
# Those that add vision blocks' features after the first decoder layers
# (`replicas.engine.model.deepstack`; test_vision_qwen.py on `builtin:vision-qwen3` and
# `builtin:vision-qwen3-moe`).
DEEPSTACK_MODEL_TYPES: frozenset[str] = frozenset({"qwen3_vl", "qwen3_vl_moe"})
# Those whose image tokens attend to each other both ways (`model.bidirectional`); Gemma 4's
# do where its text config's `use_bidirectional_attention` is "vision" (`_bidirectional`).
BIDIRECTIONAL_MODEL_TYPES: frozenset[str] = frozenset({"gemma3"})


class VisionUnsupported(ValueError):
    """A model configured as `kind: vision` that this cut cannot serve."""


def sees(config: dict[str, Any], kind: ModelKind = "auto") -> bool:
    """Whether a model with this config.json is served with images: its config has a
    vision tower of a type in `VISION_MODEL_TYPES` (or `kind` says vision, which must then
    hold); `kind: text` never. A vision tower of another type is refused (VisionUnsupported)
    unless `kind: text`."""
    if kind == "text":
        return False
    model_type = str(config.get("model_type", ""))
    vision = "vision_config" in config
    if model_type in VISION_MODEL_TYPES and vision:
        return True
    if kind == "vision":
        raise VisionUnsupported(
            f"`kind: vision`, but images are served only for model types "
            f"{', '.join(sorted(VISION_MODEL_TYPES))} with a vision_config; this model is "
            f"{model_type or 'of no model_type'}")
    if vision:  # never text only by surprise
        raise VisionUnsupported(
            f"model type {model_type} has a vision tower Orchard does not serve yet (images "
            f"are served for {', '.join(sorted(VISION_MODEL_TYPES))}); set `kind: text` to "
            "serve it as text only")
    return False


class VisionModel:
    """The vision half of a vision-language model: processor, tower and projector."""

    def __init__(self, encoder: nn.Module, processor: Any, image_token_id: int,
                 timings: Timings, mrope: bool = False, end: int | None = None,
                 bidirectional: bool = False, deepstacked: bool = False) -> None:
        self._encoder = encoder
        self._mrope = mrope  # the prefix's 3-D positions go with its embeddings
        self._deepstack = deepstacked  # and DeepStack's additions with both (Qwen3-VL)
        # Each image's span goes with them, attending both ways (Gemma); tests turn it off
        # to show that it matters.
        self.bidirectional = bidirectional
        # Gemma 3's merge reads the attention mask, and its template writes the
        # start-of-image token per image, which its processor expands; the others' (Gemma 4's
        # too) write the image token itself.
        self._gemma = getattr(encoder.config, "model_type", None) == "gemma3"
        self._placeholder: str = processor.boi_token if self._gemma else processor.image_token
        self._timings = timings
        self._processor = processor
        self.image_token_id = image_token_id
        weights: dict[str, mx.array] = dict(tree_flatten(encoder.parameters()))
        # What this half adds to memory (the language model's weights are counted already).
        self.nbytes = sum(v.nbytes for k, v in weights.items()
                          if not k.startswith("language_model."))
        if end is None:  # else Qwen-VL's token that closes each image's vision span
            end = getattr(processor, "image_end_token_id", None)
        if not isinstance(end, int):  # what tells one image's tokens from the next's
            raise VisionUnsupported("the model's processor has no image end token")
        self._end_token = end

    @classmethod
    def load(cls, path: Path, language_model: nn.Module, timings: Timings) -> "VisionModel":
        """mlx-vlm's model for `path`, lazily, keeping only what the language model (mlx-lm's,
        already loaded) does not have: the language weights are never read, and the token
        embeddings are the language model's own (no second copy of the largest matrix)."""
        from mlx_vlm.utils import load_model, load_processor

        with Progress(f"loading the vision tower and processor from {path}"):
            encoder = load_model(path, lazy=True)
            processor = load_processor(path)
            text = encoder.language_model.model
            mrope = encoder.config.model_type in MROPE_MODEL_TYPES
            if mrope:  # mlx-lm's layers, with mlx-vlm's rotary embedding for image prefixes
                # (Qwen3.5's linear-attention layers have none: a full-attention layer's)
                attention = next(a for a in (getattr(la, "self_attn", None)
                                             for la in text.layers) if a is not None)
                install(language_model, attention.rotary_emb)
            deepstacked = encoder.config.model_type in DEEPSTACK_MODEL_TYPES
            if deepstacked:  # its first layers add the tower's earlier blocks' features
                levels = len(encoder.config.vision_config.deepstack_visual_indexes)
                deepstack.install(language_model, levels)
            if encoder.config.model_type == "gemma4":  # mlx-vlm's embeddings as they are
                gemma4.install(language_model, encoder.config.image_token_id)
                text.hidden_size_per_layer_input = 0  # mlx-lm's copy looks them up
                # Orchard takes no audio: E2B's and E4B's audio tower is never read.
                encoder.audio_tower = encoder.embed_audio = None
            text.embed_tokens = _embed_tokens(language_model)
            text.layers = []  # mlx-lm's copy runs them; these are never read
            weights: dict[str, mx.array] = dict(tree_flatten(encoder.parameters()))
            mx.eval([v for k, v in weights.items() if not k.startswith("language_model.")])
        token = getattr(encoder.config, "image_token_index", None)
        if token is None:  # Qwen-VL's name for it
            token = getattr(encoder.config, "image_token_id", None)
        if not isinstance(token, int):
            raise VisionUnsupported(f"{path}: config.json names no image_token_index")
        config = json.loads((Path(path) / "config.json").read_text())
        end = next((config[name] for name in (  # Qwen's, Gemma 3's, Gemma 4's, LFM2-VL's
            "vision_end_token_id", "eoi_token_index", "eoi_token_id", "image_end_token_id")
            if name in config), None)
        return cls(encoder, processor, token, timings, mrope, end,
                   bidirectional=_bidirectional(encoder.config), deepstacked=deepstacked)

    def prompt(self, text: str, images: Sequence[ImageData]) -> RenderedPrompt:
        """`text` (the chat template's output, one image token per image) and its images
        through the processor: the expanded token ids, and the embeddings of their start.
        Runs off the engine thread; the embeddings are computed on it, when the request
        is inserted."""
        pictures = [_open(image, n) for n, image in enumerate(images)]
        marks = text.count(self._placeholder)
        if marks != len(pictures):
            raise InvalidRequestError(
                f"the model's chat template placed {marks} of the request's {len(pictures)} "
                "images; it may not render images in every role (a tool result, say)",
                param="messages")
        try:
            inputs = self._processor(text=text, images=pictures, return_tensors="np")
        except Exception as exc:  # noqa: BLE001 - a processor refusing an image is the client's
            raise InvalidRequestError(f"the model's processor refused an image: {exc}",
                                      param="messages") from exc
        ids = [int(t) for t in np.asarray(inputs["input_ids"])[0]]
        image_at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if not image_at or image_at[-1] >= len(ids) - 1:
            raise InvalidRequestError("the prompt must go on after its last image",
                                      param="messages")
        length = image_at[-1] + 1
        key = _content_key(ids[:length], images, self.image_token_id, self._end_token)
        pixels = inputs["pixel_values"]
        extra = {name: inputs[name] for name in ("image_sizes", "image_grid_thw",
                                                 "spatial_shapes", "pixel_attention_mask")
                 if inputs.get(name) is not None}
        if self._gemma:  # its merge reads the attention mask
            extra["mask"] = np.ones((1, length), dtype=np.int32)
        blocks = image_blocks(ids[:length], self.image_token_id) if self.bidirectional else ()
        delta = _rope_delta(inputs["image_grid_thw"], self._merge) if self._mrope else 0
        encoder, timings, mrope = self._encoder, self._timings, self._mrope
        deepstacked, image_token = self._deepstack, self.image_token_id

        def compute() -> Any:
            started = time.perf_counter()
            features = encoder.get_input_embeddings(
                mx.array([ids[:length]]), _pixels(pixels),
                **{name: mx.array(value) for name, value in extra.items()})
            embeddings = features.inputs_embeds[0]
            mx.eval(embeddings)
            timings.encoded(len(pictures), time.perf_counter() - started)
            if not mrope:
                return embeddings
            if int(features.rope_deltas.reshape(-1)[0].item()) != delta:
                raise ValueError(f"mlx-vlm's rope delta {features.rope_deltas} is not {delta}")
            if not deepstacked:
                return embeddings, features.position_ids
            additions = deepstack.dense(ids[:length], image_token,
                                        features.deepstack_visual_embeds)
            mx.eval(additions)
            return embeddings, features.position_ids, additions

        return RenderedPrompt(tuple(ids), text,
                              PromptEmbeddings(tuple(key), compute, rope_delta=delta,
                                               blocks=blocks))

    @property
    def _merge(self) -> int:
        return int(self._encoder.config.vision_config.spatial_merge_size)


def _bidirectional(config: Any) -> bool:
    """Whether the model's image tokens attend to each other both ways: Gemma 3's always,
    Gemma 4's where its text config says "vision" (as mlx-vlm's `_make_masks` reads it)."""
    if config.model_type == "gemma4":
        return getattr(config.text_config, "use_bidirectional_attention", None) == "vision"
    return config.model_type in BIDIRECTIONAL_MODEL_TYPES


def _embed_tokens(language_model: nn.Module) -> nn.Module:
    for path in (("language_model", "model"), ("model",)):
        module: Any = language_model
        for name in path:
            module = getattr(module, name, None)
        if module is not None and hasattr(module, "embed_tokens"):
            return module.embed_tokens  # type: ignore[no-any-return]
    raise VisionUnsupported("the language model has no embed_tokens to share")


def _rope_delta(grids: Any, merge: int) -> int:
    """M-RoPE's shift of every position after the images (`get_rope_index`'s delta): an
    image of t x h x w merged tokens takes t*h*w indices but advances positions by
    max(t, h, w)."""
    delta = 0
    for t, h, w in np.asarray(grids).tolist():
        h, w = h // merge, w // merge
        delta += max(t, h, w) - t * h * w
    return delta


def _content_key(ids: Sequence[int], images: Sequence[ImageData], image_token: int,
                 end_token: int) -> list[int]:
    """The prefix cache's key for the image prefix: its token ids, but each image token
    replaced by a negative id from its image's content hash and its place in the image, so
    two prompts share cached KV only where their images are byte for byte the same. The
    images follow each other in order, each closed by the processor's end token."""
    digests = [int(hashlib.sha256(image.data).hexdigest()[:12], 16) for image in images]
    key, image, place = list(ids), 0, 0
    for position, token in enumerate(ids):
        if token == image_token:
            key[position] = -1 - ((digests[min(image, len(digests) - 1)] << 20) + place)
            place += 1
        elif token == end_token:
            image, place = image + 1, 0
    return key


def _open(image: ImageData, index: int) -> Any:
    """The decoded image, or a 400 (the ingress checked it; a replica never trusts that)."""
    from PIL import Image

    try:
        picture = Image.open(io.BytesIO(image.data))
        picture.load()
        return picture.convert("RGB")
    except Exception as exc:  # noqa: BLE001 - any decoding failure is a bad image
        raise InvalidRequestError(f"image {index} could not be decoded: {exc}",
                                  param="messages") from exc


def _pixels(values: Any) -> mx.array | list[mx.array]:
    """The processor's pixel values as mlx-vlm takes them: one array, or a list when the
    images have different sizes."""
    if isinstance(values, list):
        return [mx.array(v) for v in values]
    return mx.array(values)
