"""The private Ray cluster, started once for the reliability tests that need one."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.reliability.cluster import serve_cluster


@pytest.fixture(scope="package")
def cluster() -> Iterator[str]:
    with serve_cluster() as base_url:
        yield base_url
