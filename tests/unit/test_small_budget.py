"""A small KV budget must not slow what fits in it (issue 58).

Fifteen short chats of a wide-KV model (32 KiB a token: a Qwen3 shape with 8 KV heads of
128 in 4 float32 layers) hold 15 MiB of KV between them. Under a 96 MiB budget:
- the padded batch holds each row at mlx-lm's 256-token cache step, 8 MiB a row, so 12 join
  and 3 wait for memory until a whole generation ends (twice the steps to the last first
  token, `load/micro/small_budget.py`); the paged batch holds their blocks, and all join;
- MLX's memory limit is the process's: a replica planned with a small budget must not lower
  the limit a replica planned before it in the same process still needs (MLX waits on every
  evaluation while active memory is past the limit: twice the CPU a round, measured)."""

from __future__ import annotations

import gc
import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import qwen3

from replicas.engine.config import EngineConfig
from replicas.engine.kv.blocks import BLOCK_SIZE
from replicas.engine.kv.budget import KvBudget, paging_plan, plan_memory
from replicas.engine.kv.layout import KvLayout
from replicas.contract import SamplingParams
from replicas.engine.request import EngineRequest, Submitted
from replicas.engine.scheduling import Waiting

MIB = 2**20
BUDGET = 96 * MIB
LAYERS = 4
# 32 KiB a token: K and V, 8 heads of 128, float32, in each of the 4 plain layers.
WIDE = KvLayout(per_token=LAYERS * 2 * 8 * 128 * 4, plain=(2 * 8 * 128 * 4,) * LAYERS)
CHATS, PROMPT, OUTPUT = 15, 30, 32


class _Output:
    """The one thing admission reads of a request's output: where its errors go."""

    sink: Any = None


def _waiting(paged: bool) -> Waiting:
    kv = KvBudget(BUDGET, WIDE, max_waiting=64)
    if paged:
        kv.paging = paging_plan(BUDGET, WIDE.per_token, LAYERS, 0, BLOCK_SIZE, 32 * 32768)
    return Waiting(kv, EngineConfig(prompt_cache_bytes=0))


def _chats() -> list[Submitted]:
    return [Submitted(EngineRequest(f"chat-{i}", tuple(range(3, 3 + PROMPT)), OUTPUT,
                                    SamplingParams(temperature=0.0), frozenset()),
                      _Output())  # type: ignore[arg-type]
            for i in range(CHATS)]


def test_short_chats_that_fit_their_blocks_all_join_at_once_when_paged(
        caplog: pytest.LogCaptureFixture) -> None:
    assert CHATS * (PROMPT + OUTPUT) * WIDE.per_token < 30 * MIB  # what they hold, summed
    with caplog.at_level(logging.WARNING, logger="replicas.engine.scheduling"):
        paged = _waiting(paged=True)
    assert not caplog.records
    admitted = paged.admit(_chats(), lambda _: False, lambda _: None)
    assert len(admitted) == CHATS and len(paged) == 0
    # The padded batch really holds a 256-token step a row: 12 fit, 3 wait for memory,
    # and the replica says so when it starts.
    with caplog.at_level(logging.WARNING, logger="replicas.engine.scheduling"):
        padded = _waiting(paged=False)
    assert "holds 12 rows of the padded batch" in caplog.text
    assert "memory.paged_kv: auto" in caplog.text
    admitted = padded.admit(_chats(), lambda _: False, lambda _: None)
    assert (len(admitted), len(padded)) == (12, 3)


def _model() -> nn.Module:
    model = qwen3.Model(qwen3.ModelArgs(
        model_type="qwen3", hidden_size=64, num_hidden_layers=LAYERS, intermediate_size=128,
        num_attention_heads=8, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        vocab_size=64, rope_theta=10000.0, tie_word_embeddings=True,
        max_position_embeddings=4096))
    mx.eval(model.parameters())
    return model


def test_a_small_budget_does_not_lower_the_process_memory_limit() -> None:
    model = _model()
    ample = plan_memory(model, 4096 * MIB, "ample")
    small = plan_memory(model, BUDGET, "small")
    assert small.layout == WIDE
    # Both replicas live in this process: MLX's one limit covers both.
    assert mx.get_memory_limit() >= ample.limit + small.limit
    before = mx.get_memory_limit()
    del ample
    gc.collect()
    again = plan_memory(model, BUDGET, "again")
    # The ample one is gone (its engine let it go): its share is given back.
    assert mx.get_memory_limit() <= before - (4096 * MIB * 11 // 10) + again.limit
    assert mx.get_memory_limit() >= small.limit + again.limit
