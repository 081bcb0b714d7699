"""The benchmark's CPU accounting by process role (load/harness/process_cpu.py)."""

from __future__ import annotations

import os
import threading
import time

from load.harness.process_cpu import (CpuSnapshot, cpu_seconds, per_token_table, role,
                              thread_seconds, threads_between)
from replicas.os_thread import name_os_thread


def test_cpu_seconds_grows_with_work_and_is_zero_for_a_gone_process() -> None:
    before = cpu_seconds(os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert cpu_seconds(os.getpid()) - before >= 0.1
    assert cpu_seconds(2**22 + 12345) == 0.0  # past pid_max: never a live process
    assert role(2**22 + 12345) == "gone"


def test_spent_is_summed_per_role_and_new_processes_count_from_zero() -> None:
    before = CpuSnapshot({1: ("proxy", 1.0), 2: ("model replica", 5.0)})
    after = CpuSnapshot({1: ("proxy", 1.5), 2: ("model replica", 9.0), 3: ("proxy", 0.25)})
    assert after.since(before) == {"proxy": 0.75, "model replica": 4.0}


def test_the_table_shows_the_replica_less_raw_decode_and_what_is_outside_it() -> None:
    rows = per_token_table({"model replica": 4.0, "proxy": 0.5, "gcs": 0.1}, tokens=1000,
                           raw_ms_per_token=3.0)
    assert rows[0].split()[:3] == ["model", "replica", "4.00"]
    assert "less raw decode's 3.00: 1.00" in rows[0]
    assert rows[1].split()[:2] == ["proxy", "0.50"]
    assert rows[-1].split()[-3:] == ["0.60", "ms", "CPU/token"]


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_named_thread_and_its_children_are_told_apart_while_they_run() -> None:
    """The split `bench_ceiling.py` prints: a thread Orchard named for the OS, the threads
    it started (they take its name: MLX's, started by the engine thread), the main one.
    Measured while all run: an ended thread leaves /proc."""
    go, done = threading.Event(), threading.Event()

    def child() -> None:
        _burn(0.3)
        go.wait()

    def named() -> None:
        assert name_os_thread("orchard-test")
        c = threading.Thread(target=child)
        c.start()
        _burn(0.2)
        done.set()
        c.join()

    worker = threading.Thread(target=named)
    worker.start()
    done.wait(30)
    time.sleep(0.35)  # the child's burn ends too
    seen = threads_between({}, thread_seconds(os.getpid()))
    go.set()
    worker.join()
    assert seen["orchard-test"] >= 0.15
    assert seen["orchard-test's threads"] >= 0.25
    assert "main thread" in seen
