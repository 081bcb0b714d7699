"""What dropping rejected speculative tails costs a batch cache: mlx-lm's roll of each row
into its left padding (`prepare(right_padding)` / `finalize()`, what Orchard did before)
against `replicas.engine.spec.tails.drop_tails` (a few slots moved per row), at several context
lengths, on a cache shaped like `builtin:bench`'s (8 layers, 4 KV heads of 64, bfloat16).

Each round appends a verifying pass's positions to every row, then drops a ragged tail
(rows reject 0-4 of 5, as speculation does), timed to the end of the evaluation. Prints
the median and range over the rounds, and their ratio.

    python -m load.micro.tails [--rows 8] [--contexts 1024 4096 16384] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from load.harness.stats import at_least_three
from replicas.engine.spec.tails import drop_tails

LAYERS, HEADS, HEAD_DIM = 8, 4, 64  # builtin:bench's KV
WIDTH = 5  # a pass of the pending token and 4 drafts


def roll(caches: list[Any], rejected: list[int]) -> None:
    """mlx-lm's move: what all rows reject trimmed, the rest rolled into the left padding."""
    common = min(rejected)
    for cache in caches:
        if common:
            cache.trim(common)
        cache.prepare(right_padding=[r - common for r in rejected])
        cache.finalize()


def filled(rows: int, context: int) -> list[Any]:
    caches = []
    for _ in range(LAYERS):
        cache = BatchKVCache([0] * rows)
        kv = mx.random.normal((rows, HEADS, context, HEAD_DIM)).astype(mx.bfloat16)
        cache.update_and_fetch(kv, kv)
        caches.append(cache)
    mx.eval([c.keys for c in caches])
    return caches


def timed(drop: Callable[[list[Any], list[int]], Any], rows: int, context: int,
          rounds: int) -> list[float]:
    caches = filled(rows, context)
    rejected = [i % WIDTH for i in range(rows)]
    times = []
    for _ in range(rounds + 1):  # the first round warms the allocator: not counted
        kv = mx.zeros((rows, HEADS, WIDTH, HEAD_DIM), dtype=mx.bfloat16)
        for cache in caches:
            cache.update_and_fetch(kv, kv)
        mx.eval([c.keys for c in caches] + [c.values for c in caches])
        start = time.perf_counter()
        drop(caches, rejected)
        mx.eval([c.keys for c in caches] + [c.values for c in caches])
        times.append((time.perf_counter() - start) * 1000)
    return times[1:]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--rounds", type=int, default=7)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    at_least_three(args.rounds, "--rounds")
    print(f"{args.rows} rows, {LAYERS} layers x {HEADS} KV heads x {HEAD_DIM}, bfloat16, "
          f"rejected {[i % WIDTH for i in range(args.rows)]} of {WIDTH}; "
          f"{args.rounds} rounds; mlx {mx.__version__} on {mx.default_device()}")
    print(f"{'context':>8} {'roll ms':>22} {'drop_tails ms':>22} {'roll/drop':>10}")
    for context in args.contexts:
        rolled = timed(roll, args.rows, context, args.rounds)
        dropped = timed(drop_tails, args.rows, context, args.rounds)
        r, d = statistics.median(rolled), statistics.median(dropped)
        print(f"{context:>8} {r:>9.1f} ({min(rolled):.1f}-{max(rolled):.1f}) "
              f"{d:>9.1f} ({min(dropped):.1f}-{max(dropped):.1f}) {r / d:>10.1f}")
    print("command: python -m load.micro.tails " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
