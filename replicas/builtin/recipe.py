"""Build recipes: everything that decides a built-in model's bytes, and its cache key."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

# Packages whose behaviour shapes the files: BPE training, template rendering,
# the model class and the numerics of training.
_VERSIONED_PACKAGES = ("mlx", "mlx-lm", "tokenizers", "transformers")
_PACKAGE_DIR = Path(__file__).parent


# config.json's `architectures` for each model type a recipe may use.
_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM",
                  "qwen3_next": "Qwen3NextForCausalLM", "nemotron_h": "NemotronHForCausalLM",
                  "glm4_moe_lite": "Glm4MoeLiteForCausalLM", "mistral4": "Mistral4ForCausalLM",
                  "longcat_flash": "LongcatFlashForCausalLM",
                  "deepseek_v32": "DeepseekV32ForCausalLM",
                  "kimi_linear": "KimiLinearForCausalLM"}


@dataclass(frozen=True)
class Architecture:
    """The model shape written to config.json: qwen3, qwen2 (which mlx-lm can also split
    into pipeline stages; qwen3 only splits by tensor), or another mlx-lm model type with
    its own fields in `extra` (the cache-kind models below)."""

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
    extra: tuple[tuple[str, Any], ...] = ()  # the model type's own config fields

    def config(
        self, vocab_size: int, eos_token_id: int, pad_token_id: int, dtype: str
    ) -> dict[str, Any]:
        arch = _ARCHITECTURES[self.model_type]
        shape = {k: v for k, v in asdict(self).items() if k != "extra"}
        return {
            "architectures": [arch],
            "vocab_size": vocab_size,
            "attention_bias": False,
            "hidden_act": "silu",
            "bos_token_id": pad_token_id,
            "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id,
            "torch_dtype": dtype,
            **shape,
            **dict(self.extra),
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
    # Only the first `live_layers` layers add to the residual stream; the rest compute as
    # usual but their output projections are zero, so they change nothing (None: all live).
    live_layers: int | None = None
    # Drawn as a model of this many layers (the seed's draws those would take), then cut to
    # the architecture's: a cut model's layers, embeddings and head equal the whole one's.
    drawn_layers: int | None = None
    # An MTP layer in the files (`replicas.engine.model.mtp`), as DeepSeek V3 ships one: "random"
    # weights, or "agree": it predicts what the model will (a model whose layers are all
    # inert: its next token depends on its newest alone, and the layer reads that token).
    mtp: str | None = None


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
# (load/serving/ceiling.py). Random weights: it never ends before max_tokens.
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


# A target and a draft model that agree on every token (speculative decoding's best case,
# load/micro/speculative.py): `agree` is `bench` drawn from the same seed, with its last 7
# layers inert, so it costs what `bench` costs; `agree-draft` is its first layer alone,
# embeddings and head included, at an eighth of the cost.
AGREE = replace(BENCH, name="agree", weights=RandomInit(logit_std=5.0, live_layers=1))
AGREE_DRAFT = replace(BENCH, name="agree-draft",
                      architecture=replace(BENCH.architecture, num_hidden_layers=1),
                      weights=RandomInit(logit_std=5.0, drawn_layers=8))


def _cache_kind(name: str, seed: int, model_type: str, layers: int, **extra: Any) -> Recipe:
    """A small random-weights model whose cache is of one kind, in mlx-lm's own class for
    that architecture: KV memory accounting (`replicas.engine.kv.layout`) is checked on each."""
    return Recipe(
        name=name,
        architecture=Architecture(hidden_size=128, num_hidden_layers=layers,
                                  intermediate_size=256, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=32,
                                  max_position_embeddings=32768, tie_word_embeddings=False,
                                  model_type=model_type, extra=tuple(sorted(extra.items()))),
        weights=RandomInit(logit_std=5.0),
        seed=seed,
    )


# MLA (DeepSeek V3, Kimi K2): one compressed latent per token and layer, plus MoE; its rope
# key is 32 wide (64 in DeepSeek V3) so a KV quantization group of 32 divides it.
ARCH_MLA = _cache_kind(
    "arch-mla", 20240611, "deepseek_v3", 2, num_key_value_heads=4, kv_lora_rank=64,
    q_lora_rank=96, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
    moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    first_k_dense_replace=1, n_group=1, topk_group=1)
# Sliding window (gpt-oss): full and 64-token-window layers alternate, MoE.
ARCH_SLIDING = _cache_kind(
    "arch-sliding", 20240612, "gpt_oss", 4, sliding_window=64, num_local_experts=4,
    num_experts_per_tok=2, intermediate_size=128,
    layer_types=["sliding_attention", "full_attention"] * 2)
# Linear attention (Qwen3-Next): a fixed state per sequence in three of four layers.
ARCH_LINEAR = _cache_kind(
    "arch-linear", 20240613, "qwen3_next", 4, linear_num_value_heads=4,
    linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
    shared_expert_intermediate_size=128, mlp_only_layers=[], moe_intermediate_size=64,
    partial_rotary_factor=0.25, full_attention_interval=4)
# SSM (Nemotron-H): Mamba-2 layers with a fixed state, one attention layer.
ARCH_SSM = _cache_kind(
    "arch-ssm", 20240614, "nemotron_h", 4, mamba_num_heads=8, mamba_head_dim=16,
    mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=1, mlp_bias=False,
    layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True, attention_bias=False,
    hybrid_override_pattern=["M", "*", "-", "M"])
CACHE_KINDS = (ARCH_MLA, ARCH_SLIDING, ARCH_LINEAR, ARCH_SSM)

# The other MLA families whose attention Orchard absorbs (`replicas.engine.model.mla`), at
# `arch-mla`'s shape: GLM-4.7-Flash (glm4_moe_lite), Mistral Small 4 (mistral4), whose
# queries grow by Llama 4's scale past 64 positions here, and LongCat-Flash.
_MLA_SHAPE = {k: v for k, v in ARCH_MLA.architecture.extra}
ARCH_GLM_LITE = _cache_kind("arch-glm-lite", 20240616, "glm4_moe_lite", 2, **_MLA_SHAPE)
ARCH_MISTRAL4 = _cache_kind(
    "arch-mistral4", 20240617, "mistral4", 2, **_MLA_SHAPE, routed_scaling_factor=1.0,
    norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "llama_4_scaling_beta": 0.1,
                                          "original_max_position_embeddings": 64})
# LongCat-Flash (longcat_flash): two MLA attentions a layer, cached as a `CacheList` of two,
# both latents scaled; MoE with zero (identity) experts.
ARCH_LONGCAT = _cache_kind(
    "arch-longcat", 20240619, "longcat_flash", 2, **_MLA_SHAPE, num_layers=2,
    attention_method="MLA", zero_expert_type="identity", ffn_hidden_size=256, moe_topk=2,
    expert_ffn_hidden_size=64, zero_expert_num=2, routed_scaling_factor=1.0,
    rms_norm_eps=1e-6, rope_theta=10000.0, mla_scale_q_lora=True, mla_scale_kv_lora=True,
    attention_bias=False)
# DeepSeek V3.2 (deepseek_v32; GLM-5's glm_moe_dsa is this class): MLA that attends to the
# top 16 cached positions its indexer picks once a context passes 16, caching each layer's
# latent and indexer keys in a `CacheList` (over a packed latent: `mla.SparseLatentAttention`).
ARCH_DSV32 = _cache_kind("arch-dsv32", 20240620, "deepseek_v32", 2, **_MLA_SHAPE,
                         index_head_dim=32, index_n_heads=2, index_topk=16)
# Kimi Linear (kimi_linear): three of four layers linear (Kimi Delta Attention, a fixed
# state), the fourth MLA without position encoding; MoE.
ARCH_KIMI_LINEAR = _cache_kind(
    "arch-kimi-linear", 20240621, "kimi_linear", 4, kv_lora_rank=64, qk_rope_head_dim=32,
    qk_nope_head_dim=32, v_head_dim=32, mla_use_nope=True, model_max_length=32768,
    num_experts=4, num_experts_per_token=2, moe_intermediate_size=64,
    first_k_dense_replace=1, num_key_value_heads=4, linear_attn_config={
        "kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 4, "head_dim": 32,
        "short_conv_kernel_size": 4})
MLA_FAMILIES = (ARCH_GLM_LITE, ARCH_MISTRAL4, ARCH_LONGCAT, ARCH_DSV32, ARCH_KIMI_LINEAR)

# DeepSeek V3 with the MTP layer its checkpoints ship (speculative.method: mtp): `mtp` draws
# it at random (its drafts nearly all miss), `mtp-agree` makes it predict what the model
# will (every draft kept); `mtp-bench` is `mtp-agree` at `bench`'s width and depth and in
# its dtype, so the layer costs about a ninth of a pass. Its layers are dense (MLA attention,
# no experts): MLX's CPU backend runs the experts' gathered matmul in float32 only.
MTP = replace(ARCH_MLA, name="mtp", seed=20240615, architecture=replace(
    ARCH_MLA.architecture, extra=(*ARCH_MLA.architecture.extra, ("num_nextn_predict_layers", 1))),
    weights=RandomInit(logit_std=5.0, mtp="random"))
MTP_AGREE = replace(MTP, name="mtp-agree",
                    weights=RandomInit(logit_std=5.0, live_layers=0, mtp="agree"))
MTP_BENCH = replace(MTP_AGREE, name="mtp-bench", dtype="bfloat16", architecture=replace(
    MTP.architecture, hidden_size=512, num_hidden_layers=8, intermediate_size=1536,
    num_attention_heads=8, extra=tuple(sorted({**dict(MTP.architecture.extra),
                                               "num_key_value_heads": 8, "kv_lora_rank": 256,
                                               "q_lora_rank": 384, "qk_nope_head_dim": 64,
                                               "v_head_dim": 64, "first_k_dense_replace": 9,
                                               # as RESULTS.md measured it
                                               "qk_rope_head_dim": 16}.items()))))

# The same model with a random MTP layer: its drafts miss, which shows what drafting costs.
MTP_BENCH_MISS = replace(MTP_BENCH, name="mtp-bench-miss",
                         weights=RandomInit(logit_std=5.0, live_layers=0, mtp="random"))

# `mtp-bench` at 32 layers: one MTP layer per 32 model layers, nearer the checkpoints that
# ship one (DeepSeek V3: 61 layers, GLM-4.7-Flash: 47) than `mtp-bench`'s 8, where a draft
# costs an eighth of a pass instead of a thirty-second.
MTP_DEEP = replace(MTP_BENCH, name="mtp-deep", architecture=replace(
    MTP_BENCH.architecture, num_hidden_layers=32, extra=tuple(sorted(
        {**dict(MTP_BENCH.architecture.extra), "first_k_dense_replace": 33}.items()))))

# GLM-4.7-Flash (glm4_moe_lite) with its checkpoint's MTP layer, agreeing as `mtp-agree`'s.
MTP_GLM_LITE = replace(ARCH_GLM_LITE, name="mtp-glm-lite", seed=20240618,
                       architecture=replace(ARCH_GLM_LITE.architecture, extra=(
                           *ARCH_GLM_LITE.architecture.extra, ("num_nextn_predict_layers", 1))),
                       weights=RandomInit(logit_std=5.0, live_layers=0, mtp="agree"))

RECIPES: dict[str, Recipe] = {r.name: r for r in (TINY, BENCH, PIPE, CEILING, AGREE, AGREE_DRAFT,
                                                  *CACHE_KINDS, *MLA_FAMILIES, MTP, MTP_AGREE,
                                                  MTP_BENCH, MTP_BENCH_MISS, MTP_DEEP,
                                                  MTP_GLM_LITE)}


def recipe_fields(recipe: Recipe) -> dict[str, Any]:
    """The recipe as hashed into its cache key and its shipped weights' fingerprint; an
    empty `extra` is left out, so recipes from before it keep their hashes (and tiny its
    shipped weights)."""
    fields = asdict(recipe)
    if not recipe.architecture.extra:
        del fields["architecture"]["extra"]
    return fields


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
        "recipe": recipe_fields(recipe),
        "weights_kind": type(recipe.weights).__name__,
        "scripts": scripts_json,
        "source": source,
        "versions": {name: version(name) for name in _VERSIONED_PACKAGES},
    }
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    return f"{recipe.name}-{digest[:12]}"
