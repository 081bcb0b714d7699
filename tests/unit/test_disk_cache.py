"""The prefix cache's disk tier alone, on real MLX caches: what it keeps, what a new process
finds, and what it refuses to load."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from replicas.engine.kv.disk import DiskTier
from replicas.engine.kv.prefix_cache import PromptCache


def kv(tokens: int, layers: int = 2) -> list[Any]:
    out = []
    for _ in range(layers):
        layer = KVCache()
        layer.update_and_fetch(mx.random.normal((1, 2, tokens, 8)),
                               mx.random.normal((1, 2, tokens, 8)))
        out.append(layer)
    return out


def written(tier: DiskTier, tokens: list[int], cache: list[Any]) -> None:
    tier.put(tokens, cache)
    assert tier.flush()


def same(a: list[Any], b: list[Any]) -> bool:
    return all(mx.array_equal(x.state[0], y.state[0]).item() for x, y in zip(a, b))


def test_an_entry_survives_a_new_process_and_serves_its_prefixes(tmp_path: Path) -> None:
    cache = kv(10)
    written(DiskTier(tmp_path, 1 << 30, "model-a"), list(range(10)), cache)
    again = DiskTier(tmp_path, 1 << 30, "model-a")  # what a restarted replica opens
    assert len(again) == 1
    hit = again.lookup(list(range(10)) + [77])
    assert hit is not None and hit.length == 10
    loaded = again.load(hit)
    assert loaded is not None and same(loaded, cache) and again.hits == 1
    shorter = again.lookup([0, 1, 2, 3, 50, 51])  # a longer KV entry trims to the shared 4
    assert shorter is not None and shorter.length == 4
    assert again.lookup([9, 9, 9]) is None


def test_another_model_never_sees_the_entries(tmp_path: Path) -> None:
    written(DiskTier(tmp_path, 1 << 30, "model-a"), list(range(10)), kv(10))
    assert len(DiskTier(tmp_path, 1 << 30, "model-b")) == 0


def test_a_foreign_or_altered_file_is_dropped_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = DiskTier(tmp_path, 1 << 30, "model-a")
    written(tier, list(range(10)), kv(10))
    written(tier, list(range(20, 30)), kv(10))
    first, second = sorted(tier.directory.glob("*.json"))
    meta = json.loads(first.read_text())
    first.write_text(json.dumps({**meta, "fingerprint": "model-z"}))  # copied from elsewhere
    with caplog.at_level(logging.WARNING):
        reopened = DiskTier(tmp_path, 1 << 30, "model-a")
    assert len(reopened) == 1 and "another model" in caplog.text
    assert not first.exists()
    # The remaining entry's bytes change after its sidecar was written: never loaded.
    data = second.with_suffix(".safetensors")
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + 8] = bytes(b ^ 0xFF for b in raw[middle:middle + 8])
    data.write_bytes(bytes(raw))
    hit = reopened.lookup(json.loads(second.read_text())["tokens"] + [1])
    assert hit is not None
    with caplog.at_level(logging.WARNING):
        assert reopened.load(hit) is None
    assert "SHA-256" in caplog.text and len(reopened) == 0 and not data.exists()


def test_the_bound_drops_the_least_recently_used(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 30, "m")
    written(tier, [1] * 5, kv(5))
    size = tier.nbytes
    tier.max_bytes = 2 * size + size // 2  # room for two entries of this size
    written(tier, [2] * 5, kv(5))
    hit = tier.lookup([1] * 5 + [0])
    assert hit is not None and tier.load(hit) is not None  # [1]*5 used last now
    written(tier, [3] * 5, kv(5))
    assert len(tier) == 2 and tier.lookup([2] * 5 + [0]) is None
    assert tier.lookup([1] * 5 + [0]) is not None


def test_a_longer_entry_replaces_its_prefixes(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 30, "m")
    written(tier, list(range(5)), kv(5))
    written(tier, list(range(9)), kv(9))
    assert len(tier) == 1 and len(list(tier.directory.glob("*.safetensors"))) == 1


def test_recurrent_state_is_kept_whole_and_served_only_whole(tmp_path: Path) -> None:
    state = ArraysCache(2)
    state[0], state[1] = mx.ones((1, 4, 3)), mx.zeros((1, 2))
    tier = DiskTier(tmp_path, 1 << 30, "m")
    written(tier, list(range(6)), [state])
    assert tier.lookup([0, 1, 2, 9, 9]) is None  # cannot be trimmed to a shorter prefix
    hit = tier.lookup(list(range(6)) + [4])
    assert hit is not None and hit.length == 6
    loaded = tier.load(hit)
    assert loaded is not None and mx.array_equal(loaded[0][0], state[0]).item()


def test_spills_wait_in_a_queue_bounded_by_bytes(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An evicted entry's KV lives until its write ends: while the writer is busy, spills
    past the queue's bound are dropped, not kept (issue 59); a caller that waits
    (shutdown) gets room as writes end."""
    entry = sum(c.nbytes for c in kv(10))
    tier = DiskTier(tmp_path, 1 << 30, "model-a", queue_bytes=2 * entry)
    slow = threading.Event()
    write = tier._write
    monkeypatch.setattr(tier, "_write", lambda *a: (slow.wait(10), write(*a)))
    assert tier.put(list(range(10)), kv(10))  # the writer holds it
    assert tier.put(list(range(10, 20)), kv(10))
    assert not tier.put(list(range(20, 30)), kv(10))  # the queue is full: dropped at once
    assert tier.queued_bytes == 2 * entry and tier.skipped == 1
    threading.Timer(0.2, slow.set).start()
    assert tier.put(list(range(30, 40)), kv(10), wait_s=10.0)  # waits for a write to end
    assert tier.flush() and tier.queued_bytes == 0
    assert len(tier) == 3 and tier.lookup(list(range(20, 31))) is None
    big = DiskTier(tmp_path / "big", 1 << 30, "model-a", queue_bytes=entry // 2)
    assert not big.put(list(range(10)), kv(10))  # a spill larger than the queue: never
    assert big.put(list(range(10)), kv(10), wait_s=1.0) and big.flush()  # shutdown: alone
    assert len(big) == 1


def test_a_saved_entry_is_written_without_waiting_for_eviction_or_shutdown(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a replica killed outright keeps (issue 59: SIGTERM to `serve run` left the tier
    empty): each entry a request leaves is written in the background as it is saved; while
    the writer is busy, a conversation's next turn supersedes the turn still queued."""
    tier = DiskTier(tmp_path, 1 << 30, "model-a")
    cache = PromptCache(1 << 30, disk=tier)
    cache.save(list(range(10)), kv(10))
    assert tier.flush() and len(tier) == 1  # no eviction, no close: on disk already
    assert len(DiskTier(tmp_path, 1 << 30, "model-a")) == 1  # what a restart finds
    slow = threading.Event()
    write = tier._write
    monkeypatch.setattr(tier, "_write", lambda *a: (slow.wait(10), write(*a)))
    cache.save(list(range(100, 110)), kv(10))  # the writer holds this one
    cache.save(list(range(200, 210)), kv(10))  # a turn, then its next turn, queued
    cache.save(list(range(200, 220)), kv(20))
    cache.save(list(range(300, 305)), kv(5), persist=False)  # a message boundary's: not
    slow.set()
    assert tier.flush() and tier.writes == 3 and len(tier) == 3
    assert tier.lookup(list(range(200, 211))) is not None  # the longer serves the shorter
    assert tier.lookup(list(range(300, 306))) is None



HOLDER = """
import sys
from replicas.engine.kv.disk import DiskTier
from tests.unit.test_disk_cache import kv, written
written(DiskTier(sys.argv[1], 1 << 30, "model-a"), list(range(10)), kv(10))
print("held", flush=True)
sys.stdin.read()  # until the test lets go
"""


def test_a_directory_in_use_waits_for_its_process_to_end(tmp_path: Path) -> None:
    """Issue 59: replicas sharing one directory deleted each other's partial writes at
    start and bounded only their own bytes. A second process (a replacement that starts
    before the old replica stops) leaves the directory alone until the first ends."""
    root = Path(__file__).resolve().parents[2]
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=root,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        live_write = tmp_path / "model-a" / "f00.partial.safetensors"
        live_write.write_bytes(b"half")
        waiting = DiskTier(tmp_path, 1 << 30, "model-a")
        assert live_write.exists() and len(waiting) == 0
        waiting._next_claim = 0.0  # try again now, not in ten seconds
        assert waiting.lookup(list(range(11))) is None  # still held
        assert not waiting.put(list(range(20, 30)), kv(10))
        assert len(DiskTier(tmp_path, 1 << 30, "model-b")) == 0  # another model's: free
    finally:
        holder.communicate(b"", timeout=30)
    waiting._next_claim = 0.0
    hit = waiting.lookup(list(range(11)))  # its holder is gone: taken, and read
    assert hit is not None and hit.length == 10 and not live_write.exists()
    written(waiting, list(range(20, 30)), kv(10))
    assert len(waiting) == 2
