"""MTP layers (`replicas.engine.model.mtp`) read from a checkpoint's files through the production
loader, and the drafter's batch (`replicas.engine.spec.mtp`): every row's drafts are
what the layer writes for that row alone, from all the pairs it was handed, however rows
join, leave, keep some positions and chain guesses between steps."""

from __future__ import annotations

import json
import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from replicas.builtin.build import MTP_FILE
from replicas.engine.config import SpeculativeConfig
from replicas.engine.model.loading import LoadedModel, load_model
from replicas.engine.model.mtp import Mtp, hidden_and_logits, load_mtp
from replicas.engine.spec.mtp import MtpDrafter
from replicas.engine.spec.drafter import Ask
from replicas.sources import resolve_source


def loaded(name: str) -> LoadedModel:
    return load_model(name, resolve_source(name))


@pytest.mark.parametrize("name,decoder", [("builtin:mtp", "DeepseekV3DecoderLayer"),
                                          ("builtin:mtp-glm-lite", "Glm4MoeLiteDecoderLayer")])
def test_the_layer_loads_from_the_checkpoints_own_files(name: str, decoder: str) -> None:
    model = loaded(name)
    mtp = load_mtp(model.model, model.path, model.config)
    index = json.loads((model.path / "model.safetensors.index.json").read_text())
    stored = mx.load(str(model.path / MTP_FILE))
    layer = model.model.args.num_hidden_layers
    assert {f for k, f in index["weight_map"].items()
            if k.startswith(f"model.layers.{layer}.")} == {MTP_FILE}
    prefix = f"model.layers.{layer}."
    # The layer's own parts under their names, and a decoder layer of the family's (MLA
    # attention and MoE here), each weight the file's.
    assert mx.array_equal(mtp.layer.eh_proj.weight, stored[prefix + "eh_proj.weight"])
    assert mx.array_equal(mtp.layer.norm.weight, stored[prefix + "shared_head.norm.weight"])
    assert mx.array_equal(mtp.layer.layer.self_attn.q_a_proj.weight,
                          stored[prefix + "self_attn.q_a_proj.weight"])
    assert mx.array_equal(mtp.layer.layer.mlp.switch_mlp.down_proj.weight,
                          stored[prefix + "mlp.switch_mlp.down_proj.weight"])
    assert type(mtp.layer.layer).__name__ == decoder


@pytest.mark.parametrize("name", ["builtin:mtp-agree", "builtin:mtp-glm-lite"])
def test_an_agreeing_layer_predicts_the_models_token_after_next(name: str) -> None:
    """An agreeing layer (DeepSeek V3's, GLM-4.7-Flash's): from the model's hidden state at
    i and token i+1, its argmax is the model's own next token after i+1, at every position."""
    model = loaded(name)
    mtp = load_mtp(model.model, model.path, model.config)
    ids = mx.array([[random.Random(1).randrange(3, 200) for _ in range(24)]])
    hidden, logits = hidden_and_logits(model.model, ids, None)
    assert mx.array_equal(logits, model.model(ids))
    ahead = mtp.logits(mtp.layer(hidden[:, :-1], mtp.embed(ids[:, 1:]), None))
    assert mx.argmax(ahead, -1).tolist() == mx.argmax(logits[:, 1:], -1).tolist()


@pytest.mark.parametrize("name", ["builtin:tiny", "builtin:arch-mla"])
def test_a_model_without_an_mtp_layer_is_refused_at_load(name: str) -> None:
    model = loaded(name)
    with pytest.raises(ValueError, match="MTP layer"):
        load_mtp(model.model, model.path, model.config)


def alone(mtp: Mtp, hidden: mx.array, tokens: list[int], n: int) -> list[int]:
    """The layer's greedy chain of n drafts for one row, from all its pairs, fresh cache."""
    cache = KVCache()
    out = mtp.layer(hidden[None], mtp.embed(mx.array([tokens])), cache)[:, -1:]
    drafts: list[int] = []
    while True:
        drafts.append(int(mx.argmax(mtp.logits(out)[0, -1]).item()))
        if len(drafts) == n:
            return drafts
        out = mtp.layer(out, mtp.embed(mx.array([[drafts[-1]]])), cache)


def test_rows_joining_leaving_and_keeping_some_positions_draft_as_alone() -> None:
    model = loaded("builtin:mtp")
    mtp = load_mtp(model.model, model.path, model.config)
    hidden_size = model.model.args.hidden_size
    k = 3
    drafter = MtpDrafter(SpeculativeConfig(num_speculative_tokens=k, mtp=True), mtp)
    rng = random.Random(5)
    pairs: dict[int, tuple[list[mx.array], list[int]]] = {}  # every pair each row was handed
    rows, next_uid = [0, 1, 2], 3
    for step in range(12):
        if step == 4:
            rows.remove(1)  # a row finished
            drafter.keep(rows)
        if step in (3, 7):  # a row joins: its first pass is a plain one
            rows.append(next_uid)
            next_uid += 1
        # A target pass: each row kept 1 to k + 1 positions.
        counts = [rng.randrange(1, k + 2) for _ in rows]
        width = max(counts)
        hidden = mx.random.normal((len(rows), width, hidden_size))
        following = [[rng.randrange(3, 200) for _ in range(width)] for _ in rows]
        drafter.saw(rows, hidden, mx.array(following), counts)
        for i, (uid, n) in enumerate(zip(rows, counts)):
            states, tokens = pairs.setdefault(uid, ([], []))
            states.append(hidden[i, :n])
            tokens.extend(following[i][:n])
        drafts = drafter.draft_rows([Ask(uid, [], 0, k) for uid in rows])  # chains of k
        for uid, draft in zip(rows, drafts):
            states, tokens = pairs[uid]
            assert len(draft) == k, (step, uid)
            assert draft == alone(mtp, mx.concatenate(states), tokens, len(draft)), (step, uid)
