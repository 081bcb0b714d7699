"""A small model trained on the coding agents' own requests, so a real `serve run` makes
their tool calls.

The built-in tiny model memorizes exact prompts and cannot generalize to a client's
prompt. So the suite first records the `GenerationRequest`s the ingress adapters build
from a real client's requests (see `capture.py`), and this module trains a model of the
same kind on them: each recorded request is rendered by the production prompt code
(`replicas.pipeline.prompt.render_prompt`, with the model's own tokenizer and chat template) and
paired with the exact completion the model must write (a Hermes `<tool_call>` block, or
the final answer). `replicas.builtin`'s pieces are used as a library: its tokenizer files
and chat template, the `qwen3` architecture, `train()` with its margin check and
`verify_model_dir`. The BPE itself may merge across words (`agent_tokenizer.py`), which
makes the prompts about 100 tokens long, so training takes one to two minutes on 2 cores.

Clients sample at temperature 1 (neither sends a temperature). Training stops, as the
built-in model's does, once every scripted token wins by `TRAIN_MARGIN` logits; then the
final RMSNorm's weight is multiplied by `SHARPEN`. The head is tied and reads that norm's
output, so every logit is multiplied by `SHARPEN`: greedy output is unchanged, sampling at
temperature 1 behaves like sampling at 1/SHARPEN, and every margin becomes at least
`MIN_MARGIN`, which keeps the chance of sampling any other token below
vocab x e^-MIN_MARGIN (a few in a million) per step. Turns whose prompt holds values that change
every run (Codex's wall time) are trained on several variants and checked, by the same
margin, on variants not trained on (`held_out`).

Built models are cached like the built-in ones (`$ORCHARD_CACHE_DIR/clients/`, else
`~/.cache/orchard/clients/`), keyed by the rendered training texts and everything that
shapes the files, with an flock and a temporary directory renamed into place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3
from mlx_lm.utils import load_tokenizer

import replicas.builtin as builtin_package
import replicas.pipeline.prompt as prompt_module
from replicas.builtin.build import cached_build, orchard_cache
from replicas.builtin.recipe import TINY, Training
from replicas.builtin.tokenizer_files import (
    PAD_TOKEN,
    token_id,
    train_tokenizer,
    write_json,
    write_tokenizer_files,
)
from replicas.builtin.train import BuildError, Example, train
from replicas.builtin.verify import verify_model_dir
from replicas.contract import GenerationRequest
from replicas.pipeline.prompt import render_prompt

from .agent_tokenizer import corpus_pieces, keep_own_pre_tokenizer, train_agent_tokenizer

log = logging.getLogger(__name__)

# The built-in tiny model's shape; the context holds the longest client prompt many times.
ARCHITECTURE = dataclasses.replace(TINY.architecture, max_position_embeddings=16384)
TRAIN_MARGIN = 6.0
SHARPEN = 4.0
MIN_MARGIN = 20.0  # after sharpening, on trained and held-out turns alike
TRAINING = Training(
    learning_rate=3e-3,
    warmup_steps=20,
    weight_decay=0.0,
    check_every=10,
    max_steps=300,
    min_margin=TRAIN_MARGIN,
)
# A cap the BPE does not reach (about 1600 tokens): merges stop at pairs seen only once.
MAX_VOCAB = 4096
SEED = 20251122
BUILD_INFO = "build_info.json"


@dataclass(frozen=True)
class Turn:
    """One model turn to learn: the request as the adapter built it, and the exact text
    the model must generate for it (eos follows)."""

    name: str
    request: GenerationRequest
    completion: str


def hermes_call(name: str, arguments: Mapping[str, Any]) -> str:
    """One tool call as the built-in tokenizer's models write it (Qwen3 / Hermes)."""
    body = json.dumps({"name": name, "arguments": dict(arguments)}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def cache_root() -> Path:
    return orchard_cache("clients")


def ensure_agent_model(
    train_turns: Sequence[Turn], held_out: Sequence[Turn] = (), root: Path | None = None
) -> Path:
    """The cached model directory for these turns, trained first if missing."""
    texts = rendered_texts([*train_turns, *held_out])
    key = _cache_key(train_turns, held_out, texts)
    return cached_build(root or cache_root(), key,
                        lambda tmp: build(train_turns, held_out, tmp, texts))


def build(
    train_turns: Sequence[Turn],
    held_out: Sequence[Turn],
    out_dir: Path,
    texts: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Write a complete, verified model directory into `out_dir`; returns its build info."""
    start = time.perf_counter()
    texts = texts or rendered_texts([*train_turns, *held_out])
    corpus = [piece for text in texts.values() for piece in corpus_pieces(text)]
    corpus += [piece for t in train_turns for piece in corpus_pieces(t.completion)]
    tokenizer = train_agent_tokenizer(corpus, MAX_VOCAB)
    eos_id = write_tokenizer_files(tokenizer, out_dir, ARCHITECTURE.max_position_embeddings)
    keep_own_pre_tokenizer(out_dir)
    pad_id = token_id(tokenizer, PAD_TOKEN)
    config = ARCHITECTURE.config(tokenizer.get_vocab_size(), eos_id, pad_id, "float32")
    write_json(out_dir / "config.json", config)
    write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": pad_id, "eos_token_id": [eos_id], "pad_token_id": pad_id},
    )

    # Prompts are rendered again through the written files, exactly as a replica does.
    hf_tokenizer = load_tokenizer(out_dir)._tokenizer
    examples = [_example(hf_tokenizer, t, eos_id, config["vocab_size"]) for t in train_turns]
    checks = [_example(hf_tokenizer, t, eos_id, config["vocab_size"]) for t in held_out]
    longest = max(len(e.prompt) + len(e.completion) for e in [*examples, *checks])
    if longest > ARCHITECTURE.max_position_embeddings // 2:
        raise BuildError(f"a prompt of {longest} tokens leaves too little context")

    mx.random.seed(SEED)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    report = train(model, examples, pad_id, TRAINING)
    norm = model.model.norm
    norm.weight = norm.weight * SHARPEN
    margin = _check_margins(model, [*examples, *checks])
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    # Greedy decoding of the saved directory, alone and batched, must give every completion.
    verify_model_dir(out_dir, [*examples, *checks])
    info = {
        "turns": [t.name for t in train_turns],
        "held_out": [t.name for t in held_out],
        "vocab_size": config["vocab_size"],
        "parameters": sum(w.size for w in weights.values()),
        "prompt_tokens": {e.script_id: len(e.prompt) for e in [*examples, *checks]},
        "training": {
            "steps": report.steps,
            "seconds": round(report.seconds, 2),
            "final_loss": report.loss,
            "min_margin": round(report.min_margin, 3),
            "sharpened_min_margin": round(margin, 3),
        },
        "build_seconds": round(time.perf_counter() - start, 2),
    }
    write_json(out_dir / BUILD_INFO, info)
    log.info("built the agent model: %s", info)
    return info


def rendered_texts(turns: Sequence[Turn]) -> dict[str, str]:
    """Each turn's prompt as the chat template writes it (text does not depend on the
    vocabulary, so a throwaway tokenizer carrying the same template renders it)."""
    scratch = Path(tempfile.mkdtemp(prefix="orchard-agent-render-"))
    try:
        bootstrap = train_tokenizer(["a"], 300, min_frequency=2)
        write_tokenizer_files(bootstrap, scratch, ARCHITECTURE.max_position_embeddings)
        hf_tokenizer = load_tokenizer(scratch)._tokenizer
        vocab = bootstrap.get_vocab_size()
        return {t.name: _render(hf_tokenizer, t.request, vocab).text for t in turns}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _render(hf_tokenizer: Any, request: GenerationRequest, vocab_size: int) -> Any:
    return render_prompt(
        hf_tokenizer, request.prompt, request.reasoning, vocab_size, tools=request.tools
    )


def _example(hf_tokenizer: Any, turn: Turn, eos_id: int, vocab_size: int) -> Example:
    prompt = _render(hf_tokenizer, turn.request, vocab_size).token_ids
    completion = hf_tokenizer.encode(turn.completion, add_special_tokens=False)
    return Example(turn.name, tuple(prompt), (*completion, eos_id))


def _check_margins(model: nn.Module, examples: Sequence[Example]) -> float:
    """The smallest teacher-forced margin over `examples`; BuildError, naming the turns,
    below MIN_MARGIN (held-out turns stand for what the clients send on a later run)."""
    worst = float("inf")
    failures = []
    for example in examples:
        margin = _min_margin(model, example)
        worst = min(worst, margin)
        if margin < MIN_MARGIN:
            failures.append(f"{example.script_id} ({margin:.2f})")
    if failures:
        raise BuildError(f"turns below the {MIN_MARGIN} logit margin: {', '.join(failures)}")
    return worst


def _min_margin(model: nn.Module, example: Example) -> float:
    tokens = [*example.prompt, *example.completion]
    logits = model(mx.array([tokens[:-1]]))[0, len(example.prompt) - 1 :]
    targets = mx.array(list(example.completion))
    target = mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    others = mx.put_along_axis(
        logits, targets[:, None], mx.array(-mx.inf, dtype=logits.dtype), axis=-1
    )
    return cast(float, (target - others.max(axis=-1)).min().item())


def _cache_key(
    train_turns: Sequence[Turn], held_out: Sequence[Turn], texts: Mapping[str, str]
) -> str:
    # Whatever shapes the files: the rendered prompts and completions, the recipe, the code
    # that renders, tokenizes and trains, and the versions of the packages underneath.
    sources = [Path(__file__), Path(__file__).with_name("agent_tokenizer.py"),
               Path(prompt_module.__file__)]
    sources += sorted(Path(builtin_package.__file__).parent.glob("*.py"))
    material = {
        "train": [(t.name, texts[t.name], t.completion) for t in train_turns],
        "held_out": [(t.name, texts[t.name], t.completion) for t in held_out],
        "architecture": asdict(ARCHITECTURE),
        "training": asdict(TRAINING),
        "sharpen": [SHARPEN, MIN_MARGIN],
        "vocab": MAX_VOCAB,
        "seed": SEED,
        "sources": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sources},
        "versions": {n: version(n) for n in ("mlx", "mlx-lm", "tokenizers", "transformers")},
    }
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    return f"agents-{digest[:12]}"


__all__ = ["Turn", "build", "ensure_agent_model", "hermes_call", "rendered_texts"]
