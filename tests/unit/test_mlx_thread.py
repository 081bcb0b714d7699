"""The engine's pooled MLX threads: a finished engine's thread is reused by the next one,
never ended (its end raced interpreter shutdown), and keeps nothing of the work it ran."""

from __future__ import annotations

import gc
import threading
import weakref

from replicas.engine import mlx_thread


class Work:
    def __init__(self) -> None:
        self.ran_on: int | None = None
        self.name: str | None = None

    def __call__(self) -> None:
        self.ran_on = threading.get_ident()
        self.name = threading.current_thread().name


def test_a_finished_thread_runs_the_next_job_and_forgets_the_last() -> None:
    first = Work()
    job = mlx_thread.start("orchard-first", first)
    assert job.join(10) and not job.is_alive()
    assert first.name == "orchard-first"
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None  # neither the job nor the idle worker holds the engine

    before = threading.active_count()
    second = Work()
    assert mlx_thread.start("orchard-second", second).join(10)
    assert second.name == "orchard-second"
    assert threading.active_count() == before  # an idle thread took it: none started


def test_a_failing_job_still_ends_and_frees_its_thread() -> None:
    def boom() -> None:
        raise RuntimeError("engine died")

    job = mlx_thread.start("orchard-boom", boom)
    assert job.join(10)
    after = Work()
    assert mlx_thread.start("orchard-after", after).join(10) and after.ran_on is not None
