"""Prefill and decode roles (`role:` per model entry): which entries pair up, and which
ones clients name. A `decode` model and a `prefill` entry of the same id share weights; the
decode replicas hand long prompts to the prefill replicas (`replicas.kv_pull`)."""

from __future__ import annotations

from typing import Protocol, Sequence, TypeVar


class ModelSettings(Protocol):
    """What the roles read of `deployments.config.ModelSettings` (which imports this)."""

    @property
    def id(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def shards(self) -> int: ...
    @property
    def sharding(self) -> str: ...
    @property
    def aliases(self) -> list[str]: ...


M = TypeVar("M", bound=ModelSettings)


def served(models: Sequence[M]) -> list[M]:
    """The models clients name: every entry but the prefill replicas of a split one."""
    return [m for m in models if m.role != "prefill"]


def check_roles(models: Sequence[ModelSettings]) -> None:
    """A prefill entry serves one decode model with the same weights; neither works alone."""
    decode = {m.id: m for m in models if m.role == "decode"}
    prefill = {m.id: m for m in models if m.role == "prefill"}
    if len(prefill) != sum(m.role == "prefill" for m in models):
        raise ValueError("a model has two `role: prefill` entries")
    for name in sorted(set(decode) ^ set(prefill)):
        lone, other = ("decode", "prefill") if name in decode else ("prefill", "decode")
        raise ValueError(f"model '{name}' has a `role: {lone}` entry but no `role: {other}` one")
    for name, entry in prefill.items():
        pair = decode[name]
        # KV moves rank to rank, so both sides hold the same part of each layer.
        if (entry.source, entry.shards, entry.sharding) != (pair.source, pair.shards,
                                                            pair.sharding):
            raise ValueError(f"model '{name}': its prefill and decode entries need the same "
                             "`source`, `shards` and `sharding`")
        if entry.aliases:
            raise ValueError(f"model '{name}': aliases go on its decode entry")
