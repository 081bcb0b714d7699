"""A sharded replica's other ranks: Ray actors that rank 0 (the Serve replica) starts in
its own placement group, owns, watches and tears down.

Serve reserves the replica's placement group (`placement_group_bundles`, one bundle per
shard, `app.py`) and runs the replica in bundle 0; rank r runs in bundle r. Ray knows every
node, so no ssh, hostfile or launcher of ours is involved: each actor reports the address
it will listen on, rank 0 hands every rank its `ShardPlan`, and MLX's backend connects
them. An actor is owned by the replica, so when Serve stops or replaces the replica, its
shards go with it and the placement group is released.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import threading
import time
from typing import Any, Callable

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.cluster import metal_available, require_metal
from deployments.config import DistributedSettings, ModelSettings
from replicas.engine.config import EngineConfig, Mode, ShardPlan
from replicas.engine.sharded.kv_parts import KvParts
from replicas.engine.kv.transfer import PrefixKV
from replicas.sharding import follow, machine_bytes, plan_stages

log = logging.getLogger(__name__)

# How long a health check waits for a shard to answer a ping.
_PING_TIMEOUT_S = 10.0
# How often the watch pings every shard, busy or idle: a frozen Mac answers nothing.
_HEARTBEAT_S = 1.0
# How long a rank keeps an exported part for the asker when pulls are not configured
# here (a prefill replica's answer to its decode replica).
_PART_TIMEOUT_S = 30.0


def listen_address(settings: DistributedSettings) -> str:
    """`host:port` this process's rank will listen on: the first free port in the range."""
    host = settings.host or ray.util.get_node_ip_address()
    low, high = settings.port_range or (0, 0)
    for port in range(low, high + 1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return f"{host}:{sock.getsockname()[1]}"
    raise RuntimeError(f"no free port for a shard on {host} in {low}..{high}")


class ShardWorker:
    """Rank r >= 1 of one sharded replica."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._work = threading.Event()  # set by rank 0's `wake`
        self._parts = KvParts()  # this rank's parts of KV moving between replicas

    def wake(self) -> None:
        self._work.set()

    def _wait_for_work(self) -> None:
        self._work.wait()
        self._work.clear()

    def address(self, settings: DistributedSettings) -> tuple[str, str, int]:
        """Where this rank will listen, its node, and its machine's memory (stage sizes)."""
        return listen_address(settings), ray.get_runtime_context().get_node_id(), \
            machine_bytes()

    def run(self, source: str, plan: ShardPlan, engine: EngineConfig,
            metal_for: str | None = None) -> int:
        """Load this rank's shard and follow rank 0 until it stops (the steps run).
        `metal_for`: the model id, when its placement requires Metal on every rank."""
        from replicas.sources import resolve_source

        if metal_for is not None:
            require_metal(metal_for)  # each Mac checks itself, not only rank 0's
        return follow(source, resolve_source(source), plan, engine, self._wait_for_work,
                      self._parts)

    def take_export(self, export_id: str, timeout_s: float) -> Any:
        """This rank's encoded part of a prefix its replica exports (a numpy view: Ray
        keeps it in this node's object store, where the asker's rank fetches it)."""
        return self._parts.take_export(export_id, timeout_s)

    def stage(self, staged: str, payload: Any, tokens: int) -> None:
        """This rank's part of a pulled prefix: `payload` arrives as an object Ray fetched
        from the holder's same rank; decoded and checked here, off the engine thread."""
        from replicas.engine.kv.transfer import decode

        layers = decode(payload)
        held = {int(getattr(layer, "offset", tokens)) for layer in layers}
        if held != {tokens}:
            raise ValueError(f"a pulled part holds {sorted(held)} positions, not {tokens}")
        self._parts.stage(staged, layers)

    def discard(self, staged: str) -> None:
        self._parts.discard(staged)

    def ping(self) -> int:
        return self._rank

    def node_facts(self) -> tuple[int, bool]:
        """This rank's node for the cluster snapshot: its RAM, and whether it has Metal."""
        from deployments.board import node_memory_bytes

        return node_memory_bytes(), metal_available()

    def memory_limit(self) -> int:
        """MLX's memory limit in this rank's process (each rank sets its own at load)."""
        import mlx.core as mx  # only where a rank runs

        return int(mx.get_memory_limit())


class ShardGroup:
    """Rank 0's handle on ranks 1..N-1."""

    def __init__(self, settings: ModelSettings) -> None:
        self._settings = settings
        self._workers: list[Any] = []
        self._runs: list[Any] = []
        self._lost: str | None = None
        self._stopping = False
        self.nodes: list[str] = []  # node id per rank, rank 0 first
        self.layers: tuple[int, ...] | None = None  # pipeline layers per rank, when uneven
        # Ranks 1..N-1's nodes as the cluster snapshot shows them: RAM and Metal.
        self.node_facts: list[tuple[int, bool]] = []

    @property
    def size(self) -> int:
        return self._settings.shards

    def start(self, mode: Mode, engine: EngineConfig, layers: int) -> ShardPlan:
        """Start the other ranks (they wait for rank 0 to join) and return rank 0's plan.
        `layers`: the model's, which a pipeline splits by each node's memory."""
        settings, dist = self._settings, self._settings.distributed
        group = get_current_placement_group()
        if group is None:
            raise RuntimeError("a sharded replica must run in its placement group")
        resources = {}
        if settings.placement is not None and settings.placement.pin:
            resources = {settings.placement.resource: settings.placement.resource_per_replica}
        owner = ray.get_runtime_context().get_actor_id() or "driver"
        self._workers = [
            ray.remote(ShardWorker).options(
                # Threaded: `ping` and `wake` answer while `run` works and KV parts move.
                max_concurrency=16,
                # Named, so an operator (or a test) can find a replica's shards by model.
                name=f"orchard-shard:{settings.id}:{rank}:{owner[:12]}",
                num_cpus=0, resources=resources,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=rank),
            ).remote(rank)
            for rank in range(1, settings.shards)]
        found = ray.get([w.address.remote(dist) for w in self._workers])
        addresses = (listen_address(dist), *(a for a, _, _ in found))
        self.nodes = [ray.get_runtime_context().get_node_id(), *(n for _, n, _ in found)]
        self.node_facts = ray.get([w.node_facts.remote() for w in self._workers])
        devices = tuple(tuple(row) for row in dist.rdma_devices) if dist.rdma_devices else None
        memories = dist.node_memory_bytes or [machine_bytes(), *(m for _, _, m in found)]
        split = plan_stages(mode, layers, memories, dist.pipeline_layers, settings.id)
        self.layers = split

        def plan(rank: int) -> ShardPlan:
            return ShardPlan(mode, rank, settings.shards, dist.backend, addresses, devices,
                             split)

        metal = settings.id if settings.placement is not None \
            and settings.placement.metal_required else None
        self._runs = [w.run.remote(settings.source, plan(rank), engine, metal)
                      for rank, w in enumerate(self._workers, start=1)]
        log.info("model %s: %d shards (%s) at %s", settings.id, settings.shards, mode,
                 ", ".join(addresses))
        return plan(0)

    def watch(self, on_lost: Callable[[str], None], stalled_for: Callable[[], float]) -> None:
        """Call `on_lost(reason)` once, from a daemon thread, when a shard ends or errs, a
        shard misses its heartbeats past `heartbeat_timeout_s` (frozen, asleep, cut off:
        busy or idle), or a step stays stuck past `collective_timeout_s`."""
        dist = self._settings.distributed
        timeout = dist.collective_timeout_s
        heard = [time.monotonic()] * len(self._workers)  # each shard's last answer
        pings: list[Any] = [None] * len(self._workers)

        def silent() -> str | None:
            now = time.monotonic()
            for i, worker in enumerate(self._workers):
                if pings[i] is not None and ray.wait([pings[i]], timeout=0)[0]:
                    heard[i], pings[i] = now, None
                if pings[i] is None:
                    pings[i] = worker.ping.remote()
                if now - heard[i] > dist.heartbeat_timeout_s:
                    return f"shard {i + 2} of {self.size} has not answered for " \
                           f"{now - heard[i]:.0f}s (distributed.heartbeat_timeout_s is " \
                           f"{dist.heartbeat_timeout_s:g}): frozen, asleep or cut off"
            return None

        def loop() -> None:
            while not self._stopping:
                ready, _ = ray.wait(self._runs, num_returns=1, timeout=_HEARTBEAT_S)
                if self._stopping:
                    return
                reason = self._ended(ready[0]) if ready else silent()
                stalled = stalled_for()
                if reason is None and stalled > timeout:
                    reason = f"a batch step has not returned for {stalled:.0f}s " \
                             f"(distributed.collective_timeout_s is {timeout:g})"
                if reason is not None:
                    self._lost = reason
                    log.error("model %s: %s; failing the replica", self._settings.id, reason)
                    on_lost(reason)
                    return

        threading.Thread(target=loop, name="orchard-shard-watch", daemon=True).start()

    def _ended(self, ref: Any) -> str:
        rank = self._runs.index(ref) + 1
        try:
            ray.get(ref)
            return f"shard {rank + 1} of {self._settings.shards} stopped"
        except Exception as exc:  # noqa: BLE001 - any way a shard ends is fatal to the replica
            return f"shard {rank + 1} of {self._settings.shards} failed: {type(exc).__name__}"

    # ---- KV moving rank to rank (`replicas.kv_pull.Ranks`) ----------------------------

    def attach(self, kv: PrefixKV) -> PrefixKV:
        """A prefix this replica exports: handles to the other ranks' parts, which stay in
        each rank's node until the asker's same rank fetches them."""
        timeout = self._settings.routing.pull.timeout_s if self._settings.routing.pull \
            else _PART_TIMEOUT_S
        return dataclasses.replace(kv, ranks=tuple(
            w.take_export.remote(kv.export_id, timeout) for w in self._workers))

    async def stage(self, staged: str, kv: PrefixKV) -> None:
        """A pulled prefix: rank r fetches part r from the holder's rank r (Ray resolves
        the handle on rank r's node, so no part passes through rank 0)."""
        if len(kv.ranks) != len(self._workers):
            raise ValueError(f"the prefix has {len(kv.ranks) + 1} parts, this replica "
                             f"{len(self._workers) + 1} ranks")
        await asyncio.gather(*(w.stage.remote(staged, part, len(kv.tokens))
                               for w, part in zip(self._workers, kv.ranks)))

    def discard(self, staged: str) -> None:
        for worker in self._workers:
            worker.discard.remote(staged)

    def wake(self) -> None:
        """Rank 0's batch is about to step again: the others leave their idle wait."""
        for worker in self._workers:
            worker.wake.remote()

    def check(self) -> None:
        """Raise unless every shard is alive and answering (the replica's health check)."""
        if self._lost is not None:
            raise RuntimeError(self._lost)
        ray.get([w.ping.remote() for w in self._workers], timeout=_PING_TIMEOUT_S)

    def stop(self, grace_s: float = 10.0) -> None:
        """After rank 0 told the others to stop: wait briefly, then end any still running."""
        self._stopping = True
        deadline = time.monotonic() + grace_s
        for ref, worker in zip(self._runs, self._workers):
            try:
                ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - stuck or gone: end it
                ray.kill(worker)
