"""A prefix-cache lookup as the cache fills: mlx-lm's `PromptTrie` against Orchard's
`PrefixTrie` (`replicas.engine.kv.trie`), on the same entries, in this process.

    python -m load.micro.prefix_lookup

Each level caches N conversations: one shared system prompt, then each its own tokens. The
lookup is a new conversation's prompt: the system prompt, then tokens no entry has, so both
indexes must find an entry through the point where it leaves them (the case a new user of a
busy server is). mlx-lm's is read as `PromptCache` read it before this index replaced it
(exact, else a longer entry past the longest shorter one, else the shorter). Per level:
`--rounds` alternating rounds, each the median of `--lookups` lookups per index; prints the
medians (min-max) and mlx-lm/Orchard, the median of the per-round ratios.

Then what holding the index costs the engine thread, each index built alone: the adds (an
entry is added for every request that ends) and one full pass of Python's garbage collector
with it alive, which stalls every thread (the collector walks each container object, and a
node per token makes one per cached token).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from typing import Any, Callable

from mlx_lm.models.cache import PromptTrie

from replicas.engine.kv.trie import PrefixTrie

SYSTEM = 500  # tokens of the shared system prompt
LEVELS = ((100, 230), (1000, 1000), (2000, 2000))  # (conversations, tokens each after it)


def theirs(trie: PromptTrie, tokens: list[int]) -> tuple[tuple[int, ...], int] | None:
    found = trie.search("m", tokens)
    if found.exact is not None:
        return tuple(found.exact), len(found.exact)
    shorter = len(found.shorter) if found.shorter is not None else 0
    if found.longer is not None and found.common_prefix > shorter:
        return tuple(found.longer), found.common_prefix
    return (tuple(found.shorter), shorter) if found.shorter is not None else None


def timed(lookup: Callable[[], object], lookups: int) -> tuple[float, object]:
    times, answer = [], None
    for _ in range(lookups):
        start = time.perf_counter()
        answer = lookup()
        times.append(time.perf_counter() - start)
    return statistics.median(times), answer


def conversation(system: list[int], seed: int, length: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(system + [rng.randrange(1000, 100_000) for _ in range(length)])


def full_collection_ms() -> float:
    start = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - start) * 1e3


def held_cost(make: Callable[[], Any], add: Callable[[Any, tuple[int, ...]], object],
              keys: list[tuple[int, ...]]) -> tuple[float, float]:
    """Microseconds per add, and the milliseconds one full collection takes longer with the
    index alive than without it (the keys themselves are alive in both)."""
    without = min(full_collection_ms() for _ in range(3))
    index, start = make(), time.perf_counter()
    for key in keys:
        add(index, key)
    per_add = (time.perf_counter() - start) / len(keys) * 1e6
    pause = min(full_collection_ms() for _ in range(3)) - without
    del index
    gc.collect()
    return per_add, pause


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lookups", type=int, default=3)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    system = list(range(SYSTEM))
    query = system + [7] * 50  # token 7 follows the system prompt in no entry
    print(f"{'entries':>8} {'tokens':>7} {'mlx-lm ms':>22} {'orchard ms':>22} {'mlx-lm/orchard':>16}")
    costs = []
    for entries, length in LEVELS:
        keys = [conversation(system, e, length) for e in range(entries)]
        costs.append((entries, length,
                      held_cost(PromptTrie, lambda t, k: t.add("m", list(k), k), keys),
                      held_cost(PrefixTrie, lambda t, k: t.add(k), keys)))
        ours, mlx = PrefixTrie(), PromptTrie()
        for key in keys:
            ours.add(key)
            mlx.add("m", list(key), key)
        slow, fast, ratios = [], [], []
        for _ in range(args.rounds):
            t_mlx, want = timed(lambda: theirs(mlx, query), args.lookups)
            t_ours, got = timed(lambda: ours.longest_prefix(query, lambda k: True), args.lookups)
            assert isinstance(want, tuple) and isinstance(got, tuple)
            if (len(want[0]), want[1]) != (len(got[0]), got[1]):
                sys.exit(f"the indexes disagree: {len(want[0])}/{want[1]} vs {len(got[0])}/{got[1]}")
            slow.append(t_mlx * 1e3)
            fast.append(t_ours * 1e3)
            ratios.append(t_mlx / t_ours)

        def show(xs: list[float]) -> str:
            return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"
        print(f"{entries:>8} {SYSTEM + length:>7} {show(slow):>22} {show(fast):>22} "
              f"{statistics.median(ratios):>16.0f}", flush=True)
    print(f"\n{'entries':>8} {'tokens':>7} {'add us, mlx-lm':>15} {'add us, orchard':>16} "
          f"{'+full GC ms, mlx-lm':>20} {'+full GC ms, orchard':>21}")
    for entries, length, (add_mlx, gc_mlx), (add_ours, gc_ours) in costs:
        print(f"{entries:>8} {SYSTEM + length:>7} {add_mlx:>15.0f} {add_ours:>16.1f} "
              f"{gc_mlx:>20.1f} {gc_ours:>21.1f}")


if __name__ == "__main__":
    main()
