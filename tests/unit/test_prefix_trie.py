"""`replicas.engine.kv.trie` against a brute-force reading of its contract, over random
adds, removes and prefix removals; and against mlx-lm's `PromptTrie`, whose answers it
replaces."""

from __future__ import annotations

import random
from typing import Any

import pytest
from mlx_lm.models.cache import PromptTrie

from load.micro.prefix_lookup import theirs
from replicas.engine.kv.trie import Key, PrefixTrie


def _common(a: Key, b: Key) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def reference(held: set[Key], tokens: Key, trimmable: set[Key]) -> tuple[set[Key], int] | None:
    """Every acceptable answer (entries that tie) and the prefix length they serve."""
    prefixes = [k for k in held if len(k) <= len(tokens) and tokens[:len(k)] == k]
    best = max(prefixes, key=len, default=None)
    if best is not None and len(best) == len(tokens):
        return {best}, len(best)
    depth = max((_common(k, tokens) for k in held), default=0)
    if depth > (len(best) if best is not None else 0):
        through = [k for k in held if _common(k, tokens) >= depth]
        shortest = min(len(k) for k in through)
        ties = {k for k in through if len(k) == shortest}
        if ties <= trimmable:
            return ties, depth
        assert not ties & trimmable, "the test keeps tied entries alike"
    return ({best}, len(best)) if best is not None else None


def check_shape(trie: PrefixTrie, held: set[Key]) -> None:
    """The radix tree's invariants: edges spell the entries, runs without a branch are one
    node, and every node's marks name the shortest entry at or below it."""
    found: set[Key] = set()

    def walk(node: Any, path: Key, is_root: bool) -> int:
        children, entry = node.children, node.entry
        if not is_root:
            assert entry is not None or len(children) >= 2, "an unbranched node stayed"
        if entry is not None:
            assert entry == path
            found.add(entry)
        lengths = {token: walk(child, path + child.edge, False)
                   for token, child in children.items()}
        for token, child in children.items():
            assert child.edge and child.edge[0] == token
        shortest = min([*lengths.values(), *([len(entry)] if entry is not None else [])],
                       default=0)
        if not is_root:
            assert node.shortest == shortest
            via = node.via
            assert (via is None and entry is not None and len(entry) == shortest) or \
                (via is not None and lengths[via] == shortest)
        return shortest

    walk(trie._root, (), True)
    assert found == held


def _key(rng: random.Random) -> Key:
    # A tiny alphabet and shared openings: prefixes, ties and divergences are common.
    opening = rng.choice([(), (1,), (1, 2), (1, 2, 3), (4, 4)])
    return opening + tuple(rng.randrange(1, 4) for _ in range(rng.randrange(0, 6)))


@pytest.mark.parametrize("seed", range(40))
def test_matches_the_brute_force_reading(seed: int) -> None:
    rng = random.Random(seed)
    trie, held = PrefixTrie(), set[Key]()
    for _ in range(120):
        op = rng.random()
        key = _key(rng)
        if not key:
            continue
        if op < 0.5:
            assert trie.add(key) == (key in held)
            held.add(key)
        elif op < 0.7 and held:
            gone = rng.choice(sorted(held))
            trie.remove(gone)
            held.discard(gone)
        elif op < 0.8:
            removed = trie.remove_prefixes(key)
            expected = {k for k in held if len(k) < len(key) and key[:len(k)] == k}
            assert set(removed) == expected and len(removed) == len(expected)
            held -= expected
        check_shape(trie, held)
        # Trimmable or not by length's parity: entries tied for shortest always agree.
        trimmable = {k for k in held if len(k) % 2 == 0}
        query = _key(rng)
        want = reference(held, query, trimmable)
        got = trie.longest_prefix(query, trimmable.__contains__)
        if want is None:
            assert got is None, (held, query)
        else:
            assert got is not None and got[0] in want[0] and got[1] == want[1], (held, query)


def test_an_emptied_trie_holds_nothing() -> None:
    trie = PrefixTrie()
    keys = [(1, 2, 3), (1, 2), (1, 2, 3, 4), (5,)]
    for key in keys:
        trie.add(key)
    for key in keys:
        trie.remove(key)
    assert trie._root.children == {}
    assert trie.longest_prefix((1, 2, 3), lambda k: True) is None


@pytest.mark.parametrize("seed", range(10))
def test_agrees_with_mlx_lm_on_what_it_finds(seed: int) -> None:
    """Same entries in both; mlx-lm's search read as `PromptCache` read it before
    (`load.micro.prefix_lookup.theirs`)."""
    rng = random.Random(seed)
    ours, mlx = PrefixTrie(), PromptTrie()
    for _ in range(60):
        key = _key(rng)
        if len(key) > 1:
            ours.add(key)
            mlx.add("m", list(key), key)
    for _ in range(60):
        query = list(_key(rng))
        want = theirs(mlx, query)
        got = ours.longest_prefix(query, lambda k: True)
        if want is None or got is None:
            # mlx-lm ignores a one-token prefix entry; every key here is longer than that.
            assert want == got, (query, want, got)
        else:  # entries tied for shortest may differ; what they serve may not
            assert (len(got[0]), got[1]) == (len(want[0]), want[1]), (query, want, got)
