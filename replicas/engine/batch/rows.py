"""The batch's vocabulary: a request as a row, a row the engine is done with, and a
cached prefix exported for a pull. Its own module so that the batch's parts (the image
prefix, the sharded lockstep) name a row without importing the batch."""

from __future__ import annotations

from dataclasses import dataclass

from replicas.engine.kv.disk import Snapshot
from replicas.engine.request import PromptEmbeddings
from replicas.engine.sampling.samplers import LogitsProcessor, Sampler


@dataclass(frozen=True)
class Row:
    """One request as the batch sees it: tokens, limits and how to pick the next token."""

    prompt_ids: tuple[int, ...]
    boundary: int  # prompt tokens before the last message: their KV is kept once prefilled
    max_tokens: int
    stop_ids: frozenset[int]  # token ids that end the row (EOS included)
    sampler: Sampler
    processors: tuple[LogitsProcessor, ...] = ()
    embeddings: PromptEmbeddings | None = None  # the prompt's start, as embeddings
    adapter: str | None = None  # its LoRA adapter's name; None: the base model

    @property
    def key(self) -> list[int]:
        """The prompt as the prefix cache knows it (images by their content)."""
        if self.embeddings is None:
            return list(self.prompt_ids)
        start = self.embeddings.key
        return [*start, *self.prompt_ids[len(start):]]


@dataclass(frozen=True)
class Done:
    """A row the engine is finished with: `keep` saves its KV for reuse (a normal end)."""

    uid: int
    keep: bool


@dataclass(frozen=True)
class Exported:
    """A cached prefix another replica pulls: this rank's part, snapshot on the engine
    thread, and on a sharded replica the id the other ranks keep theirs under
    (`replicas.engine.sharded.kv_parts`)."""

    tokens: tuple[int, ...]
    snap: Snapshot
    export_id: str = ""
