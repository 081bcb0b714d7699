"""LoRA adapters loaded at run time, held where every replica finds them: one named Ray
actor per Serve application (`adapter_store`), as the status board is (`board.py`).

The admin endpoint (`ingress/lora_admin.py`, through `deployments/adapter_admin.py`)
writes the set; every model replica reads it when it starts, before it serves, and then
every `SYNC_S` (`AdapterSync`): it loads what it lacks, unloads what left the set once no
row uses it, and reports what it serves, which the endpoint waits on. Detached, so the set
outlives any replica; it does not outlive the cluster (the config's `adapters` do).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import ray

from replicas.errors import InvalidRequestError

log = logging.getLogger(__name__)

_ACTOR_NAME = "orchard-adapters-{app}"
SYNC_S = 1.0  # how often a replica reads the set, and reports what it serves
LIVE_S = 5 * SYNC_S  # a replica silent this long has stopped (or is stuck loading)
_CALL_S = 10.0  # the longest a replica's thread waits on the store


@dataclass(frozen=True)
class RuntimeAdapter:
    model: str  # the base model's id
    name: str
    path: str
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class ServedBy:
    """What one replica of `model` served at `at` (the store's clock), and the adapters of
    the set it could not load, with why."""

    replica: str
    model: str
    names: tuple[str, ...]
    errors: tuple[tuple[str, str], ...] = ()
    at: float = 0.0


@ray.remote(num_cpus=0, max_restarts=-1)
class _AdapterStore:
    def __init__(self) -> None:
        self._adapters: dict[tuple[str, str], RuntimeAdapter] = {}
        self._version = 0
        self._served: dict[str, ServedBy] = {}

    def put(self, adapter: RuntimeAdapter) -> float | None:
        """Adds `adapter`; the store's time, or None where the name is taken."""
        key = (adapter.model, adapter.name)
        if key in self._adapters:
            return None
        self._adapters[key] = adapter
        self._version += 1
        return time.time()

    def remove(self, model: str, name: str) -> float | None:
        if self._adapters.pop((model, name), None) is None:
            return None
        self._version += 1
        return time.time()

    def adapters(self) -> tuple[int, tuple[RuntimeAdapter, ...]]:
        return self._version, tuple(self._adapters.values())

    def report(self, served: ServedBy) -> None:
        self._served[served.replica] = ServedBy(served.replica, served.model, served.names,
                                                served.errors, time.time())

    def gone(self, replica: str) -> None:
        self._served.pop(replica, None)

    def served(self, model: str) -> tuple[ServedBy, ...]:
        """The reports of `model`'s live replicas."""
        now = time.time()
        return tuple(s for s in self._served.values()
                     if s.model == model and now - s.at <= LIVE_S)


class StoreRef:
    """The application's store actor, looked up when needed. Only a write (the first
    run-time load) creates it: an app that never loads an adapter at run time starts no
    process for it, and its replicas' start waits on none."""

    def __init__(self, app: str) -> None:
        self._name = _ACTOR_NAME.format(app=app)
        self._actor: Any = None

    def get(self, *, create: bool = False) -> Any:
        """The actor; None where it does not exist and `create` is False."""
        if self._actor is None:
            if create:
                self._actor = _AdapterStore.options(  # type: ignore[attr-defined]
                    name=self._name, namespace="orchard", get_if_exists=True,
                    lifetime="detached").remote()
            else:
                try:
                    self._actor = ray.get_actor(self._name, namespace="orchard")
                except ValueError:  # no run-time adapter was ever loaded in this app
                    return None
        return self._actor


class AdapterReplica(Protocol):
    """What the sync needs of `ModelReplica`."""

    def adapter_names(self) -> tuple[str, ...]: ...
    async def load_adapter(self, name: str, path: str) -> None: ...
    async def unload_adapter(self, name: str) -> None: ...


class AdapterSync:
    """One replica's side: its adapters made the store's set (beside its configured
    ones), on a thread of its own. `read`/`report`: the store's calls (tests pass plain
    functions)."""

    def __init__(self, replica: AdapterReplica, model: str, replica_id: str,
                 configured: tuple[str, ...],
                 read: Callable[[], tuple[RuntimeAdapter, ...]],
                 report: Callable[[ServedBy], None]) -> None:
        self._replica = replica
        self._model = model
        self._id = replica_id
        self._configured = configured
        self._read = read
        self._report = report
        self._failed: dict[str, tuple[str, str]] = {}  # name -> (path, why), not retried
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def over_store(cls, replica: AdapterReplica, model: str, replica_id: str,
                   configured: tuple[str, ...], store: StoreRef) -> "AdapterSync":
        def read() -> tuple[RuntimeAdapter, ...]:
            actor = store.get()
            if actor is None:
                return ()
            return tuple(ray.get(actor.adapters.remote(), timeout=_CALL_S)[1])

        def report(served: ServedBy) -> None:
            actor = store.get()
            if actor is not None:  # not awaited: the next one replaces it anyway
                actor.report.remote(served)

        return cls(replica, model, replica_id, configured, read, report)

    def once(self) -> None:
        """Read the set, load and unload to match it, report (blocking)."""
        wanted = {a.name: a.path for a in self._read() if a.model == self._model}
        have = set(self._replica.adapter_names())
        self._failed = {n: f for n, f in self._failed.items() if wanted.get(n) == f[0]}
        for name, path in wanted.items():
            if name in have or name in self._failed:
                continue
            try:
                asyncio.run(self._replica.load_adapter(name, path))
            except InvalidRequestError as exc:
                log.warning("%s: adapter '%s' not loaded: %s", self._model, name, exc)
                self._failed[name] = (path, str(exc))
        for name in have - wanted.keys() - set(self._configured):
            try:
                asyncio.run(self._replica.unload_adapter(name))
            except InvalidRequestError:  # rows use it: freed on a later pass, once they end
                pass
        self._report(ServedBy(self._id, self._model, self._replica.adapter_names(),
                              tuple((n, why) for n, (_, why) in self._failed.items())))

    def start(self, period_s: float = SYNC_S) -> None:
        def run() -> None:
            while not self._stop.wait(period_s):
                try:
                    self.once()
                except Exception:  # noqa: BLE001 - a store that does not answer: next pass
                    log.debug("adapter sync failed", exc_info=True)

        self._thread = threading.Thread(target=run, name="adapter-sync", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
