"""The prefix cache's disk tier in a replica with the real tiny model, in-process: what a
replica leaves at shutdown a new one loads instead of prefilling, with identical output
(and reports holding, for the routers, before any request), and an entry memory evicts is
loaded back from disk."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from replicas.engine.config import EngineConfig
from replicas.engine.kv.directory import BLOCK_TOKENS
from replicas.engine.kv.prefix_cache import DISK_MIN_TOKENS
from replicas.replica import ModelReplica, ReplicaOptions
from replicas.routing_keys import routing_keys
from tests.scripted import GREEDY, script_request
from tests.streams import stream_events
from tests.integration.test_prompt_cache import cached_tokens, generate, output, prompt_ids

SCRIPTS = ["tool-one", "multi-turn", "cities"]
LONG = ["tool-one", "multi-turn"]  # prompts past DISK_MIN_TOKENS: a disk hit is worth it


def replica(directory: Path, source: str = "builtin:tiny", **engine: Any) -> ModelReplica:
    rep = ModelReplica(ReplicaOptions(model_id="tiny", source=source, engine=EngineConfig(
        disk_cache_dir=str(directory), **engine)))
    rep.start()
    return rep


QUANTIZED = {"kv_bits": 8, "kv_group_size": 32}  # tiny's head_dim is 32, MLA's rope key too
# LongCat-Flash caches each layer's two attentions as mlx-lm's `CacheList`, whose stored
# state names its members' classes (strings in the file).
LONGCAT = "builtin:arch-longcat"
DSV32 = "builtin:arch-dsv32"  # a `CacheList` of a packed latent and float indexer keys


def run(rep: ModelReplica, sid: str, source: str) -> list[Any]:
    """A random-weights model writes to `max_tokens`: 8 here, so that its entries are mostly
    prompt, as the disk tier's reading rule wants (`PromptCache._from_disk`)."""
    if source == "builtin:tiny":
        return generate(rep, sid)
    return stream_events(rep, script_request(sid, sampling=replace(GREEDY, max_tokens=8)))


@pytest.mark.parametrize(("source", "engine"), [
    ("builtin:tiny", {}), ("builtin:tiny", QUANTIZED), (LONGCAT, {}), (LONGCAT, QUANTIZED),
    (DSV32, QUANTIZED)],
    ids=["float", "kv_bits 8", "longcat float", "longcat kv_bits 8", "dsv32 kv_bits 8"])
def test_a_restarted_replica_loads_its_prefixes_from_disk(tmp_path: Path, source: str,
                                                          engine: dict[str, Any]) -> None:
    first = replica(tmp_path, source, **engine)
    try:
        before = {sid: run(first, sid, source) for sid in LONG}
        lengths = {sid: len(prompt_ids(first, sid)) for sid in LONG}
    finally:
        first.shutdown()  # writes every entry to the disk tier
    second = replica(tmp_path, source, **engine)
    try:
        assert second.stats().disk_entries >= len(LONG)
        # Before any request: it reports the prefixes its disk holds (the prefix
        # directory's key table was saved beside the files), so routers find them; a
        # prompt under one block of the directory is never reported.
        reported = {sid: keys.record[0] in second.held_prefixes() for sid in LONG
                    if (keys := routing_keys(script_request(sid), "prefix")) is not None}
        assert reported == {sid: lengths[sid] >= BLOCK_TOKENS for sid in LONG}
        assert any(reported.values())
        after = {sid: run(second, sid, source) for sid in LONG}
        stats = second.stats()
    finally:
        second.shutdown()
    for sid in LONG:
        assert lengths[sid] > DISK_MIN_TOKENS + 1, sid
        assert output(after[sid]) == output(before[sid]), sid
        assert cached_tokens(after[sid]) == lengths[sid] - 1, sid  # all but the last token
    assert stats.disk_hits == len(LONG)


def test_kv_of_another_quantization_is_not_loaded(tmp_path: Path) -> None:
    """Float KV cannot join a quantized batch (nor the reverse): the tiers of the two are
    apart on disk, under fingerprints that differ by the KV's quantization."""
    first = replica(tmp_path)
    try:
        generate(first, "tool-one")
    finally:
        first.shutdown()
    second = replica(tmp_path, **QUANTIZED)
    try:
        assert second.stats().disk_entries == 0
        assert cached_tokens(generate(second, "tool-one")) == 0
    finally:
        second.shutdown()
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == 2


def written(rep: ModelReplica, timeout_s: float = 30) -> None:
    """Wait for the disk tier's writer thread: evicted entries are written in the
    background, and a lookup before the write finds nothing (a busy CI box is slow)."""
    deadline = time.monotonic() + timeout_s
    seen = [-1]
    while len(seen) < 4 or len(set(seen[-4:])) > 1 or seen[-1] == 0:
        assert time.monotonic() < deadline, f"disk entries still changing: {seen}"
        time.sleep(0.2)
        seen.append(rep.stats().disk_entries)


def test_what_memory_evicts_comes_back_from_disk(tmp_path: Path) -> None:
    # Room in memory for one of the short conversations (about 65 kB of KV each): the
    # second evicts the first to disk; tool-one's (245 kB) never fits and goes there whole.
    rep = replica(tmp_path, prompt_cache_bytes=100_000)
    try:
        first = {sid: generate(rep, sid) for sid in SCRIPTS}
        evicted = rep.stats().cache_evictions
        written(rep)
        again = {sid: generate(rep, sid) for sid in ("multi-turn", "tool-one")}
        stats = rep.stats()
    finally:
        rep.shutdown()
    assert evicted >= 1
    for sid, events in again.items():
        assert output(events) == output(first[sid]), sid
        assert cached_tokens(events) > 0, sid
    assert stats.disk_hits == 2
