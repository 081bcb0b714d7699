"""The draft model's batch (`replicas.engine.spec.draft_model.ModelDrafter`) keeps each row's
cache true to its sequence while rows join, leave, keep some drafts and reject the rest:
every greedy row's draft equals what the draft model writes greedily for that row alone,
from scratch, and a sampled row's drafts come with the distribution the draft model gives
that row alone, under the row's sampling shape (the q of the q/p rule)."""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from replicas.engine.config import SpeculativeConfig
from replicas.engine.spec.draft_model import ModelDrafter
from replicas.engine.model.loading import load_model
from replicas.engine.sampling.samplers import SamplingShape
from replicas.engine.spec.drafter import Ask
from replicas.sources import resolve_source


def alone(model: Any, sequence: list[int], n: int) -> list[int]:
    """Greedy tokens after `sequence`, one row, a fresh cache."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([sequence]), cache=cache)[0, -1]
    out: list[int] = []
    while True:
        out.append(int(mx.argmax(logits).item()))
        if len(out) == n:
            return out
        logits = model(mx.array([[out[-1]]]), cache=cache)[0, -1]


SHAPE = SamplingShape(temperature=0.8, top_p=0.9, min_p=0.0, top_k=20)
OTHER = SamplingShape(temperature=1.3, top_p=1.0, min_p=0.05, top_k=0)


def shape_of(uid: int) -> SamplingShape | None:
    """Even rows greedy; odd rows sampled, under two shapes (drawn as two groups)."""
    return None if uid % 2 == 0 else SHAPE if uid % 4 == 1 else OTHER


def test_rows_joining_leaving_and_rejecting_drafts_draft_as_alone() -> None:
    """Rows join with prompts longer than the prefill step, which they prefill across
    steps (drafting nothing meanwhile, while the target decodes them a token a pass);
    sampled rows of two shapes draft side by side (rows 1 and 3, at step 3)."""
    model = load_model("builtin:tiny", resolve_source("builtin:tiny")).model
    drafter = ModelDrafter(SpeculativeConfig(num_speculative_tokens=3), model, prefill_step=16)
    rng = random.Random(7)
    rows = {uid: [rng.randrange(3, 200) for _ in range(rng.randrange(2, 20))]
            for uid in range(3)}
    asked: dict[int, int] = {}  # the step each row first asked
    waited: dict[int, int] = {}  # the steps each row drafted nothing
    next_uid = 3
    mixed = 0  # steps where rows of both shapes drafted
    for step in range(14):
        if step == 4:
            del rows[1]  # a row finished
        if step in (2, 6):  # a row joins with a prompt longer than the prefill step
            rows[next_uid] = [rng.randrange(3, 200) for _ in range(rng.randrange(20, 40))]
            next_uid += 1
        asks = [Ask(uid, seq[:-1], seq[-1], 3, shape_of(uid))
                for uid, seq in rows.items()]
        drafts = drafter.draft_rows(asks)
        mixed += len({a.shape for a, d in zip(asks, drafts) if d and a.shape}) > 1
        for ask, draft in zip(asks, drafts):
            uid = ask.uid
            asked.setdefault(uid, step)
            q = drafter.sampled(uid)
            if not draft:  # still prefilling: only before its first draft
                assert uid not in waited or waited[uid] == step - asked[uid], (step, uid)
                waited[uid] = waited.get(uid, 0) + 1
                assert q is None
            elif ask.shape is None:
                assert draft == alone(model, rows[uid], len(draft)), (step, uid)
                assert q is None
            else:
                assert q is not None and q.shape[0] == len(draft)
                for j in range(len(draft)):
                    logits = model(mx.array([rows[uid] + draft[:j]]))[:, -1]
                    assert mx.allclose(q[j], ask.shape.logprobs(logits)[0], atol=1e-4), \
                        (step, j)
                    assert q[j, draft[j]].item() > -30  # drawn from q: never a filtered token
            # The target keeps some drafts (none, some, all), then its own token.
            kept = rng.randrange(0, len(draft) + 1)
            rows[uid] = rows[uid] + draft[:kept] + [rng.randrange(3, 200)]
        drafter.keep(list(rows))
    # The joiners (20-40 tokens, 16 a step) waited one step or two, and all drafted since.
    assert all(1 <= waited.get(uid, 0) <= 3 for uid in (3, 4)), waited
    assert all(step - asked[uid] > waited.get(uid, 0) for uid in rows)
    assert mixed >= 1  # the two shapes were drawn side by side, as two groups
