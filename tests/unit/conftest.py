"""Shared unit-test fixtures."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.harmony_vocab import load_gpt_oss_encoding
from tests.redis_server import RedisServer


@pytest.fixture(scope="session")
def harmony_encoding() -> Any:
    """The real gpt-oss Harmony encoding; its vocabulary comes from the bpe-openai wheel.

    It fails rather than skips when the vocabulary is missing: the Harmony cross-checks are
    the only proof that our text-level format matches the real tokens.
    """
    return load_gpt_oss_encoding()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real Redis of the test's own (the Responses and usage stores' tests)."""
    local = RedisServer(tmp_path)
    local.start()
    try:
        yield local
    finally:
        local.kill()
