"""What a replica derives and loads beside its model, from its options: the fingerprint its
KV is known by (the disk tier's directory, a pull's check), and the draft model speculation
drafts with."""

from __future__ import annotations

import mlx.nn as nn

from replicas.engine.disk_cache import model_fingerprint
from replicas.engine.draft_model import check_draft_model
from replicas.engine.loading import LoadedModel, load_model
from replicas.options import ReplicaOptions
from replicas.sources import resolve_source


def kv_fingerprint(options: ReplicaOptions, model: LoadedModel) -> str:
    """Whose KV this replica's fits: the model's, quantized as configured, and on a
    sharded replica split alike (a shard's KV fits the same rank of such a replica)."""
    engine, plan = options.engine, options.shard
    layout = () if plan is None else (plan.mode, plan.size, plan.layers)
    return model_fingerprint(model.path, model.model, engine.kv_bits, engine.kv_group_size,
                             *layout)


def load_draft(options: ReplicaOptions, target: LoadedModel) -> nn.Module | None:
    """The draft model (`speculative.draft_model`), checked against `target` (rank 0's
    shard on a sharded replica); None without one."""
    spec = options.engine.speculative
    if spec is None or spec.draft_model is None:
        return None
    draft = load_model(spec.draft_model, resolve_source(spec.draft_model))
    check_draft_model(draft.model, draft.hf_tokenizer.get_vocab(),
                      target.hf_tokenizer.get_vocab())
    return draft.model
