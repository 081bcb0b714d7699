"""Built-in models the project makes itself, offline and deterministically.

`builtin:tiny` is a small qwen3 model trained to reproduce the scripts in
scripts.json exactly; `builtin:bench` has the same tokenizer and architecture with
random weights and about 25M parameters, for throughput benchmarks; `builtin:embed` is an
embedding model laid out as Qwen3-Embedding (embed_model.py); `builtin:embed-bert` a
BERT sentence encoder served through mlx-embeddings (encoder_model.py); `builtin:vision` a
vision-language model laid out as Mistral Small 3.x (vision_model.py), `builtin:vision-qwen`
and `builtin:vision-qwen25` ones laid out as Qwen2-VL and Qwen2.5-VL (vision_qwen_model.py),
`builtin:vision-qwen3` one laid out as Qwen3-VL (vision_qwen3_model.py),
`builtin:vision-qwen3-moe` one laid out as Qwen3-VL's MoE (vision_qwen3_moe_model.py),
`builtin:vision-qwen35` and `builtin:vision-qwen35-moe` ones laid out as Qwen3.5 and its MoE,
hybrid (vision_qwen35_model.py),
`builtin:vision-gemma3` and `builtin:vision-gemma4` ones laid out as Gemma 3 and Gemma 4
(vision_gemma_model.py),
`builtin:vision-lfm2` one laid out as LFM2-VL (vision_lfm2_model.py); `builtin:rerank` a
Qwen3-Reranker-style decoder, `builtin:cross-encoder` a ModernBERT cross-encoder and
`builtin:cross-encoder-bert` a BERT one (rerank_model.py); `builtin:fmt-<format>`
has the tokenizer and chat template of a model family that writes that tool format (the
family's test template, `replicas/families/`), and random weights, for driving each format
over HTTP (family_models.py). All are built
on first use and cached; tiny's build writes the trained weights shipped in the package and
trains only if they fail verification (see README.md).
"""

from __future__ import annotations

from pathlib import Path

from .build import ensure_recipe
from .embed_model import NAME as EMBED_NAME
from .embed_model import ensure_embed_model
from .encoder_model import NAME as ENCODER_NAME
from .encoder_model import ensure_encoder_model
from .family_models import FAMILY_MODELS, ensure_family_model, family_model_name
from .recipe import RECIPES
from .rerank_model import BERT_CROSS_ENCODER_NAME, CROSS_ENCODER_NAME, \
    ensure_bert_cross_encoder_model, ensure_cross_encoder_model
from .rerank_model import NAME as RERANK_NAME
from .rerank_model import ensure_rerank_model
from .vision_model import NAME as VISION_NAME
from .vision_model import ensure_vision_model
from .vision_gemma_model import VARIANTS as VISION_GEMMA_NAMES
from .vision_gemma_model import ensure_vision_gemma_model
from .vision_lfm2_model import NAME as VISION_LFM2_NAME
from .vision_lfm2_model import ensure_vision_lfm2_model
from .vision_qwen_model import VARIANTS as VISION_QWEN_NAMES
from .vision_qwen_model import ensure_vision_qwen_model
from .vision_qwen3_model import NAME as VISION_QWEN3_NAME
from .vision_qwen3_model import ensure_vision_qwen3_model
from .vision_qwen3_moe_model import NAME as VISION_QWEN3_MOE_NAME
from .vision_qwen3_moe_model import ensure_vision_qwen3_moe_model
from .vision_qwen35_model import VARIANTS as VISION_QWEN35_NAMES
from .vision_qwen35_model import ensure_vision_qwen35_model
from .scripts import Message, Script, load_scripts, script

# The recipes, the embedding model, then one random-weights model per family with calls
# (`fmt-<tool format>`, family_models.py).
BUILTIN_NAMES: tuple[str, ...] = (*RECIPES, EMBED_NAME, ENCODER_NAME, VISION_NAME,
                                  *VISION_QWEN_NAMES, VISION_QWEN3_NAME, VISION_QWEN3_MOE_NAME,
                                  *VISION_QWEN35_NAMES, *VISION_GEMMA_NAMES, VISION_LFM2_NAME,
                                  RERANK_NAME, CROSS_ENCODER_NAME, BERT_CROSS_ENCODER_NAME,
                                  *FAMILY_MODELS)


def ensure_builtin(name: str, cache_dir: Path | None = None) -> Path:
    """The directory of built-in model `name`, building it first if it is not cached.

    `cache_dir` defaults to `$ORCHARD_CACHE_DIR/builtin`, else `~/.cache/orchard/builtin`.
    """
    if name in FAMILY_MODELS:
        return ensure_family_model(name, cache_dir)
    if name == EMBED_NAME:
        return ensure_embed_model(cache_dir)
    if name == VISION_NAME:
        return ensure_vision_model(cache_dir)
    if name in VISION_QWEN_NAMES:
        return ensure_vision_qwen_model(name, cache_dir)
    if name == VISION_QWEN3_NAME:
        return ensure_vision_qwen3_model(cache_dir)
    if name == VISION_QWEN3_MOE_NAME:
        return ensure_vision_qwen3_moe_model(cache_dir)
    if name in VISION_QWEN35_NAMES:
        return ensure_vision_qwen35_model(name, cache_dir)
    if name in VISION_GEMMA_NAMES:
        return ensure_vision_gemma_model(name, cache_dir)
    if name == VISION_LFM2_NAME:
        return ensure_vision_lfm2_model(cache_dir)
    if name == ENCODER_NAME:
        return ensure_encoder_model(cache_dir)
    if name == RERANK_NAME:
        return ensure_rerank_model(cache_dir)
    if name == CROSS_ENCODER_NAME:
        return ensure_cross_encoder_model(cache_dir)
    if name == BERT_CROSS_ENCODER_NAME:
        return ensure_bert_cross_encoder_model(cache_dir)
    recipe = RECIPES.get(name)
    if recipe is None:
        raise ValueError(f"unknown builtin model {name!r}; valid names: {', '.join(BUILTIN_NAMES)}")
    return ensure_recipe(recipe, cache_dir)


__all__ = [
    "BUILTIN_NAMES",
    "Message",
    "Script",
    "ensure_builtin",
    "family_model_name",
    "load_scripts",
    "script",
]
