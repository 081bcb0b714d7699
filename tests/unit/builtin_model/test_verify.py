"""The built-in model's check (replicas/builtin/verify.py): alone, a script is checked
teacher-forced in one pass; that pass agrees with mlx-lm's own greedy decoding token by
token, and a script the model does not reproduce fails the check, named."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step

from replicas.builtin import ensure_builtin, load_scripts
from replicas.builtin.build import _examples
from replicas.builtin.train import BuildError, Example
from replicas.builtin.verify import forced_argmax, verify_model_dir


def _greedy(model: object, prompt: tuple[int, ...], max_tokens: int, eos: set[int]) -> list[int]:
    tokens: list[int] = []
    for token, _ in generate_step(mx.array(list(prompt)), model, max_tokens=max_tokens):
        tokens.append(int(token))
        if tokens[-1] in eos:
            break
    return tokens


@pytest.fixture(scope="module")
def tiny() -> tuple[Path, list[Example]]:
    path = ensure_builtin("tiny")
    tokenizer = mlx_lm.load(str(path))[1]
    return path, _examples(path, load_scripts(), min(tokenizer.eos_token_ids))


def test_the_one_pass_check_agrees_with_greedy_decoding(tiny: tuple[Path, list[Example]]) -> None:
    path, examples = tiny
    model, tokenizer = mlx_lm.load(str(path))[:2]
    eos = set(tokenizer.eos_token_ids)
    for example in examples[:6]:
        greedy = _greedy(model, example.prompt, len(example.completion) + 8, eos)
        assert greedy == list(example.completion)
        assert forced_argmax(model, example.prompt, example.completion) == greedy
    # A completion the model would not write: the forced pass shows where it departs, as
    # greedy decoding would (its first token differs).
    first = examples[0]
    wrong = (first.completion[1], *first.completion[1:])
    forced = forced_argmax(model, first.prompt, wrong)
    assert forced[0] == first.completion[0] != wrong[0]


def test_a_script_the_model_does_not_reproduce_fails_the_check(
        tiny: tuple[Path, list[Example]]) -> None:
    path, examples = tiny
    good = examples[0]
    bad = next(e for e in examples if e.completion != good.completion)
    swapped = Example(bad.script_id, bad.prompt, good.completion)
    with pytest.raises(BuildError) as failed:
        verify_model_dir(path, [good, swapped])
    message = str(failed.value)
    assert f"{bad.script_id} (single)" in message and f"{bad.script_id} (batched)" in message
    assert f"{good.script_id} (" not in message
