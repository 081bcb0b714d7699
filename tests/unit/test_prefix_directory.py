"""A replica's entry in the cluster prefix directory (`replicas.engine.kv.directory`):
which prefix keys a request teaches it, and that it publishes exactly the keys whose
tokens its cache's tiers (memory and disk, on real MLX caches) still hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from replicas.contract import ChatMessage, ChatPrompt, GenerationRequest, TextPrompt, \
    TokenPrompt
from replicas.engine.kv.disk import DiskTier
from replicas.engine.kv.directory import BLOCK_TOKENS, DIRECTORY_FILE, HeldBlocks, \
    PrefixDirectory, block_hashes
from replicas.engine.kv.prefix_cache import PromptCache
from replicas.routing_keys import TOKEN_BLOCK, routing_keys, token_spans
from tests.unit.test_disk_cache import kv

SYSTEM = ChatMessage("system", "You are an agent. " * 20)


def chat(*contents: str) -> GenerationRequest:
    roles = ("user", "assistant")
    messages = (SYSTEM, *(ChatMessage(roles[i % 2], c) for i, c in enumerate(contents)))
    return GenerationRequest("r", "m", ChatPrompt(messages))


def ids(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_block_hashes_chain_whole_blocks_only() -> None:
    tokens = ids(3 * BLOCK_TOKENS + 5)
    hashes = block_hashes(tokens)
    assert len(hashes) == 3
    assert block_hashes(tokens[:2 * BLOCK_TOKENS]) == hashes[:2]  # a prefix's are a prefix
    changed = tokens[:]
    changed[BLOCK_TOKENS + 1] = 99999
    assert block_hashes(changed)[0] == hashes[0]
    assert block_hashes(changed)[1:] != hashes[1:]  # a change moves every later block
    assert block_hashes(ids(BLOCK_TOKENS - 1)) == []
    # A vision prompt's cache key numbers each image position from its content hash,
    # past 64 bits (`replicas.vision`): it hashes too, and unlike its plain twin.
    image = [-1 - ((1 << 47) << 20) - i for i in range(BLOCK_TOKENS)]
    assert len(block_hashes(image)) == 1 and block_hashes(image) != block_hashes(ids(64))


def test_a_chat_s_spans_are_its_whole_prompt_and_its_last_message_boundary() -> None:
    turn = chat("a1", "reply", "a2")
    keys = routing_keys(turn, "prefix")
    assert keys is not None
    spans = token_spans(turn, prompt_tokens=900, boundary=700)
    # The keys the router records for the request, with the tokens each stands for.
    assert spans == ((keys.record[0], 900), (keys.record[1], 700))
    assert token_spans(turn, 900, 0) == ((keys.record[0], 900),)  # boundary unknown
    # The next turn's chain holds this turn's whole prompt: where the router looks.
    follow = routing_keys(chat("a1", "reply", "a2", "reply", "a3"), "prefix")
    assert follow is not None and keys.record[0] in follow.chain
    assert token_spans(GenerationRequest("r", "m", TextPrompt("x" * 5000)), 1200, 0) == ()
    tokens = GenerationRequest("r", "m", TokenPrompt(tuple(ids(3 * TOKEN_BLOCK + 7))))
    assert [n for _, n in token_spans(tokens, 3 * TOKEN_BLOCK + 7, 0)] == \
        [3 * TOKEN_BLOCK, 2 * TOKEN_BLOCK]


def test_a_key_is_published_while_its_block_prefix_is_held() -> None:
    directory = PrefixDirectory()
    prompt = ids(300)
    directory.learn([(b"whole", 300), (b"before-last", 130), (b"short", 40)], prompt)
    assert directory.published() == frozenset()  # learnt, but nothing cached yet
    # An entry covering the prompt and its answer holds both prefixes (to whole blocks).
    answer = tuple(prompt + ids(20, start=5000))
    directory.held.add(answer)
    assert directory.published() == {b"whole", b"before-last"}  # under a block: never
    directory.held.remove(answer)
    assert directory.published() == frozenset()
    # An entry of only the first two blocks holds the boundary's prefix, not the whole.
    directory.held.add(tuple(prompt[:128]))
    assert directory.published() == {b"before-last"}
    # A different prompt's entry with the same length holds nothing of it.
    directory.held.add(tuple(ids(300, start=1)))
    assert directory.published() == {b"before-last"}


def test_an_entry_in_both_tiers_is_held_until_it_has_left_both() -> None:
    held = HeldBlocks()
    entry = tuple(ids(BLOCK_TOKENS))
    (block,) = block_hashes(entry)
    held.add(entry)
    held.add(entry)
    held.remove(entry)
    assert block in held
    held.remove(entry)
    assert block not in held
    held.remove(entry)  # already gone: nothing to do
    assert block not in held


def test_the_directory_remembers_its_newest_keys_only() -> None:
    directory = PrefixDirectory(max_keys=2)
    prompt = ids(BLOCK_TOKENS)
    directory.held.add(tuple(prompt))
    for key in (b"k1", b"k2", b"k3"):
        directory.learn([(key, BLOCK_TOKENS)], prompt)
    assert directory.published() == {b"k2", b"k3"}


def test_the_memory_tier_publishes_what_it_keeps_and_not_what_it_evicts() -> None:
    directory = PrefixDirectory()
    cache = PromptCache(1 << 30, held=directory.held)
    first, second = ids(200), ids(200, start=1000)
    directory.learn([(b"first", 200)], first)
    directory.learn([(b"second", 200)], second)
    cache.save(first[:100], kv(100))  # a boundary save: one block of the first
    assert directory.published() == frozenset()
    cache.save(first + [7, 8], kv(202))  # its finished request: replaces the shorter entry
    cache.save(second, kv(200))
    assert directory.published() == {b"first", b"second"}
    cache.evict_to(cache.nbytes - 1)  # the least recently used goes
    assert directory.published() == {b"second"}
    cache.evict_to(0)
    assert directory.published() == frozenset()


def test_the_disk_tier_keeps_a_key_published_past_eviction_and_restart(tmp_path: Path) -> None:
    directory = PrefixDirectory()
    disk = DiskTier(tmp_path, 1 << 30, "model-a", directory.held)
    cache = PromptCache(1 << 30, disk=disk, held=directory.held)
    prompt = ids(200)
    directory.learn([(b"k", 200)], prompt)
    cache.save(prompt, kv(200))
    cache.evict_to(0)  # to disk
    assert disk.flush() and directory.published() == {b"k"}
    table = disk.directory / DIRECTORY_FILE
    directory.save(table)
    # A restarted replica: the files are found again, the key table too (the tier's scan
    # leaves it alone), and the key is published before any request comes.
    again = PrefixDirectory()
    assert len(DiskTier(tmp_path, 1 << 30, "model-a", again.held)) == 1
    again.load(table)
    assert table.exists() and again.published() == {b"k"}


def test_an_unreadable_key_table_is_ignored_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / DIRECTORY_FILE
    path.write_text("{not json")
    directory = PrefixDirectory()
    directory.load(path)
    directory.load(tmp_path / "missing")  # none saved yet: nothing to say
    assert directory.published() == frozenset()
    assert [r.message for r in caplog.records if r.levelname == "WARNING"] != []
