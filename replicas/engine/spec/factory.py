"""Which drafter a batch speculates with: the one place that knows every proposer.

The batch asks this module, never the proposers themselves, so a new proposer is one
branch here and the batch does not change.
"""

from __future__ import annotations

import logging

import mlx.nn as nn

from replicas.engine.config import SpeculativeConfig
from replicas.engine.model.mtp import Mtp
from replicas.engine.spec.draft_model import ModelDrafter
from replicas.engine.spec.drafter import Drafter, can_roll_back
from replicas.engine.spec.mtp import MtpDrafter

log = logging.getLogger(__name__)


def usable(spec: SpeculativeConfig | None, model: nn.Module) -> SpeculativeConfig | None:
    """`spec`, or None where this model's cache cannot drop rejected positions."""
    if spec is not None and not can_roll_back(model):
        log.warning("speculative decoding is off: this model's cache cannot drop "
                    "rejected tokens (sliding window, recurrent layers or a sparse "
                    "indexer)")
        return None
    return spec


def make_drafter(spec: SpeculativeConfig | None, draft: nn.Module | Mtp | None,
                 prefill_step_size: int) -> Drafter | None:
    """The proposer for `spec`: the model's MTP layer, a draft model, or prompt lookup."""
    if spec is None:
        return None
    if isinstance(draft, Mtp):
        return MtpDrafter(spec, draft)
    if draft is not None:
        return ModelDrafter(spec, draft, prefill_step_size)
    # Prompt lookup; on a sharded replica's other ranks, never asked (rank 0 drafts).
    return Drafter(spec)
