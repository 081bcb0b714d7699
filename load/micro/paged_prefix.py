"""Prefix hits on the paged batch: sharing the cached blocks against copying them, in process.

    python -m load.micro.paged_prefix [--source builtin:tiny] [--rounds 3]

One cached prefix (`--prefix` tokens, kept at its message boundary), then `--rows` rows
that hit it join at once, each with a few tokens of its own. Three ways, alternating
within a round: `share` (today's paged batch: the hit's blocks are shared, the partial
last one copied on write), `copy` (the same batch with each hit handed over as arrays, so
the merge copies the prefix into blocks per row: the paged batch before the prefix cache
shared blocks) and `padded` (mlx-lm's padded batch, whose merge copies every hit). For
each: the seconds until every joining row has its first token, the pool's blocks the
join took (paged) and MLX's peak memory above what was active before the join. Ratios
are of the rounds' medians against `copy` and `padded`.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import replace
from typing import Any

import mlx.core as mx

from load.harness.stats import Spread, at_least_three, spread
from load.micro.paged_kv import Setup, _prompt, _rows

MODES = ("share", "copy", "padded")


def join(setup: Setup, mode: str, prefix_len: int, rows: int) -> tuple[float, int, int]:
    """(seconds to every joining row's first token, blocks taken, peak bytes above active)."""
    from replicas.engine.batch.local import LocalBatch
    from replicas.engine.batch.rows import Done
    from replicas.engine.config import EngineConfig
    from replicas.engine.kv.budget import KvBudget
    from replicas.engine.kv.prefix_cache import CacheHit
    from replicas.engine.kv.rows import plain

    config = EngineConfig(prompt_cache_bytes=256 * 1024**2, max_batch_size=64,
                          paged_kv="off" if mode == "padded" else "on")
    batch = LocalBatch(setup.model, config)
    kv = KvBudget(setup.budget, setup.layout, 256)
    batch.page(kv, 32768)
    prefix = _prompt(1, prefix_len)
    [seed] = _rows([prefix + _prompt(2, 8)], 2)
    seed = replace(seed, boundary=prefix_len)  # its prefix kept at the boundary
    batch.insert([seed])
    while not batch.empty:
        for r in batch.step():
            if r.finish_reason is not None:
                batch.finish([Done(r.uid, keep=True)])
    cache = batch.cache
    assert cache is not None
    if mode == "copy":  # the hit as arrays (made before the clock starts): merged by copy
        hit = cache.fetch(prefix + [0], count=False)
        assert hit is not None
        arrays = plain(hit.cache)
        mx.eval([c.keys for c in arrays if c.keys is not None])
        cache.fetch = lambda tokens, count=True: CacheHit(list(arrays), prefix_len)  # type: ignore
    joining = _rows([prefix + _prompt(10 + i, 4 + i) for i in range(rows)], 4)
    gc.collect()
    mx.synchronize()
    free = kv.blocks().free if kv.blocks is not None else 0
    active = mx.get_active_memory()
    mx.reset_peak_memory()
    start = time.perf_counter()
    served = batch.insert(joining)
    waiting = {u for u, _ in served}
    while waiting:
        waiting -= {r.uid for r in batch.step()}
    mx.synchronize()
    seconds = time.perf_counter() - start
    peak = mx.get_peak_memory() - active
    taken = free - kv.blocks().free if kv.blocks is not None else 0
    assert all(n >= prefix_len for _, n in served), served
    batch.finish([Done(u, keep=False) for u, _ in served])
    return seconds, taken, peak


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    at_least_three(args.rounds, "--rounds")
    setup = Setup(args.source, args.budget_mib * 1024**2)
    print(f"{args.source}: {setup.layout.per_token} KV bytes a token; a {args.prefix}-token "
          f"prefix, {args.rows} rows hitting it")
    got: dict[str, list[tuple[float, int, int]]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            got[mode].append(join(setup, mode, args.prefix, args.rows))
    seconds = {m: spread(x[0] for x in got[m]) for m in MODES}
    for m in MODES:
        blocks = spread(x[1] for x in got[m])
        peak = spread(x[2] for x in got[m])
        print(f"{m:7s} join {seconds[m].text('.3f')} s   blocks {blocks.text('.0f')}   "
              f"peak above active {peak.text('.1f', 1 / 1024**2)} MiB")
    for base in ("copy", "padded"):
        ratios: Spread = spread(s[0] / b[0] for s, b in zip(got["share"], got[base]))
        print(f"join time share/{base}: {ratios.text('.2f')}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--source", default="builtin:tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-mib", type=int, default=512)
    parser.add_argument("--prefix", type=int, default=4096, help="the cached prefix's tokens")
    parser.add_argument("--rows", type=int, default=8, help="rows hitting it at once")
    return parser


if __name__ == "__main__":
    main()
