"""A disk hit is read off the engine thread (issue 59): while a long entry's file is read
and checked, the batch keeps stepping, and the request that waited for it is then served
from it. On the real tiny model, in-process, with a disk tier a first replica filled."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from replicas.contract import Finished, OutputEvent
from replicas.engine.kv.disk import DiskHit, DiskTier
from tests.integration.test_disk_cache_replica import replica
from tests.integration.test_prompt_cache import cached_tokens, generate, output, prompt_ids
from tests.scripted import script_request
from tests.streams import collect


def test_the_batch_steps_on_while_a_disk_entry_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = replica(tmp_path)
    try:
        before = generate(first, "tool-one")
    finally:
        first.shutdown()  # its entries go to the disk tier
    reading, release = threading.Event(), threading.Event()
    load = DiskTier.load

    def slow_load(self: DiskTier, hit: DiskHit) -> Any:
        """A file that takes as long to read as the test wants."""
        reading.set()
        release.wait(60)
        return load(self, hit)

    monkeypatch.setattr(DiskTier, "load", slow_load)
    second = replica(tmp_path)

    async def scenario() -> tuple[list[OutputEvent], list[OutputEvent]]:
        waiting = asyncio.ensure_future(collect(second.stream(script_request("tool-one"))))
        assert await asyncio.to_thread(reading.wait, 30), "the disk entry was never read"
        try:
            # The entry is being read: another request runs to its end meanwhile.
            other = await asyncio.wait_for(collect(second.stream(script_request("cities"))), 30)
        finally:
            release.set()
        return await waiting, other

    try:
        served, other = asyncio.run(scenario())
    finally:
        release.set()
        second.shutdown()
    assert isinstance(other[-1], Finished) and other[-1].usage.completion_tokens > 1
    assert output(served) == output(before)
    assert cached_tokens(served) == len(prompt_ids(second, "tool-one")) - 1  # from disk
