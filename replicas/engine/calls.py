"""Work for the engine thread between steps (`Engine.call`): a callable and the future its
answer goes to.

The engine thread is the sole owner of MLX in a replica, so anything else that computes
with the model (embeddings, `replicas.embedder`) runs there as one of these, in the gap
between two batch steps, instead of racing the batch from another thread.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Call:
    fn: Callable[[], Any]
    future: Future[Any]

    def run(self) -> None:
        """On the engine thread: the result or the exception into the future."""
        if not self.future.set_running_or_notify_cancel():  # its caller gave up while queued
            return
        try:
            self.future.set_result(self.fn())
        except Exception as exc:  # noqa: BLE001 - the caller's to handle; the engine runs on
            self.future.set_exception(exc)

    def refuse(self, exc: BaseException) -> None:
        """Not run: the engine stopped first."""
        if self.future.set_running_or_notify_cancel():
            self.future.set_exception(exc)
