"""Teach a freshly initialized qwen3 model the scripts by gradient descent in MLX.

Full-batch AdamW with the loss on completion tokens only (the prompt is context,
not something to imitate). Training stops once teacher-forced argmax reproduces
every scripted token by a wide logit margin, and fails, naming the scripts, if the
step budget runs out first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim

from ..startup import report as report_progress
from .recipe import Training

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Example:
    """One script as token ids: the rendered prompt, then what the model must generate."""

    # The script's id; for the rendering a script does not name (scripts.renderings) its
    # label, `ID@thinking-on` or `ID@thinking-off`.
    script_id: str
    prompt: tuple[int, ...]
    completion: tuple[int, ...]


@dataclass(frozen=True)
class TrainingReport:
    steps: int
    seconds: float
    loss: float
    min_margin: float


class BuildError(RuntimeError):
    """A built-in model could not be made to reproduce its scripts."""


@dataclass(frozen=True)
class _Batch:
    """Examples packed end to end into rows, each attending only within itself.

    Packing wastes far fewer positions than padding every example to the longest
    (mlx's CPU matmuls are slow, so that matters), and since RoPE attention depends
    only on relative positions, an example computes the same thing at any offset.
    """

    inputs: mx.array  # (R, L) tokens fed to the model
    targets: mx.array  # (R, L) the next token at each position
    mask: mx.array  # (R, L) 1.0 where the target is a completion token
    attention: mx.array  # (R, 1, L, L) causal within each example's segment
    owners: tuple[tuple[int, ...], ...]  # per row, the example index at each position


def _pack(examples: Sequence[Example], pad_id: int) -> _Batch:
    # First-fit decreasing into rows as long as the longest example.
    lengths = [len(e.prompt) + len(e.completion) - 1 for e in examples]
    width = max(lengths)
    rows: list[list[int]] = []
    for index in sorted(range(len(examples)), key=lambda i: -lengths[i]):
        row = next((r for r in rows if sum(lengths[i] for i in r) + lengths[index] <= width), None)
        if row is None:
            rows.append([index])
        else:
            row.append(index)

    inputs, targets, mask, owners = [], [], [], []
    for row in rows:
        r_in: list[int] = []
        r_tg: list[int] = []
        r_mask: list[float] = []
        r_own: list[int] = []
        for index in row:
            e = examples[index]
            seq = list(e.prompt + e.completion)
            r_in += seq[:-1]
            r_tg += seq[1:]
            # Position i predicts seq[i + 1]; completion tokens start at len(prompt).
            r_mask += [0.0] * (len(e.prompt) - 1) + [1.0] * len(e.completion)
            r_own += [index] * (len(seq) - 1)
        pad = width - len(r_in)
        # Padding is its own segment (-1), so its rows of attention are never empty.
        inputs.append(r_in + [pad_id] * pad)
        targets.append(r_tg + [pad_id] * pad)
        mask.append(r_mask + [0.0] * pad)
        owners.append(tuple(r_own + [-1] * pad))
    segment = mx.array(owners)
    same = segment[:, :, None] == segment[:, None, :]
    causal = mx.tril(mx.ones((width, width), dtype=mx.bool_))
    return _Batch(
        mx.array(inputs),
        mx.array(targets),
        mx.array(mask),
        (same & causal)[:, None],
        tuple(owners),
    )


def _logits(model: nn.Module, batch: _Batch) -> mx.array:
    # qwen3.Model's own forward, but with the packed attention mask.
    body = model.model
    h = body.embed_tokens(batch.inputs)
    for layer in body.layers:
        h = layer(h, batch.attention, None)
    h = body.norm(h)
    if model.args.tie_word_embeddings:
        return body.embed_tokens.as_linear(h)
    return model.lm_head(h)


def _loss(model: nn.Module, batch: _Batch) -> mx.array:
    losses = nn.losses.cross_entropy(_logits(model, batch), batch.targets, reduction="none")
    return (losses * batch.mask).sum() / batch.mask.sum()


def _margins(model: nn.Module, batch: _Batch, examples: Sequence[Example]) -> dict[str, float]:
    """Per script, the smallest gap between a scripted token's logit and the best other
    token's, over all completion positions (negative: argmax would go astray there)."""
    logits = _logits(model, batch)
    target = mx.take_along_axis(logits, batch.targets[..., None], axis=-1)[..., 0]
    others = mx.put_along_axis(
        logits, batch.targets[..., None], mx.array(-mx.inf, dtype=logits.dtype), axis=-1
    )
    masked = mx.where(batch.mask > 0, target - others.max(axis=-1), mx.inf)
    gaps = cast(list[list[float]], masked.tolist())  # a 2-D float array
    result = {e.script_id: float("inf") for e in examples}
    for row_owners, row_gaps in zip(batch.owners, gaps, strict=True):
        for owner, gap in zip(row_owners, row_gaps, strict=True):
            if owner >= 0:
                sid = examples[owner].script_id
                result[sid] = min(result[sid], gap)
    return result


def train(
    model: nn.Module, examples: Sequence[Example], pad_id: int, plan: Training
) -> TrainingReport:
    """Train in place until every example clears `plan.min_margin`."""
    batch = _pack(examples, pad_id)
    schedule = optim.linear_schedule(1e-6, plan.learning_rate, plan.warmup_steps)
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=plan.weight_decay)
    # The optimizer state must exist before compiling so the step can update it.
    optimizer.init(model.trainable_parameters())
    loss_and_grad = nn.value_and_grad(model, _loss)
    state = [model.state, optimizer.state]

    def step() -> mx.array:
        loss, grads = loss_and_grad(model, batch)
        optimizer.update(model, grads)
        return loss

    compiled_step = mx.compile(step, inputs=state, outputs=state)
    start = time.perf_counter()
    loss = mx.array(0.0)
    gaps: dict[str, float] = {}
    checked = "margin not checked yet"
    for steps in range(1, plan.max_steps + 1):
        loss = compiled_step()
        mx.eval(state, loss)
        if steps % plan.check_every == 0 or steps == plan.max_steps:
            gaps = _margins(model, batch, examples)
            checked = f"min margin {min(gaps.values()):.2f} at step {steps}"
            log.info("step %d: loss %.4g, min margin %.3f", steps, loss.item(), min(gaps.values()))
            if min(gaps.values()) >= plan.min_margin:
                return TrainingReport(
                    steps, time.perf_counter() - start, cast(float, loss.item()), min(gaps.values())
                )
        # For the build's heartbeat: what is known, the steps and the last margin checked.
        # Not a share of max_steps: training stops once the margin is met, usually far sooner.
        report_progress(f"training step {steps}, {checked}; it stops once the margin "
                        f"reaches {plan.min_margin:g}")
    short = sorted(sid for sid, g in gaps.items() if g < plan.min_margin)
    raise BuildError(
        f"after {plan.max_steps} steps (loss {loss.item():.4g}) these scripts still miss "
        f"the {plan.min_margin} logit margin: {', '.join(short)}"
    )
