"""How the engine fails requests when something goes wrong under them (engine thread, or
`Engine.abort`'s caller under the engine's lock).

Three sizes of failure, smallest first:
- a request whose own processing raised fails alone (`REQUEST_FAILED`; `core.py` sends it);
- a failed batch step or insert fails the batch (`batch_failed`): its rows and the requests
  that were joining it, while the engine starts a fresh batch; a sharded batch cannot start
  over, and `BatchLost` stops the engine instead;
- a dead engine fails everything it holds (`abandoned` plus `fail_rows`): queued commands
  (calls get `EngineDead`), requests waiting for memory or prefilling, and the batch's
  rows, as the replica's fault (`lost`) so a client may resume elsewhere.

Each returns an outbox (`deliver`'s pairs) rather than delivering, so a caller holding the
engine's lock delivers after letting it go.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from replicas.contract import ErrorKind, Failed, OutputEvent
from replicas.engine.calls import Commands
from replicas.engine.delivery import EventSink
from replicas.engine.kv.budget import KvBudget
from replicas.engine.scheduling import Active, Prefills, Queued, Waiting
from replicas.errors import ReplicaError

Outbox = list[tuple[EventSink, list[OutputEvent]]]

# What a client is told when its request failed inside the engine; the log has the details.
REQUEST_FAILED = "generation failed for this request"


class EngineDead(RuntimeError):
    pass


class BatchLost(RuntimeError):
    """A step failed on a batch that cannot start over (a sharded one): the engine stops."""


def lost(reason: str) -> Failed:
    """What a request hears when the engine stops under it: the replica's fault, so the
    client may resume it on another replica."""
    return Failed(ErrorKind.INTERNAL, reason, replica_fault=True)


def refused(q: Queued, kv: KvBudget | None) -> tuple[EventSink, list[OutputEvent]]:
    """A request that failed on its way into the batch (its sampler, its processors, its
    image prefix): its KV reservation released, and the error it hears."""
    if kv is not None:
        kv.release(q.request_id)
    return q.sub.output.sink, [Failed(ErrorKind.INTERNAL, REQUEST_FAILED)]


def fail_rows(by_uid: dict[int, Active], by_rid: dict[str, Active], kv: KvBudget | None,
              failed: Failed) -> Outbox:
    """Every row of the batch hears `failed`; their reservations are released and the
    engine forgets them (both of its maps cleared)."""
    rows = list(by_uid.values())
    if kv is not None:
        for active in rows:
            kv.release(active.sub.request_id)
    by_uid.clear()
    by_rid.clear()
    outbox: Outbox = [(a.output.sink, [failed]) for a in rows]
    return outbox


def abandoned(left: Commands, waiting: Waiting | None, prefills: Prefills,
              reason: str) -> Outbox:
    """What a dying engine held but had not started: the commands `left` in its queue
    (calls refused with `EngineDead`), the requests waiting for memory and those
    prefilling an image prefix, each told `lost(reason)`."""
    for call in left.calls:
        call.refuse(EngineDead(reason))
    outbox: Outbox = [(sub.output.sink, [lost(reason)]) for sub in left.submits]
    if waiting is not None:
        queued, waiting.queue = list(waiting.queue), deque()
        outbox += [(q.sub.output.sink, [lost(reason)]) for q in queued]
    outbox += [(q.sub.output.sink, [lost(reason)]) for q in prefills.drain()]
    return outbox


def batch_message(exc: Exception) -> str:
    """What the batch's requests hear when a step or an insert raised `exc`: a
    ReplicaError's message is written for clients; anything else shows its type."""
    reason = exc.message if isinstance(exc, ReplicaError) else type(exc).__name__
    return f"generation failed: {reason}"


def batch_failed(message: str, joining: Sequence[tuple[EventSink, str]],
                 by_uid: dict[int, Active], by_rid: dict[str, Active],
                 kv: KvBudget | None) -> Outbox:
    """A batch that started over: its rows and the requests that were `joining` it hear
    `message`, their reservations released."""
    failed = Failed(ErrorKind.INTERNAL, message)
    if kv is not None:
        for _, request_id in joining:
            kv.release(request_id)
    outbox: Outbox = [(sink, [failed]) for sink, _ in joining]
    return outbox + fail_rows(by_uid, by_rid, kv, failed)
