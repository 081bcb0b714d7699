"""Build recipes: everything that decides a built-in model's bytes, and its cache key."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

# Packages whose behaviour shapes the files: BPE training, template rendering,
# the model class and the numerics of training.
_VERSIONED_PACKAGES = ("mlx", "mlx-lm", "tokenizers", "transformers")
_PACKAGE_DIR = Path(__file__).parent


@dataclass(frozen=True)
class Architecture:
    """The model shape written to config.json: qwen3, or qwen2 (which mlx-lm can also
    split into pipeline stages; qwen3 only splits by tensor)."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    model_type: str = "qwen3"

    def config(
        self, vocab_size: int, eos_token_id: int, pad_token_id: int, dtype: str
    ) -> dict[str, Any]:
        arch = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.model_type]
        return {
            "architectures": [arch],
            "vocab_size": vocab_size,
            "attention_bias": False,
            "hidden_act": "silu",
            "bos_token_id": pad_token_id,
            "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id,
            "torch_dtype": dtype,
            **asdict(self),
        }


@dataclass(frozen=True)
class Training:
    """Full-batch AdamW on the scripts until every scripted token wins by `min_margin`."""

    learning_rate: float
    warmup_steps: int
    weight_decay: float
    check_every: int
    max_steps: int
    # Logit gap between each scripted token and the best other token, checked with
    # teacher forcing; a wide gap keeps argmax stable under batching and padding.
    min_margin: float


@dataclass(frozen=True)
class RandomInit:
    """Untrained weights for throughput work, with a separate (untied) output head.

    The head is drawn so logits spread with std `logit_std` (the final RMSNorm makes
    hidden states about sqrt(hidden_size) long), and the added tokens' rows are zero.
    Their logit is then exactly 0, far below the best ordinary tokens, so sampling
    practically never picks eos, `<think>` or a ChatML marker: every request runs to
    its `max_tokens`, which keeps benchmark runs comparable. Untying the head keeps
    the text varied (a tied head would keep predicting its own input token).
    """

    logit_std: float


@dataclass(frozen=True)
class Recipe:
    name: str
    architecture: Architecture
    weights: Training | RandomInit
    seed: int
    # The BPE vocabulary stops growing earlier when no pair occurs `min_frequency` times.
    max_vocab: int = 1024
    min_frequency: int = 2
    # The dtype the weights are saved in (training always runs in float32).
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if isinstance(self.weights, RandomInit) and self.architecture.tie_word_embeddings:
            raise ValueError(f"recipe {self.name!r}: random weights need an untied head")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"recipe {self.name!r}: unsupported weight dtype {self.dtype!r}")


TINY = Recipe(
    name="tiny",
    architecture=Architecture(
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=384,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        # Coding-agent clients send prompts of ~15k tokens; RoPE needs no training for that.
        max_position_embeddings=32768,
    ),
    weights=Training(
        learning_rate=3e-3,
        warmup_steps=20,
        weight_decay=0.0,
        check_every=10,
        max_steps=400,
        min_margin=6.0,
    ),
    seed=20240601,
)

BENCH = Recipe(
    name="bench",
    architecture=Architecture(
        hidden_size=512,
        num_hidden_layers=8,
        intermediate_size=1536,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    weights=RandomInit(logit_std=5.0),
    seed=20240602,
    # Released MLX models ship in bfloat16 (or quantized), and the dtype decides how a
    # step's cost grows with the batch: on the CPU backend a float32 step costs about
    # batch x one decode, a bfloat16 step far less, as on real checkpoints.
    dtype="bfloat16",
)

# Random weights in an architecture mlx-lm runs as pipeline stages (qwen2), for sharding
# tests: a stage computes exactly what the unsharded model does, so greedy text matches.
PIPE = Recipe(
    name="pipe",
    architecture=Architecture(
        hidden_size=256,
        num_hidden_layers=4,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=False,
        model_type="qwen2",
    ),
    weights=RandomInit(logit_std=5.0),
    seed=20240603,
)

# Next to no compute per token (one narrow layer): on this model a step costs about what a
# Mac GPU's step of a small model does, so the serving path, not decode, sets the rate
# (load/bench_ceiling.py). Random weights: it never ends before max_tokens.
CEILING = Recipe(
    name="ceiling",
    architecture=Architecture(
        hidden_size=64,
        num_hidden_layers=1,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    weights=RandomInit(logit_std=5.0),
    seed=20240604,
)

RECIPES: dict[str, Recipe] = {r.name: r for r in (TINY, BENCH, PIPE, CEILING)}


def cache_key(recipe: Recipe, scripts_json: str) -> str:
    """`<name>-<hash>`: changes with the scripts, the recipe, this package's code
    (the chat template included) and the versions of the packages that shape the files.
    """
    source = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(_PACKAGE_DIR.iterdir())
        if p.suffix == ".py"
    }
    material = {
        "recipe": asdict(recipe),
        "weights_kind": type(recipe.weights).__name__,
        "scripts": scripts_json,
        "source": source,
        "versions": {name: version(name) for name in _VERSIONED_PACKAGES},
    }
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    return f"{recipe.name}-{digest[:12]}"
