"""The threads that run MLX for an engine, which end only with the process.

MLX keeps a compile cache per thread (`mx.compile`'s entries, which hold Python objects).
When a thread that used it ends, the C++ runtime destroys that cache after Python's
`Thread.join` has already returned, and the destructor must take the GIL. If the main
thread is finalizing the interpreter by then, taking the GIL ends the thread mid-destructor,
and the process aborts ("terminate called without an active exception", exit 134): seen
here in about one clean shutdown in four with a row still decoding. So a thread that ran
MLX goes back to a pool when its work is done and waits there, and the next engine reuses
it; at exit such a daemon thread is simply stopped, with no destructor run.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger(__name__)

_idle: "queue.SimpleQueue[_Worker]" = queue.SimpleQueue()


class Job:
    """One piece of work on a pooled thread; `join` waits for it like `Thread.join`."""

    def __init__(self, name: str, work: Callable[[], None]) -> None:
        self.name = name
        self._work: Callable[[], None] | None = work
        self._done = threading.Event()

    def run(self) -> None:
        work, self._work = self._work, None  # the worker must not keep the engine alive
        try:
            assert work is not None
            work()
        finally:
            self._done.set()

    def join(self, timeout: float | None = None) -> bool:
        """Whether the work has ended (within `timeout`)."""
        return self._done.wait(timeout)

    def is_alive(self) -> bool:
        return not self._done.is_set()


class _Worker:
    def __init__(self) -> None:
        self._jobs: "queue.SimpleQueue[Job]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def give(self, job: Job) -> None:
        self._jobs.put(job)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            self._thread.name = job.name
            try:
                job.run()
            except BaseException:  # noqa: BLE001 - the thread must outlive its work
                log.exception("work on %s raised", job.name)
            del job  # nothing of the last job stays referenced while idle
            self._thread.name = "orchard-idle"
            _idle.put(self)


def start(name: str, work: Callable[[], None]) -> Job:
    """Run `work` on a pooled MLX thread named `name` (an idle one, or a new one)."""
    job = Job(name, work)
    try:
        worker = _idle.get_nowait()
    except queue.Empty:
        worker = _Worker()
    worker.give(job)
    return job
