"""A prefix-cache lookup as the cache fills: mlx-lm's `PromptTrie` against Orchard's
`PrefixTrie` (`replicas.engine.prefix_trie`), on the same entries, in this process.

    python load/bench_prefix_lookup.py

Each level caches N conversations: one shared system prompt, then each its own tokens. The
lookup is a new conversation's prompt: the system prompt, then tokens no entry has, so both
indexes must find an entry through the point where it leaves them (the case a new user of a
busy server is). mlx-lm's is read as `PromptCache` read it before this index replaced it
(exact, else a longer entry past the longest shorter one, else the shorter). Per level:
`--rounds` alternating rounds, each the median of `--lookups` lookups per index; prints the
medians (min-max) and mlx-lm/Orchard, the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a plain script

from mlx_lm.models.cache import PromptTrie  # noqa: E402

from replicas.engine.prefix_trie import PrefixTrie  # noqa: E402

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
    for entries, length in LEVELS:
        ours, mlx = PrefixTrie(), PromptTrie()
        for e in range(entries):
            rng = random.Random(e)
            key = tuple(system + [rng.randrange(1000, 100_000) for _ in range(length)])
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


if __name__ == "__main__":
    main()
