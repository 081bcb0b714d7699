"""The batched quantized KV cache (`replicas.engine.kv.quantized`) inside mlx-lm's
`BatchGenerator`, on tiny random-weight models built with mlx-lm's own classes.

Weights are scaled up (x2) from mlx-lm's init, which is so flat that greedy decoding
repeats one token; scaled, the text varies, so "same tokens" compares something. The
same scaling makes logits sharp, which magnifies quantization error: the tolerances
below are for this model, with the measured values next to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_map
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models import gemma3_text, gpt_oss, llama
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from replicas.engine.kv.prefix_cache import PromptCache, prefix_view
from replicas.engine.kv.quantized import (
    BatchQuantizedKVCache,
    QuantizedRowKVCache,
    make_quantized_prompt_cache,
)

HEAD_DIM = 64  # a multiple of every group size the tests use
PROMPTS = [[5, 17, 3, 99, 100], [9], list(range(40, 60)), [7, 7, 7, 7], [2, 3]]
MAX_TOKENS = 16

# 8-bit greedy tokens vs the float cache, all PROMPTS x MAX_TOKENS free-running positions:
# measured 1.0 (80 of 80); a flip early in a row would cost the rest of it, hence the margin.
AGREEMENT_8BIT = 0.9
# Max |logprob difference| of the first generated step vs the float cache, over PROMPTS'
# whole vocabulary: measured 0.20 (8-bit) and 4.7 (4-bit) on this sharp random model.
LOGPROB_BOUND = {8: 0.5, 4: 10.0}


def _scaled(net: nn.Module, dtype: mx.Dtype | None = None) -> nn.Module:
    net.update(tree_map(lambda p: 2.0 * p, net.parameters()))
    if dtype is not None:
        net.set_dtype(dtype)
    mx.eval(net.parameters())
    return net


def _llama(dtype: mx.Dtype | None = None) -> nn.Module:
    mx.random.seed(0)
    return _scaled(llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM, rms_norm_eps=1e-6,
        vocab_size=256, rope_theta=10000.0, tie_word_embeddings=True)), dtype)


def _gemma3() -> nn.Module:
    mx.random.seed(0)
    # Layer 0 slides over 8 positions (RotatingKVCache), layer 1 attends globally (KVCache).
    return _scaled(gemma3_text.Model(gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM, vocab_size=256,
        query_pre_attn_scalar=HEAD_DIM, sliding_window=8, sliding_window_pattern=2)))


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return _llama()


def _caches(model: nn.Module, bits: int | None, n: int) -> list[list[Any]] | None:
    if bits is None:
        return None
    return [make_quantized_prompt_cache(model, bits, 64) for _ in range(n)]


def generate(model: nn.Module, prompts: Sequence[list[int]], bits: int | None = None,
             max_tokens: int = MAX_TOKENS) -> tuple[list[list[int]], list[mx.array]]:
    """Greedy tokens per prompt through one `BatchGenerator`, and each row's first
    step's logprobs; `bits` None is mlx-lm's float cache."""
    gen = BatchGenerator(model, max_tokens=max_tokens)
    uids = gen.insert([list(p) for p in prompts], caches=_caches(model, bits, len(prompts)))
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    first: dict[int, mx.array] = {}
    done: set[int] = set()
    while len(done) < len(uids):
        for r in gen.next()[1]:
            tokens[r.uid].append(r.token)
            first.setdefault(r.uid, r.logprobs)
            if r.finish_reason is not None:
                done.add(r.uid)
    gen.close()
    return [tokens[u] for u in uids], [first[u] for u in uids]


def _drain(gen: BatchGenerator, out: dict[int, list[int]], steps: int | None = None) -> None:
    """Run `gen` `steps` decode steps (or until it is idle), recording tokens per uid."""
    n = 0
    while steps is None or n < steps:
        prefilled, responses = gen.next()
        if not prefilled and not responses:
            return
        for r in responses:
            out.setdefault(r.uid, []).append(r.token)
        n += bool(responses)


@pytest.mark.parametrize("bits", [8, 4])
def test_batched_equals_solo(model: nn.Module, bits: int) -> None:
    batched, _ = generate(model, PROMPTS, bits)
    solo = [generate(model, [p], bits)[0][0] for p in PROMPTS]
    assert batched == solo
    assert len({tuple(t) for t in batched}) == len(PROMPTS)  # the rows really differ
    assert any(len(set(t)) > 4 for t in batched)  # and are not one token repeated


def test_batch_cache_is_quantized(model: nn.Module) -> None:
    gen = BatchGenerator(model, max_tokens=4)
    gen.insert([PROMPTS[0], PROMPTS[2]], caches=_caches(model, 8, 2))
    gen.next()
    gen.next()
    assert [type(c) for c in gen._generation_batch.prompt_cache] == [BatchQuantizedKVCache] * 2
    (cache, tokens), = gen.extract_cache([0]).values()
    assert all(type(c) is QuantizedRowKVCache for c in cache)
    assert cache[0].size() == len(tokens)
    gen.close()


def test_matches_mlx_lm_single_sequence_quantized_cache(model: nn.Module) -> None:
    """Solo, the batch form computes what mlx-lm's own `QuantizedKVCache` does."""
    for prompt in (PROMPTS[0], PROMPTS[2]):
        ref = [QuantizedKVCache(group_size=64, bits=8) for _ in model.layers]
        steps = list(generate_step(mx.array(prompt), model, prompt_cache=ref,
                                   max_tokens=MAX_TOKENS))
        tokens, first = generate(model, [prompt], 8)
        assert tokens[0] == [t for t, _ in steps]
        assert float(mx.abs(first[0] - steps[0][1]).max()) < 1e-4


def test_quality_against_float_cache(model: nn.Module) -> None:
    ref, ref_first = generate(model, PROMPTS)
    diffs = {}
    for bits in (8, 4):
        tokens, first = generate(model, PROMPTS, bits)
        diffs[bits] = max(float(mx.abs(a - b).max()) for a, b in zip(first, ref_first))
        assert diffs[bits] < LOGPROB_BOUND[bits], (bits, diffs[bits])
        if bits == 8:
            same = sum(a == b for r, q in zip(ref, tokens) for a, b in zip(r, q))
            assert same / sum(len(r) for r in ref) >= AGREEMENT_8BIT
    assert 0 < diffs[8] < diffs[4]  # quantized at all, and fewer bits cost more


@pytest.mark.parametrize("bits", [8, 4])
def test_nbytes_per_token(bits: int) -> None:
    net = _llama(mx.bfloat16)
    n = 40
    prompt = mx.array([list(range(1, n + 1))])
    quant = [c.merge([c]) for c in make_quantized_prompt_cache(net, bits, 64)]
    plain = [c.merge([c]) for c in make_prompt_cache(net)]
    net(prompt, cache=quant)
    net(prompt, cache=plain)
    assert all(type(c) is BatchQuantizedKVCache for c in quant)
    assert all(type(c) is BatchKVCache for c in plain)
    # Per element: `bits` of code, plus a bf16 scale and bias for every 64 elements,
    # against 16 bits unquantized: 8-bit is 8.5/16 = 17/32, 4-bit 4.5/16 = 9/32.
    ratio = Fraction(bits * 64 + 2 * 16, 16 * 64)
    assert ratio == {8: Fraction(17, 32), 4: Fraction(9, 32)}[bits]
    assert Fraction(sum(c.nbytes for c in quant), sum(c.nbytes for c in plain)) == ratio
    # Rows taken out hold exactly their n positions: K and V, 1 kv head, 2 layers.
    rows = [c.extract(0) for c in quant]
    assert sum(c.nbytes for c in rows) == 2 * 2 * n * HEAD_DIM * ratio * 2


def test_round_trip_through_the_prefix_cache(model: nn.Module) -> None:
    """Rows leave mid-decode, are kept in the prefix cache, and come back as a hit; decoding
    continues exactly as it would have, beside a row that never left."""
    stay, leave = PROMPTS[2], PROMPTS[0]
    expect_stay = generate(model, [stay], 8)[0][0]
    expect_leave = generate(model, [leave], 8)[0][0]

    gen = BatchGenerator(model, max_tokens=MAX_TOKENS)
    uid_stay, uid_leave = gen.insert([stay, leave], caches=_caches(model, 8, 2))
    out: dict[int, list[int]] = {}
    _drain(gen, out, steps=5)
    assert len(out[uid_leave]) == 5
    (cache, held), = gen.remove([uid_leave], return_prompt_caches=True).values()
    assert held == leave + out[uid_leave]  # the KV of the prompt and every token given out

    store = PromptCache(max_bytes=1 << 30)
    store.save(list(held), cache)
    hit = store.fetch(list(held))
    assert hit is not None and hit.length == len(held) - 1
    assert all(type(c) is QuantizedRowKVCache and c.size() == hit.length for c in hit.cache)
    [uid_back] = gen.insert([held[hit.length:]], caches=[hit.cache],
                            all_tokens=[held[:hit.length]], max_tokens=[MAX_TOKENS - 5])
    _drain(gen, out)
    gen.close()
    assert out[uid_stay] == expect_stay
    assert out[uid_leave] + out[uid_back] == expect_leave
    # The entry itself is untouched by the hit's use (the view shares its arrays).
    assert all(c.size() == len(held) for c in store._lru[tuple(held)].cache)


def test_prefix_view_of_quantized_rows() -> None:
    row = QuantizedRowKVCache(group_size=64, bits=8)
    row.update_and_fetch(mx.random.normal((1, 1, 10, HEAD_DIM)),
                         mx.random.normal((1, 1, 10, HEAD_DIM)))
    [view] = prefix_view([row], 3)
    assert type(view) is QuantizedRowKVCache and view.size() == 7 and row.size() == 10
    assert view.keys is row.keys  # no copy of the prefix
    batch = QuantizedRowKVCache.merge([view])
    deq = mx.dequantize(*batch.keys_and_values()[0], group_size=64, bits=8)
    assert mx.array_equal(deq, mx.dequantize(*row.keys_and_values()[0], group_size=64,
                                             bits=8)[..., :7, :])


def _prefill(model: nn.Module, prompt: list[int], bits: int = 8) -> list[Any]:
    cache = make_quantized_prompt_cache(model, bits, 64)
    model(mx.array([prompt]), cache=cache)
    return cache


@pytest.mark.parametrize("rejected", [[0, 2, 4], [1, 3, 4]])
def test_rollback_of_rejected_tokens(model: nn.Module, rejected: list[int]) -> None:
    """Speculative rollback: 4 positions appended to a live 3-row batch, then each row's
    rejected tail rolled away as `replicas.engine.spec.drafter.roll_back` does it: what all
    rows reject trimmed, the rest with `prepare(right_padding)` and `finalize()`."""
    prompts = [PROMPTS[0], PROMPTS[2][:9], PROMPTS[4] + [11]]
    draft = [[21, 22, 23, 24], [31, 32, 33, 34], [41, 42, 43, 44]]
    rows = [_prefill(model, p) for p in prompts]
    batch = [QuantizedRowKVCache.merge([r[i] for r in rows]) for i in range(len(model.layers))]
    model(mx.array(draft), cache=batch)
    common = min(rejected)
    for c in batch:
        c.trim(common)
        c.prepare(right_padding=[r - common for r in rejected])
        c.finalize()
    kept = [p + d[:4 - r] for p, d, r in zip(prompts, draft, rejected)]
    assert batch[0].offset.tolist() == [len(k) for k in kept]

    # What each row holds is what a cache that never saw the rejected tokens holds: on CPU
    # bit for bit (measured); allowed one quantization step, as a batched matmul may round
    # differently elsewhere. A misplaced position would differ by the values themselves.
    for r, k in enumerate(kept):
        ref = _prefill(model, k)
        for got, want in zip(batch, ref):
            row = got.extract(r)
            assert row.size() == want.size() == len(k)
            for a, b in zip(row.keys_and_values(), want.keys_and_values()):
                diff = mx.dequantize(*a, group_size=64, bits=8) - \
                    mx.dequantize(*b, group_size=64, bits=8)
                assert float(mx.abs(diff).max()) <= float(b[1].max()) + 1e-6

    # And the next step sees exactly that: logits equal each row's own (measured: 0).
    nxt = [[50], [60], [70]]
    logits = model(mx.array(nxt), cache=batch)[:, -1]
    for r, k in enumerate(kept):
        want = model(mx.array([nxt[r]]), cache=_prefill(model, k))[0, -1]
        assert float(mx.abs(logits[r] - want).max()) < 1e-2


def test_left_padding_by_prepare(model: nn.Module) -> None:
    """`prepare(left_padding=...)` on an empty batch: a left-padded row sees only itself."""
    batch = [QuantizedRowKVCache.merge([c, d]) for c, d in zip(
        make_quantized_prompt_cache(model, 8, 64), make_quantized_prompt_cache(model, 8, 64))]
    for c in batch:
        c.prepare(left_padding=[2, 0])
    logits = model(mx.array([[0, 0, 5, 17], [9, 8, 7, 6]]), cache=batch)[:, -1]
    for r, prompt in enumerate(([5, 17], [9, 8, 7, 6])):
        want = model(mx.array([prompt]), cache=make_quantized_prompt_cache(model, 8, 64))
        assert float(mx.abs(logits[r] - want[0, -1]).max()) < 1e-2
    assert batch[0].offset.tolist() == [2, 4]


def test_filter_and_extend_keep_rows_unchanged(model: nn.Module) -> None:
    """Rows leave (the longest finishing first, one removed) and join mid-decode; every
    row's tokens are what it gives alone."""
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[4], PROMPTS[3]]
    limits = [3, MAX_TOKENS, MAX_TOKENS, 6]
    expect = [generate(model, [p], 8, m)[0][0] for p, m in zip(prompts, limits)]

    gen = BatchGenerator(model, max_tokens=MAX_TOKENS)
    uids = gen.insert(prompts[:3], max_tokens=limits[:3], caches=_caches(model, 8, 3))
    out: dict[int, list[int]] = {}
    _drain(gen, out, steps=5)  # the 20-token row has finished: the batch shrank
    assert len(gen._generation_batch) == 2
    assert gen._generation_batch.prompt_cache[0].size() < len(prompts[0])  # its KV went too
    uids += gen.insert(prompts[3:], max_tokens=limits[3:], caches=_caches(model, 8, 1))
    _drain(gen, out, steps=4)  # the new row has joined the decoding ones
    gen.remove([uids[1]])
    _drain(gen, out)
    gen.close()
    got = [out[u] for u in uids]
    assert got[0] == expect[0] and got[2] == expect[2] and got[3] == expect[3]
    assert got[1] == expect[1][:len(got[1])] and 5 < len(got[1]) < MAX_TOKENS


def test_make_quantized_prompt_cache_keeps_other_layers() -> None:
    net = _gemma3()
    cache = make_quantized_prompt_cache(net, 4, 64)
    assert [type(c) for c in cache] == [RotatingKVCache, QuantizedRowKVCache]
    assert (cache[1].bits, cache[1].group_size) == (4, 64)

    # Both kinds batch together: the sliding layer as mlx-lm's, the global one quantized.
    prompts = [list(range(3, 15)), [4, 5, 6]]
    gen = BatchGenerator(net, max_tokens=6)
    gen.insert(prompts, caches=[make_quantized_prompt_cache(net, 4, 64) for _ in prompts])
    gen.next()
    gen.next()
    assert [type(c) for c in gen._generation_batch.prompt_cache] == \
        [BatchRotatingKVCache, BatchQuantizedKVCache]
    gen.close()
    batched, _ = generate(net, prompts, 4, max_tokens=6)
    assert batched == [generate(net, [p], 4, max_tokens=6)[0][0] for p in prompts]

    class Hybrid(nn.Module):  # recurrent, nested and full-attention layers
        layers = [None] * 4

        def make_cache(self) -> list[Any]:
            return [ArraysCache(2), CacheList(KVCache(), KVCache()),
                    CacheList(KVCache(), ArraysCache(1)), KVCache()]

    made = make_quantized_prompt_cache(Hybrid(), 8, 32)
    assert [type(c) for c in made] == [ArraysCache, CacheList, CacheList, QuantizedRowKVCache]
    # A list of plain attention caches is packed member by member (LongCat's two attentions
    # a layer); one that holds anything else stays whole, as mlx-lm makes it.
    assert all(type(c) is QuantizedRowKVCache for c in made[1].caches)
    assert [type(c) for c in made[2].caches] == [KVCache, ArraysCache]


def test_refuses_what_it_cannot_serve(model: nn.Module) -> None:
    for bits, group in ((3, 64), (16, 64), (8, 16), (4, 256)):
        with pytest.raises(ValueError):
            make_quantized_prompt_cache(model, bits, group)
    mx.random.seed(0)
    oss = gpt_oss.Model(gpt_oss.ModelArgs(
        num_hidden_layers=2, num_local_experts=2, num_experts_per_tok=1, vocab_size=64,
        hidden_size=64, intermediate_size=64, head_dim=64, num_attention_heads=2,
        num_key_value_heads=1, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"]))
    with pytest.raises(ValueError, match="sinks"):  # mlx-lm's quantized attention has none
        make_quantized_prompt_cache(oss, 8, 64)

    class Windowed(nn.Module):  # nothing to pack: a sliding window and a recurrent state
        layers = [None] * 2

        def make_cache(self) -> list[Any]:
            return [RotatingKVCache(max_size=8), CacheList(ArraysCache(1), KVCache())]

    with pytest.raises(ValueError, match=r"none of this model's cache layers \(CacheList, "
                                         r"RotatingKVCache\)"):
        make_quantized_prompt_cache(Windowed(), 8, 32)
    # Rows quantized differently cannot share a batch.
    a, b = _prefill(model, [1, 2], 8), _prefill(model, [3], 4)
    with pytest.raises(ValueError):
        QuantizedRowKVCache.merge([a[0], b[0]])
