"""Cache-aware routing: each request goes to the model replica most likely to hold its
prompt prefix in its KV cache (`replicas.engine.kv.prefix_cache`), unless that replica is busier than
the least-loaded one by more than `routing.max_imbalance` requests, or has no KV room for it
(`deployments.routing.headroom`: then, as without a preference, the replicas with the most room go
first); a request no replica has room for now is shed with the overloaded error.

Orchard's own router rather than Ray's `ray.serve.llm.request_router.PrefixCacheAffinityRouter`,
because that one cannot read our request: it looks for a `prompt` or `messages` attribute
holding a string or a list of dicts, while `GenerationRequest.prompt` is a frozen dataclass
(`ChatPrompt`, `TextPrompt`, `TokenPrompt`), which it flattens to "" and then divides by its
length. It also blocks the router's event loop on `ray.get` calls to a shared prefix-tree
actor for every request, and has no notion of a client's session key.

Keys (`replicas.routing_keys`), in order of preference:
- the client's session (`GenerationRequest.session_key`): all its requests share one key;
  a key not seen yet prefers a replica by rendezvous hashing, which every ingress replica
  computes alike;
- else a hash chain over the prompt's leading units (messages of a chat, blocks of text or
  tokens). The deepest key of the chain that a replica reports holding (the cluster prefix
  directory: `PREFIXES` in its routing stats, `replicas.engine.kv.directory`) names
  the holder; where none does, the deepest key this router recorded against the replica
  it sent that request to (the whole prompt, and the prompt less its last message).

State is an LRU of at most `routing.max_keys` keys per ingress replica, beside the
replicas' reports. A key whose replica left is ignored (and dropped) at lookup.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from typing import Any, Collection, List, Mapping, Optional, Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.routing.headroom import Ledger, MemoryShed, Room, prompt_tokens
from deployments.routing.tenants import TenantLoads, spread
from replicas.contract import GenerationRequest, Tenancy
from replicas.routing_keys import RoutingKeys, digest, routing_keys

log = logging.getLogger(__name__)

# A replica's routing stats hold, under this name, the prefix keys its cache holds.
PREFIXES = "prefixes"
# The keyword a routed `stream` call gets: the replicas holding its prefix, from which the
# chosen one pulls the KV when it is not one of them (`replicas.kv_pull`).
HOLDERS = "prefix_holders"
_ROUTED_METHOD = "stream"
_NO_TENANCY = Tenancy()  # no tenants configured: routed by cache and load alone
_EXPORT_METHOD = "export_prefix"  # a pull: routed to the replica it names  # token counting uses no cache: it neither follows nor sets affinity


class Affinity:
    """Which replica each key went to (an LRU), and the ranked choice for a request."""

    def __init__(self, max_keys: int, max_imbalance: int) -> None:
        self.max_keys = max_keys
        self.max_imbalance = max_imbalance
        self._table: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def preferred(self, keys: RoutingKeys, replicas: Sequence[str],
                  directory: Mapping[str, Collection[bytes]] | None = None) -> str | None:
        """The replica holding the deepest key of `keys`, among `replicas`: by `directory`
        (replica -> the prefix keys it reports its cache holds), else by where this router
        sent the key last."""
        live = set(replicas)
        for key in keys.chain:
            owner = self._table.get(key)
            holders = _reporting(key, replicas, directory)
            if holders:
                # What a replica holds beats where a key was sent: another router may have
                # sent the conversation elsewhere since, or this one may never have seen it.
                return owner if owner in holders else \
                    max(holders, key=lambda r: digest(key, r.encode()))
            if owner is None:
                continue
            if owner in live:
                self._table.move_to_end(key)
                return owner
            del self._table[key]  # its replica left
        if keys.session and replicas:
            # A new session: the same replica from every ingress, with no shared state.
            return max(replicas, key=lambda r: digest(keys.chain[0], r.encode()))
        return None

    def rank(self, keys: RoutingKeys | None, loads: dict[str, int | None],
             room: Room | None = None,
             directory: Mapping[str, Collection[bytes]] | None = None) -> list[list[str]]:
        """Replica ids in preference ranks; [] leaves the choice to power-of-two.

        `loads` maps each candidate to its ongoing requests (None: unknown, taken as idle).
        `room`: the request against the replicas' KV memory; the cache-holding replica
        keeps its preference only where the request fits, and the others (or all, when
        none holds the prefix) go by most room.
        """
        if not loads:
            return []
        best = self.preferred(keys, list(loads), directory) if keys is not None else None
        if best is None:
            return [] if room is None or room.even(list(loads)) else room.ranks(list(loads))
        load = {r: n or 0 for r, n in loads.items()}
        least = min(load.values())
        rest = sorted((r for r in load if r != best), key=lambda r: load[r])
        ordered = ([rest] if rest else []) if room is None else room.ranks(rest)
        if load[best] - least > self.max_imbalance:
            # Uneven: losing the cache costs one prefill; waiting behind a queue costs more.
            log.debug("routing: %s is %d requests busier than the least loaded; not preferred",
                      best, load[best] - least)
            return [*ordered, [best]]
        if room is not None and not room.takes(best) and ordered:
            # Its cache would save a prefill, but the request would wait there for memory.
            log.debug("routing: %s has no KV room for the request; not preferred", best)
            return [*ordered, [best]]
        return [[best], *ordered]

    def record(self, keys: RoutingKeys, replica: str) -> None:
        for key in keys.record:
            self._table[key] = replica
            self._table.move_to_end(key)
        while len(self._table) > self.max_keys:
            self._table.popitem(last=False)


def reported_holders(keys: RoutingKeys, replicas: Sequence[str],
                     directory: Mapping[str, Collection[bytes]]) -> list[str]:
    """The replicas reporting the deepest key of `keys` any of them reports."""
    for key in keys.chain:
        holders = _reporting(key, replicas, directory)
        if holders:
            return holders
    return []


def _reporting(key: bytes, replicas: Sequence[str],
               directory: Mapping[str, Collection[bytes]] | None) -> list[str]:
    return [r for r in replicas if key in directory.get(r, ())] if directory else []


def _to_holder(candidates: List[RunningReplica],
               pending: PendingRequest) -> List[List[RunningReplica]]:
    """A pull goes to the replica it names; if that one left, to any (each answers from
    its own cache, or None)."""
    pull = pending.args[0] if pending.args else None
    named = [r for r in candidates
             if r.replica_id.to_full_id_str() == getattr(pull, "holder", None)]
    return [named] if named else _two_choices(candidates)


def _generation_request(pending: PendingRequest | None) -> GenerationRequest | None:
    if pending is None or pending.metadata.call_method != _ROUTED_METHOD:
        return None
    args = pending.args
    # Only our handle's calls carry a GenerationRequest; anything else (an HTTP request
    # from Serve's proxy) is routed by power-of-two.
    return args[0] if args and isinstance(args[0], GenerationRequest) else None


class PrefixAffinityRouter(RequestRouter):
    """Serve's request router for a model deployment (`routing.policy` prefix or session)."""

    def initialize_state(self, policy: str = "prefix", max_keys: int = 65536,
                         max_imbalance: int = 8, **unknown: Any) -> None:
        """Called by Serve with the deployment's `request_router_kwargs` (app.py)."""
        if unknown:  # the base class takes any keyword; a misspelt one must not pass unseen
            raise TypeError(f"unknown router settings: {', '.join(sorted(unknown))}")
        self._policy = policy
        self._affinity = Affinity(max_keys, max_imbalance)
        self._ledger = Ledger()
        self._tenants = TenantLoads()  # each tenant's requests in flight, by replica

    def _keys(self, request: GenerationRequest | None) -> RoutingKeys | None:
        if request is None:
            return None
        try:
            return routing_keys(request, self._policy)
        except Exception:  # noqa: BLE001 - a key we cannot build costs affinity, not the request
            log.exception("routing: no key for request %s", request.request_id)
            return None

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        if pending_request is not None and \
                pending_request.metadata.call_method == _EXPORT_METHOD:
            return _to_holder(candidate_replicas, pending_request)
        request = _generation_request(pending_request)
        if request is None or not candidate_replicas:
            return _two_choices(candidate_replicas)
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        self._ledger.forget(set(by_id))
        self._tenants.forget(set(by_id))
        room = Room({i: self._ledger.room(i, r.routing_stats) for i, r in by_id.items()},
                    prompt_tokens(request))
        if room.shed and pending_request is not None:
            self._shed(pending_request, request, room)
            return [candidate_replicas]  # its future is done: Serve stops routing it
        keys = self._keys(request)
        tenanted = request.tenancy != _NO_TENANCY
        loads = await self._loads(candidate_replicas) if keys is not None or tenanted \
            else dict.fromkeys(by_id)
        directory = {i: r.routing_stats.get(PREFIXES, ()) for i, r in by_id.items()}
        ranks = self._affinity.rank(keys, loads, room, directory)
        if tenanted:  # spread the tenant's requests: each replica's fair share sees it
            ranks = spread(ranks, self._tenants.of(request.tenancy.tenant, list(by_id)),
                           loads, self._affinity.max_imbalance)
        holders = reported_holders(keys, list(by_id), directory) if keys is not None else []
        if holders and pending_request is not None:
            pending_request.kwargs[HOLDERS] = tuple(holders)  # Serve passes it to `stream`
        if ranks:
            return [[by_id[r] for r in rank] for rank in ranks]
        return _two_choices(candidate_replicas)

    def _shed(self, pending: PendingRequest, request: GenerationRequest, room: Room) -> None:
        """Refuse before any replica has to: Serve's router has no refusal of its own, so
        the request's future gets the error (as a cancelled one is dropped, it leaves
        Serve's index of pending requests too)."""
        log.info("routing: request %s (about %d prompt tokens) shed: no replica of %d has "
                 "KV room for it now", request.request_id, room.tokens, len(room.rooms))
        if not pending.future.done():
            pending.future.set_exception(MemoryShed(
                f"no replica of the model '{request.model}' has KV memory for this request "
                "now; retry later"))
        self._remove_pending_request_from_indices(pending)

    async def _loads(self, replicas: List[RunningReplica]) -> dict[str, int | None]:
        loads: dict[str, int | None] = {}
        unknown: list[RunningReplica] = []
        for r in replicas:
            n = self._replica_queue_len_cache.get(r.replica_id)
            loads[r.replica_id.to_full_id_str()] = n
            if n is None:
                unknown.append(r)
        if unknown:  # asks those replicas once; the answers refresh Ray's cache as well
            for r, n in await self._probe_queue_lens(unknown, 0):
                loads[r.replica_id.to_full_id_str()] = n
        return loads

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: Any) -> None:
        request = _generation_request(pending_request)
        replica = replica_id.to_full_id_str()
        keys = self._keys(request)
        if keys is not None:
            self._affinity.record(keys, replica)
        if request is not None:
            self._ledger.sent(replica, prompt_tokens(request))
            if request.tenancy != _NO_TENANCY:
                self._tenants.sent(pending_request.metadata.internal_request_id, replica,
                                   request.tenancy.tenant)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._tenants.done(internal_request_id, replica_id.to_full_id_str())


def _two_choices(candidates: List[RunningReplica]) -> List[List[RunningReplica]]:
    """Ray's default: two random candidates, the less loaded of which Serve takes."""
    if len(candidates) <= 2:
        return [random.sample(candidates, len(candidates))]
    return [random.sample(candidates, 2)]
