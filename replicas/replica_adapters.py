"""A replica's LoRA adapters: the configured ones, read and checked at load, and the loads
and unloads at run time, whose weights KV admission gives room for or takes back.

The adapters live in the generating batch's `AdapterTable` (`engine/model/adapters.py`);
reading an adapter runs on a worker thread, installing it on the engine thread between
steps, so rows on the other adapters decode on. `docs/architecture/adapters.md`.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

from replicas.contract import GenerationRequest
from replicas.engine.batch.local import LocalBatch
from replicas.engine.core import Engine
from replicas.engine.kv.budget import MemoryTooSmall
from replicas.engine.model.adapters import AdapterError, AdapterFiles, AdapterTable, \
    load_adapters, read_adapter
from replicas.engine.model.loading import LoadedModel
from replicas.errors import InvalidRequestError


class ReplicaAdapters:
    """`configured`: the config's adapters (name, directory), read at load."""

    def __init__(self, model_id: str, configured: Sequence[tuple[str, str]],
                 engine: Engine) -> None:
        self._model_id = model_id
        self._configured = tuple(configured)
        self._engine = engine
        self._model: LoadedModel | None = None
        # The batch whose rows pick adapters; None where none may be served (a sharded,
        # vision or encoder replica, or one not loaded yet).
        self.batch: LocalBatch | None = None

    def open(self, model: LoadedModel, sees: bool) -> AdapterTable | None:
        """The configured adapters, each read and checked (`AdapterError` names the one
        that is wrong); None without any. Engine thread, at load."""
        self._model = model
        if not self._configured:
            return None
        if sees:
            raise ValueError("LoRA adapters on a model that sees images are not served yet: "
                             "set kind: text to serve the adapters on its text")
        return load_adapters(model.model, dict(self._configured))

    @property
    def configured(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self._configured)

    def names(self) -> tuple[str, ...]:
        """The adapters served now."""
        return self.batch.adapters.names if self.batch is not None else ()

    def cache_ids(self, request: GenerationRequest, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt as the prefix cache, its disk tier, the directory and pulls key it:
        a LoRA adapter's in that adapter's key space (`replicas.engine.kv.namespace`)."""
        if request.adapter is None or self.batch is None:
            return list(prompt_ids)
        return self.batch.cache_ids(prompt_ids, request.adapter)

    async def load(self, name: str, path: str) -> None:
        """Serve adapter `name` from `path` (mlx-lm's format) from the next step on, its
        weights taken from the KV budget. `InvalidRequestError`: a bad adapter, a replica
        that cannot serve adapters, one in use under that name, or no memory for it."""
        batch, model = self.batch, self._model
        if batch is None or model is None:
            raise InvalidRequestError(f"model '{self._model_id}' cannot serve LoRA adapters "
                                      "(a sharded, vision or encoder replica)")
        try:
            files = await asyncio.to_thread(read_adapter, model.model, name, path)
            await asyncio.wrap_future(self._engine.call(lambda: self._install(batch, files)))
        except (AdapterError, ValueError, MemoryTooSmall) as exc:
            raise InvalidRequestError(str(exc)) from exc

    def _install(self, batch: LocalBatch, files: AdapterFiles) -> None:
        """Engine thread: the adapter into its slot, the table's growth out of the KV
        budget (the tables pad every adapter to the largest rank, so the growth, not the
        file's size, is what it costs); undone where the budget cannot give it."""
        table = batch.adapters
        before = table.nbytes
        previous = table.files(files.name) if files.name in table.names else None
        batch.load_adapter(files)
        try:
            self._engine.kv_budget.weigh(table.nbytes - before)
        except MemoryTooSmall as exc:
            if previous is not None:
                table.load([previous])
            else:
                table.unload(files.name)
            raise MemoryTooSmall(f"adapter '{files.name}': no memory for its weights: "
                                 f"{exc}") from exc

    async def unload(self, name: str) -> None:
        """Stop serving adapter `name`, its memory given back to the KV budget;
        `InvalidRequestError` if it is not loaded or rows use it now."""
        batch = self.batch
        if batch is None:
            raise InvalidRequestError(f"model '{self._model_id}' has no adapters")
        try:
            await asyncio.wrap_future(self._engine.call(lambda: self._remove(batch, name)))
        except KeyError as exc:
            raise InvalidRequestError(f"model '{self._model_id}' has no adapter "
                                      f"'{name}'") from exc
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc

    def _remove(self, batch: LocalBatch, name: str) -> None:
        before = batch.adapters.nbytes
        batch.unload_adapter(name)
        self._engine.kv_budget.weigh(batch.adapters.nbytes - before)  # shrinks: never fails
