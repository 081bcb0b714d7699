"""Check a built model the way production runs it: loaded by `mlx_lm.load`, decoded
greedily as one padded batch through `BatchGenerator`, and each request alone.

Alone, a request is checked teacher-forced: one forward over its prompt and scripted
completion, whose argmax at every completion position must be the scripted token. Greedy
decoding then yields exactly the completion (it holds one eos, at its end), so this checks
what decoding one token at a time does, in one pass instead of one per token: on the
2-core box that was half of the first `serve run`'s check (load/results/first_answer.md).
The batched pass still decodes token by token, through the KV cache. On a CPU the two
passes run at once, on two threads."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from .train import BuildError, Example

# Decoding runs this far past the scripted length, so a missing eos shows up.
_SLACK_TOKENS = 8


def forced_argmax(model: nn.Module, prompt: Sequence[int], completion: Sequence[int]
                  ) -> list[int]:
    """The model's greedy token at each completion position, given the prompt and the
    scripted completion before it (teacher forcing)."""
    cache = make_prompt_cache(model)
    if len(prompt) > 1:
        # Prefilled into the cache only: its logits are never evaluated (MLX is lazy), so
        # the output head runs on the completion's positions alone.
        model(mx.array([list(prompt[:-1])]), cache=cache)
        mx.eval([c.state for c in cache])
    logits = model(mx.array([[prompt[-1], *completion[:-1]]]), cache=cache)[0]
    greedy: list[int] = mx.argmax(logits, axis=-1).tolist()  # type: ignore[assignment]
    return greedy


def _forced_all(path: Path, examples: Sequence[Example]) -> list[list[int]]:
    """`forced_argmax` of every example, on a model loaded in the calling thread."""
    model = load_model(path)[0]
    return [forced_argmax(model, e.prompt, e.completion) for e in examples]


def _until_eos(tokens: Sequence[int], eos_ids: Collection[int]) -> list[int]:
    """`tokens` up to and including the first eos, as greedy decoding would stop."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return list(tokens[:i + 1])
    return list(tokens)


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
    prompts = [e.prompt for e in examples]
    if mx.default_device() == mx.cpu:
        # On a CPU (a Linux box: MLX's single-threaded reference BLAS) the two passes run
        # at once, each on its own thread with its own copy of the model (MLX evaluates
        # per thread), so a 2-core machine checks in about half the time. On a Mac's GPU
        # the whole check takes well under a second: one thread.
        with ThreadPoolExecutor(1, thread_name_prefix="orchard-verify") as pool:
            alone = pool.submit(_forced_all, path, examples)
            batched = generate_batched(model, prompts, max_tokens, eos_ids)
            forced_all = alone.result()
    else:
        batched = generate_batched(model, prompts, max_tokens, eos_ids)
        forced_all = [forced_argmax(model, e.prompt, e.completion) for e in examples]
    failures = []
    for example, batch_tokens, forced in zip(examples, batched, forced_all, strict=True):
        expected = list(example.completion)
        single = expected if forced == expected else _until_eos(forced, eos_ids)
        for mode, got in (("single", single), ("batched", batch_tokens)):
            if got != expected:
                failures.append(
                    f"{example.script_id} ({mode}): expected "
                    f"{tokenizer.decode(expected)!r}, got {tokenizer.decode(got)!r}"
                )
    if failures:
        raise BuildError("built model does not reproduce its scripts:\n" + "\n".join(failures))
