"""A replica's event stream as one list, for the suites that drive `ModelReplica.stream`
or the handle client's `stream` directly (integration, reliability, cluster).

Both yield batches of events (coalesced by the replica, which joins a batch's adjacent
deltas); tests compare whole event lists, so the batching and where deltas were cut, both
a matter of timing, are flattened away here, once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Sequence
from typing import TYPE_CHECKING

from replicas.contract import GenerationRequest, OutputEvent, merge_deltas

if TYPE_CHECKING:  # the cluster suite gathers a handle client's stream, not a replica's
    from replicas.replica import ModelReplica


async def collect(stream: AsyncIterable[Sequence[OutputEvent]]) -> list[OutputEvent]:
    """Every event of `stream`, in order, its batches flattened and adjacent deltas joined."""
    return merge_deltas([event async for batch in stream for event in batch])


def stream_events(replica: ModelReplica, request: GenerationRequest) -> list[OutputEvent]:
    """`replica.stream(request)` run to its end on a fresh event loop."""
    return asyncio.run(collect(replica.stream(request)))
