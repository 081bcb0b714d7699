"""Speculative decoding and batched penalties in the batch (`replicas.engine.batch.decode`),
on built-in models of several architectures loaded through the production loader.

Exactness: greedy and seeded output with speculation is the output without it, token for
token; unseeded samples keep the target's distribution (checked against the distribution
computed from mlx-lm's own model call and processors). A model whose cache cannot drop
rejected tokens decodes one token per pass. A biased row keeps the batch on its batched
path, and the batched path equals mlx-lm's own per-row processors.
"""

from __future__ import annotations

import math
import random
from functools import lru_cache
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

from replicas.contract import SamplingParams
from replicas.engine.batch.local import LocalBatch
from replicas.engine.batch.rows import Done, Row
from replicas.engine.config import EngineConfig, SpeculativeConfig
from replicas.engine.model.loading import load_model
from replicas.engine.sampling.penalties import PENALTY_CONTEXT, Penalties
from replicas.engine.sampling.samplers import GuardedProcessors, make_request_sampler
from replicas.engine.stats import DecodeCounts
from replicas.sources import resolve_source

# These tests watch the drafting itself: drafted at every size, whatever it costs here
# (the speculation gate, which would stop it where it is slower, has its own tests).
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1,
                         disable_when_slower=False)
# With a draft model, unseeded sampled rows draft samples, kept by the q/p rule.
DRAFTING = SpeculativeConfig(num_speculative_tokens=4, draft_model="builtin:tiny",
                             disable_when_slower=False)
# qwen3, qwen2, and the MLA families whose attention Orchard absorbs (`replicas.engine.model.mla`):
# DeepSeek V3, GLM-4.7-Flash, Mistral Small 4, LongCat-Flash (two attentions a layer, each
# layer's KV a `CacheList`).
ROLLS_BACK = ["builtin:tiny", "builtin:pipe", "builtin:arch-mla", "builtin:arch-glm-lite",
              "builtin:arch-mistral4", "builtin:arch-longcat"]
# gpt-oss's window, Nemotron-H's SSM, DeepSeek V3.2's sparse indexer (`can_roll_back`).
CANNOT = ["builtin:arch-sliding", "builtin:arch-ssm", "builtin:arch-dsv32"]
GREEDY = SamplingParams(temperature=0.0)


@lru_cache(maxsize=None)
def model(source: str) -> nn.Module:
    return load_model(source, resolve_source(source)).model


def prompts(vocab: int = 700, seed: int = 1) -> list[list[int]]:
    """Some that repeat a span (drafts hit), some that do not, of different lengths."""
    rng = random.Random(seed)
    span = [rng.randrange(vocab) for _ in range(24)]
    return [span * 3, [rng.randrange(vocab) for _ in range(9)], span[:6] * 5,
            [rng.randrange(vocab) for _ in range(40)], [11, 12, 13] * 8]


def decode(source: str, rows: Sequence[list[int]], params: Sequence[SamplingParams],
           spec: SpeculativeConfig | None, max_tokens: int | Sequence[int] = 48,
           stops: frozenset[int] = frozenset(), extra: dict[int, Any] | None = None,
           cache: bool = False, kv_bits: int | None = None, draft: str | None = None,
           batch_size: int | None = None
           ) -> tuple[list[list[int]], DecodeCounts, LocalBatch]:
    """Each row's generated tokens through a `LocalBatch` (the engine's batch); `draft`:
    the draft model's source, for `speculative.method: draft`; `batch_size`: rows prefilled
    and decoded together (None: the engine's defaults)."""
    sizes = {"max_batch_size": batch_size, "prefill_batch_size": batch_size} if batch_size else {}
    batch = LocalBatch(model(source), EngineConfig(
        speculative=spec, prompt_cache_bytes=1 << 30 if cache else 0, kv_bits=kv_bits,
        kv_group_size=32, **sizes),  # the built-in models' head_dim
        draft=model(draft) if draft else None)
    limits = [max_tokens] * len(rows) if isinstance(max_tokens, int) else list(max_tokens)
    made = []
    for i, (prompt, p, limit) in enumerate(zip(rows, params, limits)):
        own = (GuardedProcessors([extra[i]]),) if extra and i in extra else ()
        penalties = Penalties.of(p)
        made.append(Row(tuple(prompt), 0, limit, stops, make_request_sampler(p),
                        ((penalties,) if penalties else ()) + own))
    uids = [uid for uid, _ in batch.insert(made)]
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    while not batch.empty:
        for response in batch.step():
            out[response.uid].append(response.token)
            if response.finish_reason is not None:  # mlx-lm took it out: keep its KV
                batch.finish([Done(response.uid, keep=True)])
    return [out[u] for u in uids], batch.decode_counts(), batch


@pytest.mark.parametrize("source", ROLLS_BACK)
def test_greedy_output_is_the_output_without_speculation(source: str) -> None:
    rows = prompts()
    params = [GREEDY, SamplingParams(temperature=0.0, logit_bias={5: 3.0}),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4,
                             frequency_penalty=0.2), GREEDY, GREEDY]
    plain, plain_counts, _ = decode(source, rows, params, None)
    fast, counts, _ = decode(source, rows, params, SPEC)
    assert fast == plain
    assert plain_counts.passes == plain_counts.tokens  # one token per pass and row
    # Each row-pass emits its pending token and the drafts it kept.
    assert counts.speculative and counts.accepted > 0
    assert counts.tokens == plain_counts.tokens
    assert counts.passes == counts.tokens - counts.accepted < plain_counts.passes


@pytest.mark.parametrize("source", ROLLS_BACK)
def test_one_stream_equals_mlx_lms_own_generation(source: str) -> None:
    prompt = prompts()[0]
    cache = make_prompt_cache(model(source))
    expected = [int(t) for t, _ in zip(
        (tok for tok, _ in generate_step(mx.array(prompt), model(source), max_tokens=40,
                                         prompt_cache=cache)), range(40))]
    (got,), counts, _ = decode(source, [prompt], [GREEDY], SPEC, max_tokens=40)
    assert got == expected
    assert counts.passes < 40


def test_seeded_samples_are_the_samples_without_speculation() -> None:
    rows = prompts()
    params = [SamplingParams(temperature=0.7, seed=s, top_p=0.9 if s % 2 else 1.0)
              for s in range(len(rows))]
    plain, _, _ = decode("builtin:tiny", rows, params, None)
    fast, counts, _ = decode("builtin:tiny", rows, params, SPEC)
    assert fast == plain
    assert counts.drafted > 0


@pytest.mark.parametrize("source", CANNOT)
def test_a_cache_that_cannot_roll_back_decodes_one_token_per_pass(source: str) -> None:
    rows = prompts()[:3]
    plain, _, _ = decode(source, rows, [GREEDY] * 3, None)
    got, counts, _ = decode(source, rows, [GREEDY] * 3, SPEC)
    assert got == plain
    assert not counts.speculative and counts.drafted == 0
    assert counts.passes == counts.tokens == 3 * 48


def test_length_and_stop_ids_inside_a_run_of_kept_drafts() -> None:
    rows = prompts()
    plain, _, _ = decode("builtin:tiny", rows, [GREEDY] * 5, None)
    # A stop id each row's plain output reaches mid-way, and limits that land anywhere.
    stops = frozenset(out[17] for out in plain)
    limits = [7, 13, 29, 31, 3]
    want, _, _ = decode("builtin:tiny", rows, [GREEDY] * 5, None, limits, stops)
    got, counts, _ = decode("builtin:tiny", rows, [GREEDY] * 5, SPEC, limits, stops)
    assert got == want
    assert all(len(g) <= n for g, n in zip(got, limits))
    assert counts.accepted > 0


class Tracking:
    """A stateful processor, as the pipeline's controller is: it records each token it
    reads (the newest of its context) and bans token 7 after it has read token 3."""

    def __init__(self) -> None:
        self.read: list[int] = []

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self.read.append(int(tokens[-1].item()))
        return logits.at[:, 7].add(-1e9) if 3 in self.read else logits


def test_a_row_with_its_own_processor_drafts_and_it_reads_each_kept_token_once() -> None:
    rows = prompts()
    plain_reader, fast_reader = Tracking(), Tracking()
    plain, _, _ = decode("builtin:tiny", rows, [GREEDY] * 5, None, extra={2: plain_reader})
    got, counts, _ = decode("builtin:tiny", rows, [GREEDY] * 5, SPEC, extra={2: fast_reader})
    assert got == plain
    assert fast_reader.read == plain_reader.read  # the same calls, in the same order
    assert counts.rows_off_path == len(fast_reader.read) - 1  # the first is mlx-lm's call
    alone, alone_counts, _ = decode("builtin:tiny", [rows[2]], [GREEDY], SPEC,
                                    extra={0: Tracking()})
    assert alone == [plain[2]] and alone_counts.accepted > 0


@pytest.mark.parametrize("source", ["builtin:tiny", "builtin:arch-longcat"])
def test_the_kv_kept_after_speculation_serves_the_next_turn(source: str) -> None:
    """Rows whose slots the rejected tails rotated are put back in order when kept (a
    `CacheList`'s members too, on LongCat)."""
    rows = prompts()[:2]
    first, _, batch = decode(source, rows, [GREEDY] * 2, SPEC, cache=True)
    assert batch.cache is not None and batch.cache.stats().entries == 2
    follow = [r + f + [5, 6, 7] for r, f in zip(rows, first)]
    want, _, _ = decode(source, follow, [GREEDY] * 2, None)
    uids = batch.insert([Row(tuple(p), 0, 48, frozenset(), make_request_sampler(GREEDY))
                         for p in follow])
    assert all(served > len(r) for (_, served), r in zip(uids, rows))  # reused, not prefilled
    out: dict[int, list[int]] = {uid: [] for uid, _ in uids}
    while not batch.empty:
        for response in batch.step():
            out[response.uid].append(response.token)
    assert [out[uid] for uid, _ in uids] == want


def test_a_biased_row_keeps_the_batch_on_its_path_as_mlx_lm_would_compute_it() -> None:
    rng = random.Random(3)
    rows = [[rng.randrange(700) for _ in range(rng.randrange(3, 30))] for _ in range(32)]
    params = [GREEDY] * 32
    params[5] = SamplingParams(temperature=0.0, logit_bias={9: 4.0, 17: -2.0})
    params[20] = SamplingParams(temperature=0.0, frequency_penalty=0.8,
                                repetition_penalty=1.2)
    got, counts, _ = decode("builtin:tiny", rows, params, None, max_tokens=24)
    assert counts.rows_off_path == 0  # no row's logits went through a Python call
    # mlx-lm's own batch, its processors per row (the path the biased row used to force).
    gen = BatchGenerator(model("builtin:tiny"), completion_batch_size=32)
    procs = [make_logits_processors(
        logit_bias=dict(p.logit_bias) or None,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 1.0 else None,
        repetition_context_size=PENALTY_CONTEXT,
        frequency_penalty=p.frequency_penalty or None,
        frequency_context_size=PENALTY_CONTEXT) for p in params]
    uids = gen.insert(rows, max_tokens=[24] * 32, logits_processors=procs)
    out: dict[int, list[int]] = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append(r.token)
    assert got == [out[u] for u in uids]


def _processed(params: SamplingParams, context: list[int], logits: mx.array) -> mx.array:
    """mlx-lm's processors for `params`, then the tempered softmax: the target's p."""
    for processor in make_logits_processors(
            logit_bias=dict(params.logit_bias) or None,
            repetition_penalty=params.repetition_penalty,
            repetition_context_size=PENALTY_CONTEXT):
        logits = processor(mx.array(context), logits)
    return mx.softmax(logits.astype(mx.float32) / params.temperature, axis=-1)


def _exact(net: nn.Module, prompt: list[int], params: SamplingParams
           ) -> tuple[mx.array, mx.array]:
    """p(first token) and p(second | first) for every first, from mlx-lm's own model call
    and processors: the reference, computed without the engine."""
    first = _processed(params, prompt, net(mx.array([prompt]))[:, -1, :])[0]
    logits = net(mx.array([prompt + [t] for t in range(first.shape[0])]))[:, -1, :]
    second = mx.concatenate([_processed(params, prompt + [t], logits[t:t + 1])
                             for t in range(first.shape[0])])
    return first, second


def _drafting_prompt(net: nn.Module, params: SamplingParams) -> list[int]:
    """A prompt whose likeliest first token occurred in it before, followed by the
    likeliest second: the second token is then mostly a draft, kept about as often as the
    target samples it, and rejected often enough to test the correction."""
    def likeliest(context: list[int]) -> int:
        return int(mx.argmax(_processed(params, context, net(mx.array([context]))[:, -1, :]))
                   .item())

    prompt = [random.Random(7).randrange(700) for _ in range(30)]
    for _ in range(6):
        a = likeliest(prompt)
        if a in prompt:
            return prompt
        prompt = [a, likeliest(prompt + [a])] + prompt
    raise AssertionError("no drafting prompt found")


def _noise(p: mx.array, n: int) -> float:
    """The total variation distance n samples of p show on average, from p alone."""
    return 0.5 * math.sqrt(2 / math.pi) * mx.sqrt(p * (1 - p) / n).sum().item()


def test_sampled_tokens_keep_the_targets_distribution() -> None:
    """The second generated token is the first a draft decides (the draft after the
    first token, looked up in the prompt, or sampled from a draft model and judged by the
    q/p rule). Over 1536 unseeded samples with temperature, bias and a penalty, with and
    without speculation, its distribution, and its
    distribution after the likeliest first token (where nearly all are drafts), are
    within 1.5x the sampling noise (in total variation) of the exact ones."""
    net, n = model("builtin:tiny"), 1536
    params = SamplingParams(temperature=0.6, repetition_penalty=1.1, logit_bias={7: 1.0})
    prompt = _drafting_prompt(net, params)
    first, second = _exact(net, prompt, params)
    marginal = (first[:, None] * second).sum(axis=0)
    lead = int(mx.argmax(first).item())
    for spec, draft in ((None, None), (SPEC, None), (DRAFTING, "builtin:tiny")):
        mx.random.seed(11)
        # 512 rows a pass rather than 32 (prefilled 8 at a time): the same 1536 samples in
        # a tenth of the model calls (61 s -> 51 s on an idle 2-core box, more when loaded).
        got, counts, _ = decode("builtin:tiny", [prompt] * n, [params] * n, spec,
                                max_tokens=2, draft=draft, batch_size=512)
        for expected, seconds in ((marginal, [t[1] for t in got]),
                                  (second[lead], [t[1] for t in got if t[0] == lead])):
            histogram = mx.zeros(expected.shape[0]).at[mx.array(seconds)].add(1.0)
            distance = 0.5 * mx.abs(histogram / len(seconds) - expected).sum().item()
            assert distance < 1.5 * _noise(expected, len(seconds)), (spec, distance)
        if spec is not None:
            assert counts.drafted >= n // 10, counts  # many second tokens were drafts,
            assert 0.05 < counts.accepted / counts.drafted < 0.95, counts  # kept and not
        if draft is not None:
            # The model drafting for itself, without the bias and penalty: by the q/p rule
            # most drafts are kept (82% here; "sample, then compare" kept 39%).
            assert counts.accepted / counts.drafted > 0.6, counts
