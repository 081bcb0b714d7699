"""Overload at three times capacity: only 200, 503 and 529, nothing hangs, full recovery.

Short by default (a CI-sized run); `python -m tests.reliability` runs it longer and prints
the report. ORCHARD_SOAK_S sets the duration, ORCHARD_RELIABILITY_REPORT a JSON report path.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from tests.reliability.cluster import TINY
from tests.reliability.soak import soak

pytestmark = pytest.mark.reliability

OVERLOAD_FACTOR = 3
RECOVERY_LIMIT_S = 120.0


def test_overload_soak(cluster: str) -> None:
    duration_s = float(os.environ.get("ORCHARD_SOAK_S", "10"))
    report = asyncio.run(soak(cluster, TINY, duration_s=duration_s,
                              concurrency=OVERLOAD_FACTOR * TINY.capacity,
                              recovery_limit_s=RECOVERY_LIMIT_S))
    print(report.table())
    path = os.environ.get("ORCHARD_RELIABILITY_REPORT")
    if path:
        Path(path).write_text(json.dumps(report.as_dict(), indent=2))
    assert report.hung == 0 and report.failed == 0, report.table()
    assert set(report.statuses) <= {200, 503, 529}, report.table()
    assert report.ok > 0 and report.refused > 0, report.table()  # it really was overloaded
    assert report.sent == report.ok + report.refused + report.left + report.failed + report.hung
    # Recovery takes a second or two here; the bound only catches a pool that never drains.
    assert report.recovery_s is not None and report.recovery_s < RECOVERY_LIMIT_S, report.table()
