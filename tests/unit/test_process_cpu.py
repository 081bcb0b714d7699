"""The benchmark's CPU accounting by process role (load/process_cpu.py)."""

from __future__ import annotations

import os
import time

from load.process_cpu import CpuSnapshot, cpu_seconds, per_token_table, role


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
