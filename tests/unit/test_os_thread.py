"""The engine thread's name where the OS shows it (replicas/os_thread.py)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from replicas.os_thread import name_os_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads the name back from Linux's /proc")


def _named(name: str) -> tuple[bool, str]:
    result: list[tuple[bool, str]] = []

    def run() -> None:
        took = name_os_thread(name)
        comm = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
        result.append((took, comm))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result[0]


def test_the_os_shows_the_name_of_the_thread_that_set_it() -> None:
    assert _named("orchard-engine") == (True, "orchard-engine")
    # The main thread keeps its own.
    assert Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip() \
        != "orchard-engine"


def test_a_long_name_is_cut_to_what_linux_holds() -> None:
    assert _named("orchard-a-very-long-thread-name") == (True, "orchard-a-very-")
