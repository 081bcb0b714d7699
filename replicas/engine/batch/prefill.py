"""The prefilling half of the batch: mlx-lm's `PromptProcessingBatch`, with two changes.

A request's prompt is prefilled but for its last token; mlx-lm then runs that token in a
pass of the joining rows alone (`PromptProcessingBatch.generate` steps the new
`GenerationBatch` at once) before they join the decoding rows. On a Mac a decode pass
costs a read of all the weights whatever its rows, so each arrival cost a pass. Here the
joining rows hand that token to the decoding batch instead (`Generation(joining=True)`),
and it goes through in the batch's next pass with everyone else's tokens.

Speculation keeps mlx-lm's way: its drafters start a row from its first sampled token.

Everything stays on the batch's one stream. A second stream for the prefill (so waiting
for it would not wait for the decode pass in flight too) was tried and taken out: CI's
test process segfaulted with it (load/RESULTS.md, "Rows join the batch's pass").
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, ContextManager

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch

from replicas.engine.batch.decode import Generation
from replicas.engine.model.lora import Slots
from replicas.engine.model.mrope import RowPositions


class Prefilling(PromptProcessingBatch):
    """Rows being prefilled. `in_pass`: joining rows' last prompt tokens ride in the
    decoding batch's next pass (mlx-lm 0.32.2's attributes, as `generate` reads them)."""

    in_pass = True
    slots: Slots | None = None  # the rows' LoRA adapters (`replicas.engine.model.lora`)
    positions: RowPositions | None = None  # M-RoPE rows' deltas (`model.mrope`)

    def _copy(self) -> Prefilling:
        new: Prefilling = super()._copy()  # `split`'s copy: mlx-lm copies its own fields
        new.in_pass = self.in_pass
        new.slots = self.slots
        new.positions = self.positions
        return new

    def _adapted(self) -> ContextManager[Any]:
        """Each row's adapter (and M-RoPE position delta) for the passes built meanwhile."""
        stack = ExitStack()
        if self.slots is not None:
            stack.enter_context(self.slots.of(self.uids))
        if self.positions is not None:
            stack.enter_context(self.positions.of(self.uids))
        return stack

    def prompt(self, tokens: list[list[int]]) -> None:
        with self._adapted():
            super().prompt(tokens)

    def generate(self, tokens: list[list[int]]) -> GenerationBatch:
        if not self.in_pass:  # mlx-lm's new batch runs the joining rows' pass at once
            with self._adapted():
                return super().generate(tokens)
        if any(len(t) > 1 for t in tokens):
            self.prompt([t[:-1] for t in tokens])
        joining: Any = Generation(
            self.model, self.uids, mx.array([t[-1] for t in tokens]), self.prompt_cache,
            self.tokens, self.samplers, self.fallback_sampler, self.logits_processors,
            self.stop_sequences, self.max_tokens, joining=True)
        # The rows now belong to the decoding batch, as after mlx-lm's own `generate`.
        self.uids, self.prompt_cache, self.tokens = [], [], []
        self.samplers, self.logits_processors, self.max_tokens = [], [], []
        return joining
