"""Check a built model the way production runs it: loaded by `mlx_lm.load`, decoded
greedily one request at a time and as one padded batch through `BatchGenerator`."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx_lm.generate import BatchGenerator, generate_step

from .train import BuildError, Example

# Decoding runs this far past the scripted length, so a missing eos shows up.
_SLACK_TOKENS = 8


def generate_single(
    model: nn.Module, prompt: Sequence[int], max_tokens: int, eos_ids: Collection[int]
) -> list[int]:
    """Greedy tokens for one prompt, up to and including the first eos."""
    tokens: list[int] = []
    for token, _ in generate_step(mx.array(list(prompt)), model, max_tokens=max_tokens):
        tokens.append(int(token))
        if tokens[-1] in eos_ids:
            break
    return tokens


def generate_batched(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    eos_ids: Collection[int],
) -> list[list[int]]:
    """Greedy tokens per prompt, all decoded together (prompts of unequal length are
    padded by the batch cache), each up to and including its eos."""
    generator = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=[[t] for t in eos_ids])
    try:
        uids = generator.insert([list(p) for p in prompts])
        out: dict[int, list[int]] = {uid: [] for uid in uids}
        while responses := generator.next_generated():
            for response in responses:
                out[response.uid].append(response.token)
    finally:
        generator.close()
    return [out[uid] for uid in uids]


def verify_model_dir(path: Path, examples: Sequence[Example]) -> None:
    """Raise BuildError naming every script the saved model does not reproduce.

    With no examples (random weights) this only proves the directory loads.
    """
    model, tokenizer = mlx_lm.load(str(path))[:2]
    if not examples:
        return
    eos_ids = tokenizer.eos_token_ids
    max_tokens = max(len(e.completion) for e in examples) + _SLACK_TOKENS
    batched = generate_batched(model, [e.prompt for e in examples], max_tokens, eos_ids)
    failures = []
    for example, batch_tokens in zip(examples, batched, strict=True):
        expected = list(example.completion)
        single = generate_single(model, example.prompt, max_tokens, eos_ids)
        for mode, got in (("single", single), ("batched", batch_tokens)):
            if got != expected:
                failures.append(
                    f"{example.script_id} ({mode}): expected "
                    f"{tokenizer.decode(expected)!r}, got {tokenizer.decode(got)!r}"
                )
    if failures:
        raise BuildError("built model does not reproduce its scripts:\n" + "\n".join(failures))
