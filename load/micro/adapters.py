"""LoRA adapters chosen per row, in process: 16 streams over 4 adapters in one batch
against the same 16 streams on the base model alone (`replicas/engine/model/lora.py`).

    python -m load.micro.adapters

Three targets, in alternating rounds, each on Orchard's `LocalBatch` with the same prompts:

- base: the model as loaded, no adapters anywhere (the baseline);
- adapters: the model with `--adapters` random LoRA adapters (made with mlx-lm's own tuner
  classes, `replicas.builtin.adapters`, rank `--rank` on every linear layer of every block,
  as `mlx_lm.lora`'s defaults convert), each stream on one of them, round robin: every
  pass applies each row's A and B by a batched gather;
- adapters_idle: the adapted model with every row on the base (slot 0 everywhere: the
  adapted layers skip their gather), what loading adapters costs rows that use none.

All `--streams` start together and decode `--tokens` greedy tokens each; timed from the
insert to the last token. Each round runs the three in turn, starting one target further
than the round before, so none always runs first. Reports tok/s medians over rounds (min-max) and the per-round
ratios against base. Writes load/out/bench_adapters.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from load.harness.stats import at_least_three, spread

OUT = Path(__file__).resolve().parents[2] / "load" / "out"
TARGETS = ("base", "adapters", "adapters_idle")


def run(model: Any, table: Any, prompts: list[list[int]], tokens: int,
        names: list[str | None]) -> tuple[int, float]:
    """Every prompt in one batch at once, row i on adapter `names[i]`: (tokens, seconds)."""
    from replicas.contract import SamplingParams
    from replicas.engine.batch.local import LocalBatch
    from replicas.engine.batch.rows import Done, Row
    from replicas.engine.config import EngineConfig
    from replicas.engine.sampling.samplers import make_request_sampler

    batch = LocalBatch(model, EngineConfig(prompt_cache_bytes=0, max_batch_size=len(prompts)),
                       adapters=table)
    sampler = make_request_sampler(SamplingParams(temperature=0.0))
    start = time.perf_counter()
    batch.insert([Row(tuple(p), 0, tokens, frozenset(), sampler, adapter=name)
                  for p, name in zip(prompts, names)])
    n = 0
    while not batch.empty:
        for response in batch.step():
            n += 1
            if response.finish_reason is not None:
                batch.finish([Done(response.uid, keep=False)])
    return n, time.perf_counter() - start


def main() -> None:
    args = build_parser().parse_args()
    at_least_three(args.rounds, "--rounds")
    from replicas.builtin.adapters import make_adapter
    from replicas.engine.model.adapters import load_adapters
    from replicas.engine.model.loading import load_model
    from replicas.sources import resolve_source

    path = resolve_source(args.model)
    base = load_model(args.model, path).model
    adapted = load_model(args.model, path).model
    names = [f"a{i}" for i in range(args.adapters)]
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {n: str(make_adapter(path, Path(tmp) / n, seed=i + 1, rank=args.rank))
                for i, n in enumerate(names)}
        table = load_adapters(adapted, dirs)
    vocab = 1000
    prompts = [[(31 * i + 7 * j) % vocab + 3 for j in range(args.prompt)]
               for i in range(args.streams)]
    chosen: list[str | None] = [names[i % len(names)] for i in range(args.streams)]
    runs: dict[str, list[dict[str, float]]] = {t: [] for t in TARGETS}
    for r in range(args.rounds):
        # Each round starts at the next target: no target always runs first (or last).
        for target in TARGETS[r % 3:] + TARGETS[:r % 3]:
            if target == "base":
                n, seconds = run(base, None, prompts, args.tokens, [None] * args.streams)
            elif target == "adapters":
                n, seconds = run(adapted, table, prompts, args.tokens, chosen)
            else:
                n, seconds = run(adapted, table, prompts, args.tokens, [None] * args.streams)
            runs[target].append({"tokens": n, "seconds": seconds, "tps": n / seconds})
            print(f"  round {r + 1} {target:<14} {n / seconds:8.0f} tok/s", flush=True)
    print(f"\n{args.model}, {args.streams} streams over {args.adapters} adapters (rank "
          f"{args.rank}, every linear layer), {args.prompt}-token prompts, {args.tokens} "
          f"greedy tokens each; medians over {args.rounds} rounds (min-max)")
    for target in TARGETS:
        print(f"  {target:<14} tok/s {spread(x['tps'] for x in runs[target]).text('.0f'):>22}")
    ratios = {f"{t}/base": [a["tps"] / b["tps"] for a, b in zip(runs[t], runs["base"])]
              for t in TARGETS[1:]}
    for name, values in ratios.items():
        mid, low, high = spread(values)
        print(f"  {name:<20} {mid:.2f}x ({low:.2f}-{high:.2f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "streams": args.streams,
                                    "adapters": args.adapters, "rank": args.rank,
                                    "tokens": args.tokens, "runs": runs, "ratios": ratios},
                                   indent=1))
    print(f"\nwrote {args.out}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default="builtin:bench")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8, help="mlx_lm.lora's default")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens a stream")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens a stream")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=OUT / "bench_adapters.json")
    return parser


if __name__ == "__main__":
    main()
