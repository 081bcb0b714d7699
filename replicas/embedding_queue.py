"""The replica's queue of embedding inputs: which inputs the next forward takes.

Oldest job first (a job is one request's inputs): the next forward always holds the oldest
job's next input, so a later job never overtakes an earlier one by more than the forwards
that the earlier job's own inputs take. Room left in that forward (`max_rows`, and the
padded bytes: rows x longest x `bytes_per_token`) goes to the inputs queued after it, in
arrival order, where they fit, so many small requests at once still share forwards. A
job's own inputs go shortest first (the least padding among them).

A cancelled job (its client left) is dropped: its queued inputs never reach a forward.
The queue itself holds no lock; `replicas.embedder` takes one around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Sequence, TypeVar

from replicas.engine.model.embedding import MAX_BATCH_BYTES, MAX_ROWS

J = TypeVar("J")  # a job: whatever the caller keys one request's inputs by


@dataclass(frozen=True)
class Queued(Generic[J]):
    job: J
    index: int  # the input's place in its request
    ids: tuple[int, ...]


class EmbeddingQueue(Generic[J]):
    def __init__(self, bytes_per_token: int, max_rows: int = MAX_ROWS,
                 max_bytes: int = MAX_BATCH_BYTES) -> None:
        self._bytes_per_token = bytes_per_token
        self._max_rows = max_rows
        self._max_bytes = max_bytes
        # Jobs in arrival order, each with its inputs still queued (shortest first).
        self._jobs: dict[int, tuple[J, list[Queued[J]]]] = {}

    def __len__(self) -> int:
        return sum(len(inputs) for _, inputs in self._jobs.values())

    def add(self, job: J, rows: Sequence[tuple[int, ...]]) -> None:
        """A job's inputs, behind every job queued before it."""
        inputs = [Queued(job, index, row) for index, row in enumerate(rows)]
        inputs.sort(key=lambda q: len(q.ids))
        if inputs:
            self._jobs[id(job)] = (job, inputs)

    def drop(self, job: J) -> int:
        """Forget a job's queued inputs (cancelled, or failed); how many there were."""
        _, inputs = self._jobs.pop(id(job), (None, []))
        return len(inputs)

    def clear(self) -> list[J]:
        """Every queued job, in arrival order; the queue empty."""
        jobs = [job for job, _ in self._jobs.values()]
        self._jobs.clear()
        return jobs

    def take(self) -> list[Queued[J]]:
        """The next forward's inputs, taken off the queue: the oldest job's first, then
        what fits beside it in arrival order. Empty only when the queue is."""
        taken: list[Queued[J]] = []
        longest = 0
        for key, (_, inputs) in list(self._jobs.items()):
            kept: list[Queued[J]] = []
            for queued in inputs:
                wider = max(longest, len(queued.ids))
                rows = len(taken) + 1
                # The first input always goes, alone if it must (its length is already
                # within the model's input length).
                if not taken or (rows <= self._max_rows
                                 and rows * wider * self._bytes_per_token <= self._max_bytes):
                    taken.append(queued)
                    longest = wider
                else:
                    kept.append(queued)
            if kept:
                self._jobs[key] = (self._jobs[key][0], kept)
            else:
                del self._jobs[key]
            if len(taken) >= self._max_rows:
                break
        return taken
