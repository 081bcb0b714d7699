"""Memory-aware routing: what each model replica reports of its KV memory, what a request
needs, which replicas can start it now, and their ranks by headroom.

A replica reports through Serve's routing stats (`ModelDeployment.record_routing_stats`,
polled every `routing.stats_period_s`); the request router (`deployments.routing.prefix`)
reads them on each `RunningReplica`. Until a report can count a request, the router counts
what it sent each replica itself, so a burst does not all go to the one that looked
emptiest.

No MLX here: the router runs in the ingress's process.
"""

from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

from ray.serve.exceptions import BackPressureError

from replicas.contract import ChatPrompt, GenerationRequest, TextPrompt

# The router cannot tokenize: a text prompt is taken as this many characters a token,
# about what BPE vocabularies average on English (token prompts are counted exactly).
CHARS_PER_TOKEN = 4
# Replicas whose room is within this share of the budget of the roomiest count as equal:
# Serve then picks the less loaded of them, rather than memory deciding on crumbs.
TIE_SHARE = 0.1
# Seconds a routed request takes to reach its replica's admission, after which the
# replica's next report counts it (`Ledger`).
ADMIT_LAG_S = 1.0


class _Layout(Protocol):
    def tokens_within(self, nbytes: int) -> int: ...


class _Memory(Protocol):
    """`replicas.engine.kv.budget.MemoryStats`, read without importing MLX here."""

    @property
    def budget_bytes(self) -> int: ...
    @property
    def projected_bytes(self) -> int: ...
    @property
    def waiting(self) -> int: ...
    @property
    def layout(self) -> _Layout: ...


class MemoryShed(BackPressureError):
    """The router's refusal: no replica has KV room for the request now. A Serve
    backpressure error, so the model client answers it as one (overloaded, Retry-After)."""

    def __init__(self, message: str) -> None:
        super().__init__(0, 0)
        self._message = message
        self.args = (message,)  # pickles as MemoryShed(message)


@dataclass(frozen=True)
class ReplicaRoom:
    """One replica's KV memory as its last report gave it, in tokens of one sequence."""

    room_tokens: int  # the longest new sequence the free budget holds
    budget_tokens: int  # the longest one the whole budget holds
    waiting: int  # requests waiting for memory
    max_waiting: int  # past this many, the replica refuses
    report: int  # when the replica made this report: wall-clock milliseconds

    @classmethod
    def of(cls, memory: _Memory, max_waiting: int, report: int) -> "ReplicaRoom":
        free = max(0, memory.budget_bytes - memory.projected_bytes)
        return cls(memory.layout.tokens_within(free),
                   memory.layout.tokens_within(memory.budget_bytes),
                   memory.waiting, max_waiting, report)

    def stats(self) -> dict[str, int]:
        return {f"kv_{k}": v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def read(cls, stats: Mapping[str, Any]) -> "ReplicaRoom | None":
        """From a replica's routing stats; None until it has reported."""
        try:
            return cls(**{name: int(stats[f"kv_{name}"]) for name in cls.__dataclass_fields__})
        except (KeyError, TypeError, ValueError):
            return None

    def takes(self, tokens: int) -> bool:
        """Whether the request would start here now: its KV fits beside the running
        requests', and no full queue of requests waiting for memory is ahead of it."""
        return tokens <= self.room_tokens and self.waiting < max(1, self.max_waiting)

    def refuses(self, tokens: int) -> bool:
        """Whether the replica would refuse the request now: no room for it, and no place
        left in its queue of requests waiting for memory (one may wait there, and a
        waiting request soon starts as others end)."""
        return tokens > self.room_tokens and self.waiting >= self.max_waiting


def prompt_tokens(request: GenerationRequest) -> int:
    """The KV a request needs to start, in tokens: its prompt (estimated from text) and
    what a resumed stream already generated. What it will generate is left to the
    replica's admission, which grows a request's reservation as it decodes."""
    prompt = request.prompt
    if isinstance(prompt, ChatPrompt):
        chars = sum(len(m.content) + len(m.reasoning or "")
                    + sum(len(c.name) + len(c.arguments) for c in m.tool_calls)
                    for m in prompt.messages)
        chars += sum(len(t.description or "") + len(t.parameters) for t in request.tools)
        tokens = chars // CHARS_PER_TOKEN
    elif isinstance(prompt, TextPrompt):
        tokens = len(prompt.text) // CHARS_PER_TOKEN
    else:
        tokens = len(prompt.token_ids)
    return tokens + len(request.resume or ())


@dataclass(frozen=True)
class Room:
    """One request against the candidates' memory: `rooms` by replica id (None: not
    reported yet, taken as able), `tokens` what the request needs."""

    rooms: dict[str, ReplicaRoom | None]
    tokens: int

    def takes(self, replica: str) -> bool:
        room = self.rooms.get(replica)
        return room is None or room.takes(self.tokens)

    @property
    def shed(self) -> bool:
        """Every candidate reported and each would refuse the request now, though it would
        fit in some replica's whole budget (one that fits none is the replica's 400 to
        give): shed here, before a replica has to refuse it."""
        rooms = list(self.rooms.values())
        known = [r for r in rooms if r is not None]
        return bool(rooms) and len(known) == len(rooms) \
            and all(r.refuses(self.tokens) for r in known) \
            and any(self.tokens <= r.budget_tokens for r in known)

    def _room(self, replica: str) -> float:
        room = self.rooms.get(replica)
        return float("inf") if room is None else room.room_tokens

    def _tie(self, replicas: list[str]) -> float:
        budgets = [r.budget_tokens for r in map(self.rooms.get, replicas) if r is not None]
        return TIE_SHARE * max(budgets, default=0)

    def even(self, replicas: list[str]) -> bool:
        """All of `replicas` take the request, with room within the tie of each other."""
        if not all(self.takes(r) for r in replicas):
            return False
        rooms = [self._room(r) for r in replicas]
        if min(rooms) == float("inf"):  # none reported yet
            return True
        return max(rooms) - min(rooms) <= self._tie(replicas)

    def ranks(self, replicas: list[str]) -> list[list[str]]:
        """`replicas` in ranks: those that take the request with the most room (within the
        tie, shuffled: Serve takes the first of equally loaded), the other takers by room,
        then the rest by room (a stale report must not leave the request nowhere to go)."""
        takers = sorted((r for r in replicas if self.takes(r)), key=self._room, reverse=True)
        others = sorted((r for r in replicas if not self.takes(r)), key=self._room,
                        reverse=True)
        if not takers:
            return [others] if others else []
        top = self._room(takers[0]) - self._tie(replicas)
        first = [r for r in takers if self._room(r) >= top]
        random.shuffle(first)
        rest = [r for r in takers if self._room(r) < top]
        return [rank for rank in (first, rest, others) if rank]


class Ledger:
    """What this router sent each replica lately, in tokens: a report counts a request only
    once the request has had `ADMIT_LAG_S` to reach the replica's admission, so until then
    the router takes it off the replica's room itself. Clocks are wall clocks (a report's
    time is the replica's), which a cluster's NTP keeps well within the lag."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._sent: dict[str, list[tuple[float, int]]] = {}  # replica -> (sent at, tokens)

    def room(self, replica: str, stats: Mapping[str, Any]) -> ReplicaRoom | None:
        """The replica's last report, less what was sent to it since (as far as the report
        cannot have counted it yet)."""
        room = ReplicaRoom.read(stats)
        if room is None:
            return None
        counted_before = room.report / 1000 - ADMIT_LAG_S
        recent = [(at, n) for at, n in self._sent.get(replica, ()) if at > counted_before]
        if not recent:
            self._sent.pop(replica, None)
            return room
        self._sent[replica] = recent
        return dataclasses.replace(
            room, room_tokens=max(0, room.room_tokens - sum(n for _, n in recent)))

    def sent(self, replica: str, tokens: int) -> None:
        self._sent.setdefault(replica, []).append((self._clock(), tokens))

    def forget(self, live: set[str]) -> None:
        for replica in [r for r in self._sent if r not in live]:
            del self._sent[replica]
