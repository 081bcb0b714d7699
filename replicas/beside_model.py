"""What a replica derives and loads beside its model, from its options: the fingerprint its
KV is known by (the disk tier's directory, a pull's check), and what speculation drafts with
beside it: a draft model, or the checkpoint's MTP layer."""

from __future__ import annotations

import mlx.nn as nn

from replicas.engine.kv.fingerprint import model_fingerprint
from replicas.engine.spec.draft_model import check_draft_model
from replicas.engine.model.loading import LoadedModel, load_model
from replicas.engine.model.mtp import Mtp, load_mtp
from replicas.options import ReplicaOptions
from replicas.sources import resolve_source


def kv_fingerprint(options: ReplicaOptions, model: LoadedModel) -> str:
    """Whose KV this replica's fits: the model's, quantized as configured, and on a
    sharded replica split alike (a shard's KV fits the same rank of such a replica)."""
    engine, plan = options.engine, options.shard
    layout = () if plan is None else (plan.mode, plan.size, plan.layers)
    return model_fingerprint(model.path, model.model, engine.kv_bits, engine.kv_group_size,
                             *layout)


def load_draft(options: ReplicaOptions, target: LoadedModel) -> nn.Module | Mtp | None:
    """The draft model (`speculative.draft_model`), checked against `target` (rank 0's
    shard on a sharded replica), or `target`'s MTP layer (`speculative.method: mtp`);
    None without either."""
    spec = options.engine.speculative
    if spec is not None and spec.mtp:  # on a sharded replica, rank 0's shard lends its
        return load_mtp(target.model, target.path, target.config)  # embeddings and head
    if spec is None or spec.draft_model is None:
        return None
    draft = load_model(spec.draft_model, resolve_source(spec.draft_model))
    check_draft_model(draft.model, draft.hf_tokenizer.get_vocab(),
                      target.hf_tokenizer.get_vocab())
    return draft.model
