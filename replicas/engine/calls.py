"""What the engine thread is told, taken between steps: submits, cancels, and work for it
(`Engine.call`: a callable and the future its answer goes to).

The engine thread is the sole owner of MLX in a replica, so anything else that computes
with the model (embeddings, `replicas.embedder`) runs there as one of these, in the gap
between two batch steps, instead of racing the batch from another thread.
"""

from __future__ import annotations

import queue
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from replicas.engine.request import Submitted


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


@dataclass(frozen=True)
class Cancel:
    request_id: str
    step: int  # the engine step when the cancel was asked for


# One item on the engine's queue; None only wakes it (to see that it is stopping).
Command = Submitted | Cancel | Call | None


@dataclass
class Commands:
    """Everything queued since the engine thread last looked, by kind."""

    submits: list[Submitted] = field(default_factory=list)
    cancels: dict[str, int] = field(default_factory=dict)  # request id -> step seen
    calls: list[Call] = field(default_factory=list)


def take_commands(commands: "queue.SimpleQueue[Command]", block: bool) -> Commands:
    """All that is queued (waiting for the first item when `block`)."""
    taken = Commands()
    try:
        item = commands.get(block=block)
        while True:
            if isinstance(item, Submitted):
                taken.submits.append(item)
            elif isinstance(item, Cancel):
                taken.cancels[item.request_id] = item.step
            elif isinstance(item, Call):
                taken.calls.append(item)
            item = commands.get_nowait()
    except queue.Empty:
        pass
    return taken
