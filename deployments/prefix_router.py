"""Cache-aware routing: each request goes to the model replica most likely to hold its
prompt prefix in its KV cache (`replicas.engine.prompt_cache`), unless that replica is busier than
the least-loaded one by more than `routing.max_imbalance` requests, or has no KV room for it
(`deployments.headroom`: then, as without a preference, the replicas with the most room go
first); a request no replica has room for now is shed with the overloaded error.

Orchard's own router rather than Ray's `ray.serve.llm.request_router.PrefixCacheAffinityRouter`,
because that one cannot read our request: it looks for a `prompt` or `messages` attribute
holding a string or a list of dicts, while `GenerationRequest.prompt` is a frozen dataclass
(`ChatPrompt`, `TextPrompt`, `TokenPrompt`), which it flattens to "" and then divides by its
length. It also blocks the router's event loop on `ray.get` calls to a shared prefix-tree
actor for every request, and has no notion of a client's session key.

Keys, in order of preference:
- the client's session (`GenerationRequest.session_key`): all its requests share one key;
  a key not seen yet prefers a replica by rendezvous hashing, which every ingress replica
  computes alike;
- else a hash chain over the prompt's leading units (messages of a chat, blocks of text or
  tokens), seeded with the tools (they render before the messages). A request records the
  hash of its whole prompt, and of its prompt less the last message, against the replica
  it went to; the next turn of the conversation extends that prompt, so its chain contains
  the recorded hash, and a retry with an edited last message contains the second.

State is an LRU of at most `routing.max_keys` keys per ingress replica. A key whose replica
left is ignored (and dropped) at lookup.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.headroom import Ledger, MemoryShed, Room, prompt_tokens
from replicas.contract import ChatMessage, ChatPrompt, GenerationRequest, TextPrompt

log = logging.getLogger(__name__)

TEXT_BLOCK_CHARS = 512  # a completions prompt is chained in blocks of this many characters
TOKEN_BLOCK = 128  # and a token prompt in blocks of this many tokens
_ROUTED_METHOD = "stream"  # token counting uses no cache: it neither follows nor sets affinity


@dataclass(frozen=True)
class RoutingKeys:
    """`chain`: lookup keys, deepest first; `record`: the keys a routed request leaves."""

    chain: tuple[bytes, ...]
    record: tuple[bytes, ...]
    session: bool = False


def routing_keys(request: GenerationRequest, policy: str) -> RoutingKeys | None:
    """The request's keys under `policy` (`prefix` or `session`); None: no affinity."""
    if request.session_key:
        key = b"s:" + request.session_key.encode("utf-8", "replace")
        return RoutingKeys((key,), (key,), session=True)
    if policy != "prefix":
        return None
    seed = _digest(b"t", repr(request.tools).encode())
    chain = list(_chain(seed, _units(request)))
    if not chain:
        return None
    # The whole prompt, and (past a first exchange) the prompt before its last message:
    # not shallower, or every conversation sharing a system prompt would follow the first.
    record = (chain[-1],) + ((chain[-2],) if len(chain) >= 3 else ())
    return RoutingKeys(tuple(reversed(chain)), record)


def _units(request: GenerationRequest) -> Iterable[bytes]:
    prompt = request.prompt
    if isinstance(prompt, ChatPrompt):
        return (_message_bytes(m) for m in prompt.messages)
    if isinstance(prompt, TextPrompt):
        text = prompt.text.encode("utf-8", "replace")
        step = TEXT_BLOCK_CHARS
        return (text[i:i + step] for i in range(0, len(text) - step + 1, step))
    ids = prompt.token_ids
    return (repr(ids[i:i + TOKEN_BLOCK]).encode()
            for i in range(0, len(ids) - TOKEN_BLOCK + 1, TOKEN_BLOCK))


def _message_bytes(message: ChatMessage) -> bytes:
    return repr((message.role, message.content, message.reasoning, message.tool_calls,
                 message.tool_call_id, message.name)).encode("utf-8", "replace")


def _chain(seed: bytes, units: Iterable[bytes]) -> Iterable[bytes]:
    current = seed
    for unit in units:
        current = _digest(current, unit)
        yield current


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


class Affinity:
    """Which replica each key went to (an LRU), and the ranked choice for a request."""

    def __init__(self, max_keys: int, max_imbalance: int) -> None:
        self.max_keys = max_keys
        self.max_imbalance = max_imbalance
        self._table: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def preferred(self, keys: RoutingKeys, replicas: Sequence[str]) -> str | None:
        """The replica holding the deepest key of `keys`, among `replicas`."""
        live = set(replicas)
        for key in keys.chain:
            owner = self._table.get(key)
            if owner is None:
                continue
            if owner in live:
                self._table.move_to_end(key)
                return owner
            del self._table[key]  # its replica left
        if keys.session and replicas:
            # A new session: the same replica from every ingress, with no shared state.
            return max(replicas, key=lambda r: _digest(keys.chain[0], r.encode()))
        return None

    def rank(self, keys: RoutingKeys | None, loads: dict[str, int | None],
             room: Room | None = None) -> list[list[str]]:
        """Replica ids in preference ranks; [] leaves the choice to power-of-two.

        `loads` maps each candidate to its ongoing requests (None: unknown, taken as idle).
        `room`: the request against the replicas' KV memory; the cache-holding replica
        keeps its preference only where the request fits, and the others (or all, when
        none holds the prefix) go by most room.
        """
        if not loads:
            return []
        best = self.preferred(keys, list(loads)) if keys is not None else None
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
        request = _generation_request(pending_request)
        if request is None or not candidate_replicas:
            return _two_choices(candidate_replicas)
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        self._ledger.forget(set(by_id))
        room = Room({i: self._ledger.room(i, r.routing_stats) for i, r in by_id.items()},
                    prompt_tokens(request))
        if room.shed and pending_request is not None:
            self._shed(pending_request, request, room)
            return [candidate_replicas]  # its future is done: Serve stops routing it
        keys = self._keys(request)
        loads = await self._loads(candidate_replicas) if keys is not None \
            else dict.fromkeys(by_id)
        ranks = self._affinity.rank(keys, loads, room)
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


def _two_choices(candidates: List[RunningReplica]) -> List[List[RunningReplica]]:
    """Ray's default: two random candidates, the less loaded of which Serve takes."""
    if len(candidates) <= 2:
        return [random.sample(candidates, len(candidates))]
    return [random.sample(candidates, 2)]
