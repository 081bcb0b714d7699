"""The checkpoint's MTP layer on a sharded replica (`speculative.method: mtp`, shards: 2 by
tensor, in the sharded cluster of `conftest.py`): rank 0 reads the model's hidden states,
whole after the tensor-parallel sums, drafts with its MTP layer and shares the drafts;
both ranks verify, each over its 8-bit KV cache (`engine.kv_bits`), which Orchard's MLA
attention reads packed (`replicas.engine.model.mla`)."""

from __future__ import annotations

import openai
import pytest

from tests.sharded.conftest import MTP_SHARDED
from tests.sharded.driver import Driver
from tests.sharded.test_sharded import PROMPTS, client, generate, whole_text

__all__ = ["client"]  # the fixture, shared with test_sharded.py

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("stream", [False, True])
def test_mtp_drafts_on_a_sharded_replica_keep_the_whole_models_text(
        client: openai.OpenAI, driver: Driver, stream: bool) -> None:
    """DeepSeek V3 with its MTP layer (`builtin:mtp-agree`, whose layer predicts what the
    model will) by tensor: rank 0 drafts from the model's hidden states, both ranks
    verify; greedy text is the unsharded model's, several tokens a pass."""
    before = driver.stats(MTP_SHARDED)[MTP_SHARDED]["decode"]
    for prompt in PROMPTS:
        expected = whole_text(client, "mla", prompt)
        assert generate(client, MTP_SHARDED, prompt, stream=stream) == expected, prompt
        assert len(expected[0]) > 20
    decode = driver.stats(MTP_SHARDED)[MTP_SHARDED]["decode"]
    # The whole model's KV is the packed form: 8-bit codes plus a float32 scale and bias
    # per 32 values, 1.25 bytes a value, over each of 2 layers' latent (64) and rope key (32).
    whole = driver.stats("mla")["mla"]["memory"]["layout"]
    assert whole["per_token"] == 2 * (64 + 32) * 1.25
    assert decode["method"] == "mtp" and decode["accepted"] > before["accepted"]
    assert decode["tokens"] - before["tokens"] > 2 * (decode["passes"] - before["passes"])
