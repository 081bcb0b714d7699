"""Family models: `builtin:fmt-<tool format>`, one tiny random-weights model per model
family with calls.

Each has its family's test template (`replicas/families/`, the `ModelTemplate` of the
family's module: the family's markers as added tokens, its template's layout of tools,
calls in history and tool results), so Orchard detects the tool format from the files as
it does for a real checkpoint, and every tool format can be driven over HTTP. The models
come from the family registry: a new family with a template is a new model here. The weights
are random (a fixed seed, `ceiling`'s one-layer shape, seconds to build, no training): the
text means nothing, so tests force a call (`tool_choice` naming a tool whose parameters
are single-value enums), and the grammar writes every byte of it.

The head favours the family's call markers: a residual channel is held constant (set in
every embedding, written by no layer) and only the marker rows of the head read it, so
where the grammar leaves a choice between a marker and text (Kimi's call index, the end of
Harmony's analysis message) the marker comes at once, and a forced call never runs to
`max_tokens`. The other added tokens (eos, role markers) get a logit of 0, as in `bench`.
"""

from __future__ import annotations

import importlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import load_tokenizer
from tokenizers import Tokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from replicas.families.family import Family, ModelTemplate
from replicas.families.registry import (
    FAMILIES,
    TOOL_FORMATS,
    detect_channel_format,
    detect_tool_format,
)

from ..startup import Progress
from .build import cached_build, default_cache_root
from .recipe import CEILING, RandomInit, Recipe, cache_key
from .tokenizer_files import train_tokenizer, write_json
from .train import BuildError

log = logging.getLogger(__name__)

PREFIX = "fmt-"
# `ceiling`'s shape: one narrow layer, so a replica costs little CPU and memory.
ARCHITECTURE = CEILING.architecture
LOGIT_STD = 5.0
# The constant residual channel (index 0) and the weight favoured rows give it: the final
# norm leaves that channel between about 2.3 and 4.5, so a marker's logit is some 35-70
# above its random part, while the best of the others is about 15.
_CHANNEL_VALUE = 1.0
_MARKER_WEIGHT = 15.0
_MAX_VOCAB = 640
SEED = 20250705


# The conversation each template renders for the tokenizer's corpus and the build's check:
# tools, a user turn, an assistant's call, its result, and the next user turn.
SAMPLE_TOOLS: tuple[dict[str, Any], ...] = (
    {"type": "function", "function": {
        "name": "set_mode", "description": "Set the display mode.",
        "parameters": {"type": "object", "properties": {
            "mode": {"type": "string", "enum": ["dark"], "description": "The mode."},
            "level": {"type": "string", "enum": ["high"], "description": "The level."}},
            "required": ["mode", "level"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False}}},
)
SAMPLE_MESSAGES: tuple[dict[str, Any], ...] = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
     "content": '{"temperature": 18, "condition": "sunny"}'},
    {"role": "assistant", "content": "It is sunny in Paris, 18 degrees."},
    {"role": "user", "content": "Set the display mode to dark, level high."},
)


def family_model_name(tool_format: str) -> str:
    """The built-in name of the family model whose template and vocabulary use
    `tool_format`."""
    return f"{PREFIX}{tool_format}"


def _recipe(family: Family) -> Recipe:
    assert family.tools is not None and family.template is not None
    # The template's own seed, never a place in a list: a model stays as it was whatever
    # families are added or reordered.
    return Recipe(name=family_model_name(family.tools.name), architecture=ARCHITECTURE,
                  weights=RandomInit(logit_std=LOGIT_STD), seed=SEED + family.template.seed)


# name -> (recipe, family) for every family with a test template, in seed order.
FAMILY_MODELS: Mapping[str, tuple[Recipe, Family]] = {
    recipe.name: (recipe, family) for recipe, family in sorted(
        ((_recipe(f), f) for f in FAMILIES if f.template is not None),
        key=lambda model: model[0].seed)
}


def ensure_family_model(name: str, cache_dir: Path | None = None) -> Path:
    """The cached directory of family model `name`, built first if missing."""
    recipe, family = FAMILY_MODELS[name]
    assert family.template is not None
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    key = cache_key(recipe, json.dumps(asdict(family.template), sort_keys=True))

    def make(tmp: Path) -> object:
        with Progress(f"building the built-in model builtin:{name}",
                      f"once (cached in {root}), a few seconds"):
            return build_family_model(recipe, family, tmp, key)

    return cached_build(root, key, make)


def render(spec: ModelTemplate, messages: Sequence[Mapping[str, Any]],
           tools: Sequence[Mapping[str, Any]] = (), **kwargs: Any) -> str:
    """`spec`'s chat template over `messages`, as transformers renders it (with the tokens
    a tokenizer passes: bos and eos)."""
    # Annotated `-> str`, it returns (texts, generation indices).
    result: Any = render_jinja_template(
        conversations=[[dict(m) for m in messages]], tools=[dict(t) for t in tools] or None,
        chat_template=spec.chat_template, bos_token=spec.bos or "", eos_token=spec.eos[0],
        **kwargs)
    return str(result[0][0])


def _corpus(spec: ModelTemplate) -> list[str]:
    """The sample conversation as the template writes it, split at the added tokens (which
    never go through BPE), for the BPE merges."""
    text = render(spec, SAMPLE_MESSAGES, SAMPLE_TOOLS, add_generation_prompt=True)
    for token in sorted(spec.added, key=len, reverse=True):
        text = text.replace(token, "\n")
    return [piece for piece in text.split("\n") if piece] * 2


def _tokenizer(spec: ModelTemplate) -> Tokenizer:
    return train_tokenizer(_corpus(spec), _MAX_VOCAB, 2, special=spec.special, plain=spec.plain)


def _write_tokenizer(spec: ModelTemplate, tokenizer: Tokenizer, out_dir: Path) -> dict[str, int]:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    ids = {token: _id(tokenizer, token) for token in spec.added}
    write_json(out_dir / "tokenizer_config.json", {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": t in spec.special}
            for t, i in ids.items()},
        "bos_token": spec.bos,
        "chat_template": spec.chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": spec.eos[0],
        "model_max_length": ARCHITECTURE.max_position_embeddings,
        "pad_token": spec.pad,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    })
    return ids


def _id(tokenizer: Tokenizer, token: str) -> int:
    found = tokenizer.token_to_id(token)
    if found is None:
        raise BuildError(f"token {token!r} is not in the vocabulary")
    return found


def build_family_model(recipe: Recipe, family: Family, out_dir: Path,
                       key: str) -> dict[str, Any]:
    """Write the model directory into `out_dir` and check it; returns its build info."""
    assert family.tools is not None and family.template is not None
    spec = family.template
    start = time.perf_counter()
    tokenizer = _tokenizer(spec)
    ids = _write_tokenizer(spec, tokenizer, out_dir)
    eos = [ids[t] for t in spec.eos]
    vocab_size = tokenizer.get_vocab_size()
    config = recipe.architecture.config(vocab_size, eos[0], ids[spec.pad], recipe.dtype)
    config["eos_token_id"] = eos
    if spec.bos is not None:
        config["bos_token_id"] = ids[spec.bos]
    write_json(out_dir / "config.json", config)
    write_json(out_dir / "generation_config.json", {
        "bos_token_id": config["bos_token_id"], "eos_token_id": eos,
        "pad_token_id": ids[spec.pad]})

    mx.random.seed(recipe.seed)
    module = importlib.import_module(f"mlx_lm.models.{recipe.architecture.model_type}")
    model = module.Model(module.ModelArgs.from_dict(config))
    assert isinstance(recipe.weights, RandomInit)
    _randomize(model, recipe.weights, list(ids.values()),
               [_id(tokenizer, t) for t in spec.favoured])
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    check_family_model(out_dir, family)
    info = {"name": recipe.name, "cache_key": key, "tool_format": family.tools.name,
            "vocab_size": vocab_size, "parameters": sum(w.size for w in weights.values()),
            "weights": {"source": "random", "seed": recipe.seed, "favoured": list(spec.favoured)},
            "build_seconds": round(time.perf_counter() - start, 2)}
    write_json(out_dir / "build_info.json", info)
    log.info("built builtin:%s: %s", recipe.name, info)
    return info


def _randomize(model: nn.Module, init: RandomInit, added: Sequence[int],
               favoured: Sequence[int]) -> None:
    """`bench`'s random head (added tokens' rows zero), plus the constant channel 0 that
    only the favoured tokens' rows read (see the module docstring)."""
    inner = model.model  # type: ignore[attr-defined]
    hidden = inner.embed_tokens.weight.shape[1]
    channel = mx.arange(hidden) == 0
    inner.embed_tokens.weight = mx.where(channel, _CHANNEL_VALUE, inner.embed_tokens.weight)
    for layer in inner.layers:  # no layer writes the channel: it stays constant
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
            linear.weight = mx.where(channel[:, None], 0.0, linear.weight)
    head = model.lm_head  # type: ignore[attr-defined]
    vocab = head.weight.shape[0]
    weight = mx.random.normal((vocab, hidden)) * (init.logit_std / hidden**0.5)
    def rows(ids: Sequence[int]) -> mx.array:  # (vocab, 1): True on the rows of `ids`
        flags = [False] * vocab
        for i in ids:
            flags[i] = True
        return mx.array(flags)[:, None]

    weight = mx.where(rows(added) | channel, 0.0, weight)
    head.weight = mx.where(rows(favoured) & channel, _MARKER_WEIGHT, weight)
    mx.eval(model.parameters())


def check_family_model(path: Path, family: Family) -> None:
    """Raise BuildError unless the directory loads as production loads it, Orchard detects
    the family's tool format from its template and vocabulary, every marker of the format
    is one token, and the template renders the sample conversation with its call and
    result."""
    assert family.tools is not None
    fmt = family.tools
    model = f"builtin:{PREFIX}{fmt.name}"
    tokenizer = load_tokenizer(path)
    hf = tokenizer._tokenizer
    vocab = hf.get_vocab().keys()
    template = hf.chat_template
    found = detect_tool_format(template, vocab)
    if found != fmt.name:
        raise BuildError(f"{model}: Orchard detects the tool format {found!r} from its files")
    if fmt.channel_format is not None and \
            detect_channel_format(template, vocab) != fmt.channel_format:
        raise BuildError(f"{model}: not detected as channel format {fmt.channel_format!r}")
    for marker in fmt.grammar.markers if fmt.grammar is not None else ():
        if len(hf.encode(marker, add_special_tokens=False)) != 1:
            raise BuildError(f"{model}: marker {marker!r} is not one token")
    text = hf.apply_chat_template(list(SAMPLE_MESSAGES), tools=list(SAMPLE_TOOLS),
                                  add_generation_prompt=True, tokenize=False)
    for needed in ("set_mode", "get_weather", "Paris", "sunny"):
        if needed not in text:
            raise BuildError(f"{model}: the template left out {needed!r}")


def tool_markers(tool_format: str) -> tuple[str, ...]:
    """Every marker text of a tool format: its open and close, section, reserved markers
    and the grammar's markers (Kimi's, GLM's argument tags, Harmony's headers)."""
    fmt = TOOL_FORMATS[tool_format]
    grammar = fmt.grammar
    texts = (fmt.call_open, fmt.call_close, *fmt.section, *fmt.reserved,
             *(grammar.markers if grammar is not None else ()))
    return tuple(dict.fromkeys(t for t in texts if t))
