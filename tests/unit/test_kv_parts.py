"""A sharded rank's KV parts between the lockstep op and the transport
(`replicas.engine.sharded.kv_parts`): an export waits for the op that makes it, a staged import is
taken once, and what nobody comes for is dropped."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from replicas.engine.sharded.kv_parts import KvParts
from replicas.engine.kv.transfer import Payload


def encoded(value: int) -> Future[Payload]:
    done: Future[Payload] = Future()
    done.set_result(np.full(4, value, dtype=np.uint8))
    return done


def test_the_transport_may_ask_before_the_op_reaches_the_rank() -> None:
    parts = KvParts()
    threading.Timer(0.2, lambda: parts.export("e1", encoded(7))).start()
    started = time.monotonic()
    assert parts.take_export("e1", timeout_s=10).tolist() == [7] * 4
    assert time.monotonic() - started >= 0.15
    with pytest.raises(TimeoutError):  # taken once: a second ask finds nothing
        parts.take_export("e1", timeout_s=0.1)


def test_an_export_still_encoding_is_waited_for() -> None:
    parts = KvParts()
    pending: Future[Payload] = Future()
    parts.export("e2", pending)
    threading.Timer(0.1, lambda: pending.set_result(np.zeros(2, dtype=np.uint8))).start()
    assert parts.take_export("e2", timeout_s=10).nbytes == 2


def test_a_staged_part_is_adopted_once_or_discarded() -> None:
    parts = KvParts()
    parts.stage("i1", ["layer"])
    assert parts.take_import("i1") == ["layer"]
    assert parts.take_import("i1") is None
    parts.stage("i2", ["layer"])
    parts.discard("i2")
    assert parts.take_import("i2") is None and len(parts) == 0


def test_parts_nobody_came_for_are_dropped() -> None:
    parts = KvParts(ttl_s=0.05)
    parts.export("old", encoded(1))
    parts.stage("old", ["layer"])
    time.sleep(0.1)
    parts.stage("new", ["layer"])  # any arrival sweeps what outlived the bound
    assert len(parts) == 1 and parts.take_import("new") == ["layer"]
