"""Rows joining and leaving a decoding batch, in process: mlx-lm's `BatchGenerator` against
Orchard's `LocalBatch` (`replicas/engine/batch/prefill.py`), no HTTP.

    python -m load.micro.joining

`--streams` sequences in flight, each replaced by the next prompt the step it ends (a closed
loop of clients, as `bench_serving.RawModel.arrivals`); the first ones end at staggered
lengths, so rows join and leave one at a time. Timed until the last of `--requests` prompts
has joined. Three targets, in alternating rounds:

- mlx_lm: its `BatchGenerator` (`RawModel.arrivals`, the ceiling bench's `raw_arrivals`);
- orchard_mlx_join: Orchard's batch with mlx-lm's join (a joining row's last prompt token in
  a pass of its own), set through the batch's own switch, as speculation sets it;
- orchard: the batch as shipped.

Besides tok/s, every model call is counted (the model class's `__call__`): single-position
passes per generated token, the figure that sets decode speed on a Mac, where a pass costs
a read of all the weights whatever its rows. On this CPU box a pass costs in proportion to
its rows, so a one-row pass is cheap and that count does not show in tok/s. Reports medians
over rounds (min-max) and the per-round ratios' median. Writes load/out/bench_joining.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from load.harness.stats import spread
from load.harness.targets import RawModel

OUT = Path(__file__).resolve().parents[2] / "load" / "out"
TARGETS = ("mlx_lm", "orchard_mlx_join", "orchard")


class Passes:
    """Single-position model calls (decode passes), counted on the model's class."""

    def __init__(self, model: Any) -> None:
        self.count = 0
        cls, call = type(model), type(model).__call__

        def counted(module: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            self.count += inputs.shape[1] == 1
            return call(module, inputs, *args, **kwargs)

        cls.__call__ = counted


def orchard(raw: RawModel, prompts: list[list[int]], streams: int, tokens: int,
            mlx_join: bool) -> tuple[int, float]:
    """Orchard's `LocalBatch` fed as `RawModel.arrivals` feeds mlx-lm: (tokens, seconds)."""
    from replicas.contract import SamplingParams
    from replicas.engine.batch.local import LocalBatch
    from replicas.engine.batch.rows import Done, Row
    from replicas.engine.config import EngineConfig
    from replicas.engine.sampling.samplers import make_request_sampler

    batch = LocalBatch(raw.loaded.model, EngineConfig(prompt_cache_bytes=0))
    if mlx_join:  # the batch's switch, as a speculating batch sets it
        batch._gen._prompt_batch.in_pass = False
    sampler = make_request_sampler(SamplingParams(temperature=0.0))
    queue = iter(prompts)

    def insert(limit: int) -> None:
        batch.insert([Row(tuple(next(queue)), 0, limit, frozenset(), sampler)])

    start = time.perf_counter()
    for i in range(streams):
        insert(max(1, tokens * (i + 1) // streams))
    n, left = 0, len(prompts) - streams
    while left > 0:
        for response in batch.step():
            n += 1
            if response.finish_reason is not None:
                batch.finish([Done(response.uid, keep=False)])
                if left > 0:
                    insert(tokens)
                    left -= 1
    return n, time.perf_counter() - start


def main() -> None:
    args = build_parser().parse_args()
    raw = RawModel(args.model)
    passes = Passes(raw.loaded.model)
    prompts = [raw.tokens(f"Story {i}. Tell it.") for i in range(args.requests)]
    runs: dict[str, list[dict[str, float]]] = {t: [] for t in TARGETS}
    for r in range(args.rounds):
        for target in TARGETS:
            before = passes.count
            if target == "mlx_lm":
                run = raw.arrivals(args.tokens, args.streams, prompts)
                n, seconds = run.count, run.seconds
            else:
                n, seconds = orchard(raw, prompts, args.streams, args.tokens,
                                     mlx_join=target == "orchard_mlx_join")
            made = passes.count - before
            runs[target].append({"tokens": n, "seconds": seconds, "tps": n / seconds,
                                 "passes_per_token": made / n})
            print(f"  round {r + 1} {target:<17} {n / seconds:8.0f} tok/s  "
                  f"{made / n:.4f} passes a token", flush=True)
    print(f"\n{args.model}, {args.streams} streams, {args.tokens} greedy tokens a request, "
          f"{args.requests} requests; medians over {args.rounds} rounds (min-max)")
    for target in TARGETS:
        tps = [x["tps"] for x in runs[target]]
        per = [x["passes_per_token"] for x in runs[target]]
        print(f"  {target:<17} tok/s {spread(tps).text('.0f'):>22}   decode passes a token "
              f"{statistics.median(per):.4f}")
    ratios = {f"orchard/{base}": [o["tps"] / b["tps"] for o, b in
                                  zip(runs["orchard"], runs[base])]
              for base in ("orchard_mlx_join", "mlx_lm")}
    for name, values in ratios.items():
        mid, low, high = spread(values)
        print(f"  {name:<26} {mid:.2f} ({low:.2f}-{high:.2f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "streams": args.streams,
                                    "tokens": args.tokens, "runs": runs,
                                    "ratios": ratios}, indent=1))
    print(f"\nwrote {args.out}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default="builtin:ceiling", help="model source")
    parser.add_argument("--streams", type=int, default=32, help="sequences in flight")
    parser.add_argument("--tokens", type=int, default=128, help="greedy tokens per request")
    parser.add_argument("--requests", type=int, default=512, help="prompts per round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--out", type=Path, default=OUT / "bench_joining.json")
    return parser


if __name__ == "__main__":
    main()
