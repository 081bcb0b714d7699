"""The ingress's `AdapterControl` (`ingress/lora_admin.py`) over the adapter store
(`adapter_store.py`): run-time LoRA adapters loaded onto every replica of a model, and the
ingress's model cards taught their names.

A load is read and checked on one replica first (`validate`: a bad adapter is a 400 before
anything changes), then written to the store, which every replica of the model follows
within a second; the call answers once all of them serve it (or after `wait_s`, with how
many do). Each ingress replica reads the store every `SYNC_S` on a thread of its own, so
one that did not take the call learns the name too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from typing import Any, Awaitable, Callable, Sequence

from deployments.adapter_store import SYNC_S, RuntimeAdapter, ServedBy, StoreRef
from ingress.client import ModelCard
from ingress.lora_admin import AdapterConflict, AdapterEntry, Unloaded
from replicas.errors import InvalidRequestError

log = logging.getLogger(__name__)

# (model, name, path) -> why the adapter cannot be served there, or None once one replica
# of the model serves it.
Validate = Callable[[str, str, str], Awaitable[str | None]]
_POLL_S = 0.2


class StoreCalls:
    """The store actor's calls the control makes, awaited (tests pass a fake). Reads of a
    store not yet created (no run-time load ever) answer empty; a put creates it."""

    def __init__(self, store: StoreRef) -> None:
        self._store = store

    async def put(self, adapter: RuntimeAdapter) -> float | None:
        answer: float | None = await self._store.get(create=True).put.remote(adapter)
        return answer

    async def remove(self, model: str, name: str) -> float | None:
        actor = self._store.get()
        if actor is None:
            return None
        answer: float | None = await actor.remove.remote(model, name)
        return answer

    async def adapters(self) -> tuple[int, tuple[RuntimeAdapter, ...]]:
        actor = self._store.get()
        if actor is None:
            return 0, ()
        answer: tuple[int, tuple[RuntimeAdapter, ...]] = await actor.adapters.remote()
        return answer

    async def served(self, model: str) -> tuple[ServedBy, ...]:
        actor = self._store.get()
        if actor is None:
            return ()
        answer: tuple[ServedBy, ...] = await actor.served.remote(model)
        return answer

    def adapters_now(self) -> tuple[int, tuple[RuntimeAdapter, ...]]:
        import ray

        actor = self._store.get()
        if actor is None:
            return 0, ()
        answer: tuple[int, tuple[RuntimeAdapter, ...]] = ray.get(
            actor.adapters.remote(), timeout=10.0)
        return answer


class ServedAdapters:
    """`configured`: the cards the config gives (their adapters are the config's);
    `apply`: swaps the client's cards for ones that add the run-time adapters."""

    def __init__(self, configured: Sequence[ModelCard], apply: Callable[[list[ModelCard]], None],
                 store: StoreCalls, validate: Validate, *, wait_s: float = 30.0,
                 drain_wait_s: float = 5.0) -> None:
        self._configured = list(configured)
        self._apply = apply
        self._store = store
        self._validate = validate
        self._wait_s = wait_s
        self._drain_wait_s = drain_wait_s
        self._version = -1
        self._runtime: tuple[RuntimeAdapter, ...] = ()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    # ---- the ingress's cards ---------------------------------------------------------

    def learn(self, version: int, runtime: tuple[RuntimeAdapter, ...]) -> None:
        """The store's set as of `version`: the cards rebuilt where it changed."""
        with self._lock:
            if version == self._version:
                return
            self._version, self._runtime = version, runtime
            cards = [dataclasses.replace(
                card, adapters=(*card.adapters, *(a.name for a in mine)),
                adapter_aliases=(*card.adapter_aliases,
                                 *((alias, a.name) for a in mine for alias in a.aliases)))
                for card in self._configured
                for mine in [[a for a in runtime if a.model == card.id]]]
            self._apply(cards)

    def watch(self, period_s: float = SYNC_S) -> None:
        """Follow the store on a thread (loads and unloads made through other ingress
        replicas)."""
        def run() -> None:
            while not self._stop.wait(period_s):
                try:
                    self.learn(*self._store.adapters_now())
                except Exception:  # noqa: BLE001 - a store that does not answer: next pass
                    log.debug("reading the adapter store failed", exc_info=True)

        threading.Thread(target=run, name="adapter-cards", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    async def _refresh(self) -> None:
        self.learn(*await self._store.adapters())

    # ---- AdapterControl --------------------------------------------------------------

    async def adapters(self) -> Sequence[AdapterEntry]:
        await self._refresh()
        entries = [AdapterEntry(card.id, name, tuple(a for a, n in card.adapter_aliases
                                                     if n == name))
                   for card in self._configured for name in card.adapters]
        served: dict[str, tuple[ServedBy, ...]] = {}
        for adapter in self._runtime:
            if adapter.model not in served:
                served[adapter.model] = await self._store.served(adapter.model)
            entries.append(AdapterEntry(
                adapter.model, adapter.name, adapter.aliases, adapter.path, runtime=True,
                replicas=sum(adapter.name in s.names for s in served[adapter.model])))
        return entries

    async def load(self, model: str, name: str, path: str,
                   aliases: tuple[str, ...]) -> AdapterEntry:
        why = await self._validate(model, name, path)
        if why is not None:
            raise InvalidRequestError(why, param="path")
        put_at = await self._store.put(RuntimeAdapter(model, name, path, aliases))
        if put_at is None:
            raise AdapterConflict(f"model '{model}' already serves adapter '{name}'",
                                  "adapter_exists")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._wait_s
        while True:
            reports = [s for s in await self._store.served(model) if s.at >= put_at]
            errors = [why for s in reports for n, why in s.errors if n == name]
            if errors:  # a replica whose node reads it otherwise: served nowhere, then
                await self._store.remove(model, name)
                await self._refresh()
                raise InvalidRequestError(errors[0], param="path")
            loaded = sum(name in s.names for s in reports)
            everyone = await self._store.served(model)
            if (loaded and loaded == len(everyone)) or loop.time() >= deadline:
                break
            await asyncio.sleep(_POLL_S)
        await self._refresh()
        return AdapterEntry(model, name, aliases, path, runtime=True, replicas=loaded)

    async def unload(self, model: str, name: str) -> Unloaded:
        await self._refresh()
        was = next((a for a in self._runtime if (a.model, a.name) == (model, name)), None)
        removed_at = await self._store.remove(model, name)
        await self._refresh()  # out of routing here at once
        entry = AdapterEntry(model, name, was.aliases if was else (),
                             was.path if was else None, runtime=True)
        if removed_at is None:  # another call unloaded it meanwhile
            return Unloaded(entry, 0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._drain_wait_s
        while True:
            held = sum(name in s.names for s in await self._store.served(model))
            if not held or loop.time() >= deadline:
                return Unloaded(entry, held)
            await asyncio.sleep(_POLL_S)

