"""The decoding half of the batch: mlx-lm's `GenerationBatch`, with two changes to its step.

- **Bias and penalties for the whole batch at once** (`replicas.engine.sampling.penalties`). mlx-lm
  runs any row's logits processors in a Python loop, so one `logit_bias` sends every row
  through it. Here only a request's own processors (the pipeline's grammar mask, budgets,
  bans) are called per row, and only for the rows that have them.
- **New rows join the batch's next pass** (`joining`, built by `replicas.engine.batch.prefill`).
  mlx-lm runs a joining row's last prompt token in a pass of the new rows alone, a whole
  pass over the weights per arrival; here that token rides in the batch's next pass, and
  the row emits nothing until the pass after.
- **Speculative decoding** (`replicas.engine.spec.drafter`): a step may verify each row's
  drafts in the same pass, and emit several tokens per row. On a sharded replica rank 0
  decides the drafts and what was kept, and shares both (`replicas.engine.spec.sharded`).

Everything else is mlx-lm's: the cache, the one-step-ahead pipelining of the plain step,
`extend`/`filter`/`extract_cache`, stop matching, and `BatchGenerator` around it (which
builds a batch of the joining rows, then `extend`s this one with it).
We override `_step`, `next`, `extend` and `filter`, pinned to mlx-lm 0.32.2's attributes.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Sequence, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationBatch

from replicas.engine.model.lora import Slots
from replicas.engine.model.mrope import RowPositions
from replicas.engine.model.mtp import hidden_and_logits
from replicas.engine.sampling.penalties import Penalties, apply, window
from replicas.engine.sampling.rejection import accepted, judge, verdict
from replicas.engine.sampling.samplers import Drafting, LogitsProcessor, Sampler, SamplingShape, \
    SeededSampler, SharedSampler
from replicas.engine.spec.sharded import SharedDrafts
from replicas.engine.spec.gate import SpeculationGate
from replicas.engine.spec.drafter import Ask, DecodeStats, Drafter
from replicas.engine.spec.tails import Order, drop_tails, in_order, rotated

Emitted = list[tuple[int, mx.array]]  # one row's tokens of a step, each with its logprobs


def _local(sampler: Sampler) -> Sampler | None:
    """The sampler this rank runs itself: a lockstep sampler's rank-0 sampler (None on
    the other ranks), else the sampler itself."""
    return getattr(sampler, "local", sampler)


class Generation(GenerationBatch):
    """The rows that decode. Engine thread only."""

    def __init__(self, *args: Any, joining: bool = False, **kwargs: Any) -> None:
        """`joining`: rows whose pending token is their prompt's last (mlx-lm's constructor
        would run it at once, in a pass of their own)."""
        self.stats = DecodeStats()
        self.drafter: Drafter | None = None
        # This step's rows whose drafts the drafter sampled: the distribution of each.
        self._sampled: dict[int, mx.array] = {}
        self._orders: list[Order | None] = []  # per row: its slot order (`tails`)
        self.shared: SharedDrafts | None = None  # a sharded replica's
        self.gate: SpeculationGate | None = None  # whether drafting pays at this size
        self.held = False  # `next` steps nothing while set (`replicas.engine.batch.local`)
        self.slots: Slots | None = None  # the rows' LoRA adapters (`replicas.engine.model.lora`)
        self.positions: RowPositions | None = None  # M-RoPE rows' deltas (`model.mrope`)
        self._joining = joining
        super().__init__(*args, **kwargs)
        self._joining = False
        # Per row: its pending token is a prompt token, so its next pass emits nothing.
        self._fresh = [joining] * len(self.uids)
        self._joined = len(self.uids) if joining else 0  # how many are
        if joining:
            self._next_logprobs = [None] * len(self.uids)  # type: ignore[list-item]

    @classmethod
    def make(cls, model: nn.Module, sampler: Sampler, drafter: Drafter | None,
             shared: SharedDrafts | None = None,
             gate: SpeculationGate | None = None) -> Generation:
        """`drafter`: None without speculation; `gate`: None to draft at every size."""
        batch = cls.empty(model, sampler)
        batch.drafter = drafter
        batch.shared = shared
        batch.gate = gate
        return batch

    def next(self) -> list[GenerationBatch.Response]:
        """Each row's tokens of one pass (one, or more when drafts were kept), as mlx-lm's
        responses; a row that ends mid-way drops the rest and leaves the batch."""
        if not self.uids or self.held:
            return []
        rows = len(self.uids)
        # Rows that join in this pass are only ever built without a drafter (`prefilling`).
        active = self.drafter is not None and not self._joined and self.drafter.active(rows)
        if self.gate is not None and not active:
            self.gate.pause()  # a plain step by config is neither mode's measure
        drafting = (self._drafts(self.gate is None or self.gate.allow(rows))
                    if active else None)
        emitted: list[Emitted]
        prompts = self._joined  # rows whose pass is their prompt's last token's, not a decode
        if drafting is None:
            tokens, lps = self._step()
            emitted = [[(t, lp)] for t, lp in zip(tokens, lps)]
            if self._joined:  # their prompts' last tokens went in: their first comes next
                emitted = [[] if new else row for new, row in zip(self._fresh, emitted)]
                self._fresh, self._joined = [False] * rows, 0
            if self.drafter is not None:  # resting rows count the steps to their probe
                for uid in self.uids:
                    self.drafter.observe(uid, 0, 0)
        else:
            emitted = self._speculate(*drafting)
        self.stats.passes += len(self.uids) - prompts
        keep, responses = [], []
        for i, row in enumerate(emitted):
            finish = None
            for at, (token, logprobs) in enumerate(row):
                self.stats.tokens += 1
                self.stats.accepted += at > 0  # a kept draft, emitted
                self._num_tokens[i] += 1
                if self._num_tokens[i] >= self.max_tokens[i]:
                    finish = "length"
                if self._matchers[i].advance(token):
                    finish = "stop"
                if finish is not None:
                    responses.append(self.Response(self.uids[i], token, logprobs, finish,
                                                   self.extract_cache(i), self.tokens[i]))
                    break
                responses.append(self.Response(self.uids[i], token, logprobs, None, None,
                                               None))
            if finish is None:
                keep.append(i)
        if len(keep) < len(self.uids):
            self.filter(keep)
        if self.gate is not None:
            self.gate.emitted(len(responses), drafting is not None)
            if not self.uids:
                self.gate.pause()
        return responses

    def filter(self, keep: list[int]) -> None:
        super().filter(keep)
        self._orders = [self._orders[i] for i in keep]
        self._fresh = [self._fresh[i] for i in keep]
        self._joined = sum(self._fresh)
        if self.drafter is not None:
            self.drafter.keep(self.uids)

    def extend(self, batch: GenerationBatch) -> None:
        super().extend(batch)
        self._orders += [None] * (len(self.uids) - len(self._orders))
        fresh = getattr(batch, "_fresh", None) or [False] * len(batch.uids)
        self._fresh += fresh
        self._joined += sum(fresh)

    def extract_cache(self, idx: int) -> list[Any]:
        """Row `idx`'s cache with its positions in order (speculation may have moved its
        oldest slots: `replicas.engine.spec.tails`)."""
        return in_order(super().extract_cache(idx), self._orders[idx])

    def _step(self) -> tuple[list[int], list[mx.array]]:
        """mlx-lm's plain step (the next step's forward queued before this one's tokens are
        read), with the batch's bias and penalties applied in one go."""
        if self._joining:  # mlx-lm's constructor: the batch's next pass runs these rows
            return [], []
        inputs: mx.array = self._next_tokens
        self._current_tokens = inputs  # type: ignore[assignment]  # mlx-lm inits it None
        self._current_logprobs = self._next_logprobs
        logits, hidden = self._forward(inputs[:, None])
        logits = logits[:, -1, :]
        penalties = self._penalties()
        looks_back = any(p and p.looks_back for p in penalties)
        logits = apply(logits, penalties, window(self.tokens, inputs) if looks_back else None)
        logits, context = self._own(logits, range(len(self.uids)), inputs)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        self._next_tokens = self._sample(logprobs, 1)
        self._next_logprobs = list(logprobs)
        if hidden is not None and self.drafter is not None:
            self.drafter.saw(self.uids, hidden, self._next_tokens[:, None], [1] * len(self.uids))
        mx.async_eval(self._next_tokens, self._next_logprobs, context)
        mx.eval(inputs, self._current_logprobs)
        tokens: list[int] = inputs.tolist()  # type: ignore[assignment]
        for held, token in zip(self.tokens, tokens):
            held.append(token)
        return tokens, self._current_logprobs

    def _forward(self, inputs: mx.array) -> tuple[mx.array, mx.array | None]:
        """The model's logits over `inputs`, and its last hidden states where the drafter
        reads them (MTP). Each row with its own LoRA adapter, where any has one, and its
        own position delta, where the model has M-RoPE."""
        with self.positions.of(self.uids) if self.positions is not None else nullcontext():
            if self.slots is not None and self.slots.by_uid:
                with self.slots.of(self.uids):
                    return self._forward_rows(inputs)
            return self._forward_rows(inputs)

    def _forward_rows(self, inputs: mx.array) -> tuple[mx.array, mx.array | None]:
        if self.drafter is not None and self.drafter.wants_hidden:
            hidden, logits = hidden_and_logits(self.model, inputs, self.prompt_cache)
            return logits, hidden
        return self.model(inputs, cache=self.prompt_cache), None

    def _drafts(self, allowed: bool) -> tuple[list[int], list[list[int]]] | None:
        """Each row's pending token and its drafts, or None for a plain step. Drafting
        reads the pending tokens, so it waits for the step computed ahead. Not `allowed`
        (the gate found drafting slower at this size): no drafts, decided on rank 0."""
        drafter, shared = self.drafter, self.shared
        assert drafter is not None
        if shared is None and not allowed:
            return None  # a plain step, without waiting for the pending tokens
        limit = drafter.config.num_speculative_tokens if allowed else 0
        budgets = [min(limit, self.max_tokens[i] - self._num_tokens[i] - 1)
                   for i in range(len(self.uids))]
        if shared is None and not any(drafter.limit(uid, b) for uid, b in zip(self.uids, budgets)) \
                and not any(isinstance(p, Drafting) for i in range(len(self.uids))
                            for p in self._own_processors(i)):
            return None  # every row rests: a plain step, without waiting for the pending tokens
        pending: list[int] = self._next_tokens.tolist()  # type: ignore[assignment]
        drafts: list[list[int]] = []
        if shared is None or shared.leads:
            forced = [self._forced(i, pending[i], b) for i, b in enumerate(budgets)]
            # A row its grammar drafts for asks the drafter for nothing (budget 0).
            guessed = drafter.draft_rows([Ask(uid, self.tokens[i], pending[i],
                                              0 if forced[i] else budgets[i], self._shape(i))
                                          for i, uid in enumerate(self.uids)])
            drafts = [f or g for f, g in zip(forced, guessed)]
            self._sampled = {i: q for i, uid in enumerate(self.uids)
                             if not forced[i] and (q := drafter.sampled(uid)) is not None}
        if shared is not None:
            drafts = shared.drafts(drafts, len(self.uids))
        return (pending, drafts) if any(drafts) else None

    def _forced(self, i: int, pending: int, budget: int) -> list[int]:
        """What row `i`'s own processors say must follow `pending` (grammar fast-forward):
        certain where the n-grams only guess, so it comes first."""
        for processor in self._own_processors(i):
            if isinstance(processor, Drafting) and (forced := processor.draft(pending, budget)):
                self.stats.forced += len(forced)
                return forced
        return []

    def _speculate(self, pending: list[int], drafts: list[list[int]]) -> list[Emitted]:
        """One pass over every row's pending token and drafts; each row emits its pending
        token and the drafts the target sampled too, and the target's next token becomes
        its pending one."""
        rows, width = len(pending), 1 + max(len(d) for d in drafts)
        inputs = [[p, *d] + [p] * (width - 1 - len(d)) for p, d in zip(pending, drafts)]
        logits, hidden = self._forward(mx.array(inputs))
        logits = logits.reshape(rows * width, logits.shape[-1])
        penalties = [p for p in self._penalties() for _ in range(width)]
        looks_back = any(p and p.looks_back for p in penalties)
        logits = apply(logits, penalties,
                       [[*self.tokens[i], *inputs[i][:j + 1]]
                        for i in range(rows) for j in range(width)] if looks_back else None)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampled = self._sample(logprobs, width)
        mx.eval(sampled, logprobs)
        table: list[list[int]] = sampled.reshape(rows, width).tolist()  # type: ignore[assignment]
        kept = accepted(drafts, table)
        nexts = [table[i][n] for i, n in enumerate(kept)]
        self._judge(drafts, logprobs, width, table, kept, nexts)
        positions = [[logprobs[i * width + j] for j in range(n + 1)] for i, n in enumerate(kept)]
        for i in range(rows):
            if self._own_processors(i):
                kept[i], nexts[i], positions[i] = self._verify_own(
                    i, inputs[i], drafts[i], logits[i * width:(i + 1) * width])
        if self.shared is not None:  # rank 0's own processors decided some rows
            kept, nexts = self.shared.verdicts(kept, nexts)
            positions = [[logprobs[i * width + j] for j in range(n + 1)]
                         for i, n in enumerate(kept)] if not self.shared.leads else positions
        emitted: list[Emitted] = []
        for i, n in enumerate(kept):
            emitted.append([(pending[i], self._next_logprobs[i])]
                           + [(drafts[i][j], positions[i][j]) for j in range(n)])
            self.tokens[i].extend(inputs[i][:n + 1])
            if isinstance(sampler := _local(self._sampler(i)), SeededSampler):
                sampler.advance(n + 1)
        if hidden is not None and self.drafter is not None:  # each kept position, its next
            following = [[*drafts[i][:n], nexts[i]] for i, n in enumerate(kept)]
            self.drafter.saw(self.uids, hidden,
                             mx.array([f + [0] * (width - len(f)) for f in following]),
                             [n + 1 for n in kept])
        moved = drop_tails(self.prompt_cache, [width - 1 - n for n in kept])
        self._orders = [rotated(order, len(held), m)
                        for order, held, m in zip(self._orders, self.tokens, moved)]
        self._next_tokens = mx.array(nexts)
        self._next_logprobs = [positions[i][n] for i, n in enumerate(kept)]
        self.stats.drafted += sum(len(d) for d in drafts)
        if self.drafter is not None:
            for uid, draft, n in zip(self.uids, drafts, kept):
                self.drafter.observe(uid, len(draft), n)
        return emitted

    def _shape(self, i: int) -> SamplingShape | None:
        """Row `i`'s sampling shape where its drafts may be sampled and judged by the q/p
        rule: an unseeded sampled row without its own processors (those read each kept
        token once, in order) on this rank."""
        sampler = _local(self._sampler(i))
        if self._own_processors(i) or not isinstance(sampler, SharedSampler):
            return None  # greedy, or seeded: drafts stay guesses (a seed's text is kept)
        return sampler.shape

    def _judge(self, drafts: list[list[int]], logprobs: mx.array, width: int,
               table: list[list[int]], kept: list[int], nexts: list[int]) -> None:
        """Rows whose drafts were sampled: kept and next token by the q/p rule instead of
        "sample, then compare" (in place). Rows that draw alike and drafted as many tokens
        are judged in one go: a few ops for the batch, not a few per row (on a GPU each op
        is a launch)."""
        sampled, self._sampled = self._sampled, {}
        groups: dict[tuple[SamplingShape, int], list[int]] = {}
        for i, q in sampled.items():
            shape = self._shape(i)
            assert shape is not None and q.shape[0] == len(drafts[i])
            groups.setdefault((shape, len(drafts[i])), []).append(i)
        if not groups:
            return
        by_row = logprobs.reshape(len(drafts), width, logprobs.shape[-1])
        judged = []
        for (shape, n), rows in groups.items():
            p = shape.logprobs(by_row[mx.array(rows), :n])
            q = mx.stack([sampled[i] for i in rows])
            judged.append((rows, n, *judge(p, q, mx.array([drafts[i] for i in rows]))))
        mx.eval([(keep, fix) for _, _, keep, fix in judged])
        for rows, n, keep, fix in judged:
            keeps = cast(list[list[bool]], keep.tolist())
            fixes = cast(list[list[int]], fix.tolist())
            for i, row_keep, row_fix in zip(rows, keeps, fixes):
                kept[i], nexts[i] = verdict(row_keep, row_fix, table[i][n])

    def _verify_own(self, i: int, inputs: list[int], draft: list[int],
                    logits: mx.array) -> tuple[int, int, list[mx.array]]:
        """Row `i`'s drafts checked one position at a time through its own processors: a
        grammar or a budget is stateful, so it reads a token only once it is kept, exactly
        as in a plain step. Returns the drafts kept, the target's next token and each
        position's logprobs."""
        # This rank's own sampler: only rank 0 runs processors, so no collective here.
        own, sampler = self._own_processors(i), _local(self._sampler(i))
        assert sampler is not None  # rows with processors exist on rank 0 only
        positions = []
        for j in range(len(draft) + 1):
            context = self._token_context[i].update_and_fetch(mx.array(inputs[j:j + 1]))
            row = logits[j:j + 1]
            for processor in own:
                row = processor(context, row)
            row = row - mx.logsumexp(row, axis=-1, keepdims=True)
            token = sampler.ahead(row, skip=j) if isinstance(sampler, SeededSampler) \
                else sampler(row)
            positions.append(row[0])
            chosen = cast(int, token.item())
            self.stats.rows_off_path += 1
            if j == len(draft) or chosen != draft[j]:
                return j, chosen, positions
        raise AssertionError("unreachable: the last position always returns")

    def _penalties(self) -> list[Penalties | None]:
        return [next((p for p in ps or () if isinstance(p, Penalties)), None)
                for ps in self.logits_processors or ()]

    def _own_processors(self, i: int) -> list[LogitsProcessor]:
        processors = self.logits_processors[i] if self.logits_processors else ()
        return [p for p in processors or () if not isinstance(p, Penalties)]

    def _own(self, logits: mx.array, rows: Sequence[int],
             inputs: mx.array) -> tuple[mx.array, list[mx.array]]:
        """Rows' own processors, one row at a time, with the token context mlx-lm keeps
        for them (only rows that have some)."""
        at, processed, context = [], [], []
        for i in rows:
            own = self._own_processors(i)
            if not own:
                continue
            tokens = self._token_context[i].update_and_fetch(inputs[i:i + 1])
            row = logits[i:i + 1]
            for processor in own:
                row = processor(tokens, row)
            at.append(i)
            processed.append(row)
            context.append(tokens)
        if at:
            self.stats.rows_off_path += len(at)
            logits[mx.array(at)] = mx.concatenate(processed)
        return logits, context

    def _sampler(self, i: int) -> Sampler:
        sampler = self.samplers[i] if self.samplers else None
        return self.fallback_sampler if sampler is None else sampler

    def _sample(self, logprobs: mx.array, width: int) -> mx.array:
        """Every row's next token(s): one call when all rows share a sampler (mlx-lm's rule,
        which a sharded batch's samplers rely on), else row by row; `width` positions per
        row, where a seeded sampler draws ahead without spending its keys."""
        samplers = [self._sampler(i) for i in range(len(self.uids))]
        if all(s is samplers[0] for s in samplers) and not isinstance(samplers[0],
                                                                     SeededSampler):
            return samplers[0](logprobs)
        drawn = []
        for i, sampler in enumerate(samplers):
            rows = logprobs[i * width:(i + 1) * width]
            seeded = isinstance(sampler, SeededSampler) and width > 1
            drawn.append(sampler.ahead(rows) if seeded else sampler(rows))  # type: ignore
        return mx.concatenate(drawn)
