"""The draft model's batch (`replicas.engine.draft_model.ModelDrafter`) keeps each row's
cache true to its sequence while rows join, leave, keep some drafts and reject the rest:
every draft equals what the draft model writes greedily for that row alone, from scratch."""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from replicas.engine.config import SpeculativeConfig
from replicas.engine.draft_model import ModelDrafter
from replicas.engine.loading import load_model
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


def test_rows_joining_leaving_and_rejecting_drafts_draft_as_alone() -> None:
    model = load_model("builtin:tiny", resolve_source("builtin:tiny")).model
    drafter = ModelDrafter(SpeculativeConfig(num_speculative_tokens=3), model, prefill_step=8)
    rng = random.Random(7)
    rows = {uid: [rng.randrange(3, 200) for _ in range(rng.randrange(2, 20))]
            for uid in range(3)}
    next_uid = 3
    for step in range(12):
        if step == 4:
            del rows[1]  # a row finished
        if step in (2, 6):  # a row joins with a longer prompt than the prefill step
            rows[next_uid] = [rng.randrange(3, 200) for _ in range(rng.randrange(10, 30))]
            next_uid += 1
        asks = [(uid, seq[:-1], seq[-1], 3) for uid, seq in rows.items()]
        drafts = drafter.draft_rows(asks)
        for (uid, _, _, _), draft in zip(asks, drafts):
            assert draft == alone(model, rows[uid], len(draft)), (step, uid)
            assert len(draft) >= 1
            # The target keeps some drafts (none, some, all), then its own token.
            kept = rng.randrange(0, len(draft) + 1)
            rows[uid] = rows[uid] + draft[:kept] + [rng.randrange(3, 200)]
        drafter.keep(list(rows))
