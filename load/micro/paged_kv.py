"""Paged KV (`replicas/engine/kv/paged.py`) against today's padded batch, in process, no HTTP.

    python -m load.micro.paged_kv [--source builtin:tiny] [--rounds 3]

Five figures, each paged and padded in the same run (alternating within a round), and
the paged/padded ratio of their medians:

- cold: seconds from a fresh batch with no budget set (the machine's default budget, as a
  replica without `memory.budget_bytes` gets) to the first token of each of 8 short rows:
  a new replica's first round, which paid for allocating the whole pool before its arrays
  grew with use;
- sessions: how many sessions of an agent mix (a few long histories, many short calls,
  arriving interleaved) the engine's admission (`KvBudget.take`, first come first served)
  holds at once under one fixed budget, with the model's measured KV layout; then the
  admitted rows are run for a few steps to check that they really decode together;
- uniform: decode tokens/s with 1, 8 and 32 streams of one prompt length;
- mixed: decode tokens/s with one long row among short ones;
- join: the step in which a short row joins a batch of long rows, over the median steady
  step before it (mlx-lm's padded `extend` copies the whole batch's KV).

Each ratio is the median of the rounds' paged/padded ratios (min-max), each round's pair
run back to back, in alternating order.

Decode rates are timed after every row has its first token (prefill excluded: it is the
same code on both paths). On this CPU the model is `builtin:tiny` (2 layers, float32):
`builtin:bench` (bf16) prefills 2k tokens in about 100 s here.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

from load.harness.stats import Spread, at_least_three, spread

Build = Callable[[bool], Any]


def _rows(prompts: list[list[int]], tokens: int) -> list[Any]:
    from replicas.contract import SamplingParams
    from replicas.engine.batch.rows import Row
    from replicas.engine.sampling.samplers import make_request_sampler

    # Random-weight rows never stop early: greedy, no stop ids.
    return [Row(tuple(p), 0, tokens, frozenset(),
                make_request_sampler(SamplingParams(temperature=0.0))) for p in prompts]


def _prompt(seed: int, length: int) -> list[int]:
    return [(31 * seed + 7 * j) % 400 + 3 for j in range(length)]


class Setup:
    """A model, and a way to make its batch paged or padded under a budget."""

    def __init__(self, source: str, budget: int) -> None:
        from replicas.engine.kv.layout import measure_kv
        from replicas.engine.model.loading import load_model
        from replicas.sources import resolve_source

        self.model = load_model(source, resolve_source(source)).model
        self.layout = measure_kv(self.model)
        self.budget = budget

    def batch(self, paged: bool, budget: int | None = None) -> tuple[Any, Any]:
        from replicas.engine.batch.local import LocalBatch
        from replicas.engine.config import EngineConfig
        from replicas.engine.kv.budget import KvBudget

        config = EngineConfig(prompt_cache_bytes=0, paged_kv="on" if paged else "off",
                              max_batch_size=64)
        batch = LocalBatch(self.model, config)
        kv = KvBudget(budget or self.budget, self.layout, 256)
        batch.page(kv, 32768)
        return batch, kv


def _fill(batch: Any, rows: list[Any]) -> list[int]:
    """Insert `rows` longest first, one at a time (mlx-lm right-pads a prefill batch to
    its longest), each stepped until it has its first token."""
    uids = []
    for row in sorted(rows, key=lambda r: -len(r.prompt_ids)):
        uid = batch.insert([row])[0][0]
        while uid not in {r.uid for r in batch.step()}:
            pass
        uids.append(uid)
    return uids


def _end(batch: Any, uids: list[int]) -> None:
    from replicas.engine.batch.rows import Done

    batch.finish([Done(u, keep=False) for u in uids])


def decode_rate(setup: Setup, paged: bool, lengths: list[int], steps: int) -> float:
    """Decode tokens/s of rows with prompts of `lengths`, over `steps` steps."""
    batch, _ = setup.batch(paged, 2 * len(lengths) * (max(lengths) + 256) * setup.layout.per_token)
    uids = _fill(batch, _rows([_prompt(i, n) for i, n in enumerate(lengths)], 10**6))
    start, tokens = time.perf_counter(), 0
    for _ in range(steps):
        tokens += len(batch.step())
    seconds = time.perf_counter() - start
    _end(batch, uids)
    return tokens / seconds


def join_spike(setup: Setup, paged: bool, long_rows: int, length: int) -> float:
    """The join step's time over the median steady step, a short row joining `long_rows`
    rows of `length` tokens (under a budget that holds them)."""
    batch, _ = setup.batch(paged, 2 * long_rows * (length + 256) * setup.layout.per_token)
    uids = _fill(batch, _rows([_prompt(i, length) for i in range(long_rows)], 10**6))
    steady = []
    for _ in range(8):
        start = time.perf_counter()
        batch.step()
        steady.append(time.perf_counter() - start)
    uids += [u for u, _ in batch.insert(_rows([_prompt(99, 16)], 10**6))]
    start = time.perf_counter()
    batch.step()
    joined = time.perf_counter() - start
    _end(batch, uids)
    return joined / spread(steady).median


def cold_round(setup: Setup, paged: bool, rows: int, length: int) -> float:
    """Seconds from a fresh batch under the machine's default budget (none set) to every
    one of `rows` rows of `length` tokens having its first token."""
    from replicas.engine.kv.budget import default_budget, machine, weights_bytes

    budget = default_budget(machine(), weights_bytes(setup.model))
    start = time.perf_counter()
    batch, _ = setup.batch(paged, budget)
    uids = [u for u, _ in batch.insert(_rows([_prompt(i, length) for i in range(rows)], 4))]
    seen: set[int] = set()
    while not seen.issuperset(uids):
        seen.update(r.uid for r in batch.step())
    seconds = time.perf_counter() - start
    _end(batch, uids)
    return seconds


def sessions(setup: Setup, paged: bool, mix: list[int], check_steps: int) -> int:
    """Sessions of `mix` (prompt lengths, in arrival order) admission holds at once; the
    admitted ones are run for `check_steps` decode steps together."""
    batch, kv = setup.batch(paged)
    # Each decodes while the later ones join (a step or two each), then `check_steps`.
    tokens = 4 * len(mix) + check_steps
    admitted, _, _ = kv.take(list(enumerate(mix)), key=lambda s: s[0],
                             tokens=lambda s: s[1] + tokens, bound=lambda n: None)
    uids = _fill(batch, _rows([_prompt(i, n) for i, n in admitted], tokens))
    together = min(len(batch.step()) for _ in range(check_steps))
    _end(batch, uids)
    if together != len(admitted):
        raise SystemExit(f"{'paged' if paged else 'padded'}: {len(admitted)} admitted, "
                         f"{together} decoded together")
    return len(admitted)


def _pair(name: str, run: Callable[[bool], float], rounds: int,
          results: dict[str, tuple[Spread, Spread, float]]) -> None:
    got: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for paged in ((True, False) if r % 2 == 0 else (False, True)):
            got[paged].append(run(paged))
    # Each round's pair ran back to back: their ratio drifts less with the machine's load
    # than either figure alone.
    ratios = spread(a / b for a, b in zip(got[True], got[False]))
    p, q = spread(got[True]), spread(got[False])
    results[name] = (p, q, ratios.median)
    print(f"{name:<30} paged {p.text('.2f'):<26} padded {q.text('.2f'):<26} "
          f"ratio {ratios.text('.2f')}", flush=True)


def main() -> None:
    args = build_parser().parse_args()
    at_least_three(args.rounds, "--rounds")
    setup = Setup(args.source, args.budget_mib * 1024**2)
    per_token = setup.layout.per_token
    print(f"{args.source}: {per_token} KV bytes a token; budget {args.budget_mib} MiB "
          f"({setup.budget // per_token} tokens)", flush=True)
    results: dict[str, tuple[Spread, Spread, float]] = {}
    # The agent mix: a long history every eighth arrival, short calls between.
    mix = [args.long if i % 8 == 0 else args.short for i in range(args.sessions)]
    _pair("cold first round s, 8 x 64, no budget",
          lambda paged: cold_round(setup, paged, 8, 64), args.rounds, results)
    _pair(f"sessions held ({args.long}/{args.short})",
          lambda paged: float(sessions(setup, paged, mix, 4)), args.rounds, results)
    for streams in (1, 8, 32):
        _pair(f"uniform tok/s, {streams} x {args.uniform}",
              lambda paged: decode_rate(setup, paged, [args.uniform] * streams, args.steps),
              args.rounds, results)
    mixed = [args.long] + [args.short] * 15
    _pair(f"mixed tok/s, 1x{args.long}+15x{args.short}",
          lambda paged: decode_rate(setup, paged, mixed, args.steps), args.rounds, results)
    _pair(f"join step / steady, 8 x {args.long}",
          lambda paged: join_spike(setup, paged, 8, args.long), args.rounds, results)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--source", default="builtin:tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-mib", type=int, default=32,
                        help="the KV budget the sessions figure admits under")
    parser.add_argument("--sessions", type=int, default=32, help="agent-mix arrivals")
    parser.add_argument("--long", type=int, default=4096, help="a long history's tokens")
    parser.add_argument("--short", type=int, default=256, help="a short call's tokens")
    parser.add_argument("--uniform", type=int, default=512, help="uniform prompt length")
    parser.add_argument("--steps", type=int, default=48, help="decode steps timed")
    return parser


if __name__ == "__main__":
    main()
