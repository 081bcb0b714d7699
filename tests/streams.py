"""A replica's event stream as one list, for the suites that drive `ModelReplica.stream`
or the handle client's `stream` directly (integration, reliability, cluster).

Both yield batches of events (coalesced by the replica); tests compare whole event lists,
so the batching is flattened away here, once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Sequence
from typing import TYPE_CHECKING

from replicas.contract import GenerationRequest, OutputEvent

if TYPE_CHECKING:  # the cluster suite gathers a handle client's stream, not a replica's
    from replicas.replica import ModelReplica


async def collect(stream: AsyncIterable[Sequence[OutputEvent]]) -> list[OutputEvent]:
    """Every event of `stream`, in order, its batches flattened."""
    return [event async for batch in stream for event in batch]


def stream_events(replica: ModelReplica, request: GenerationRequest) -> list[OutputEvent]:
    """`replica.stream(request)` run to its end on a fresh event loop."""
    return asyncio.run(collect(replica.stream(request)))
