"""Speculative decoding by prompt lookup (or a draft model, `--draft-model`, or the model's
MTP layer, `--mtp`), and batched logit_bias: raw mlx-lm vs Orchard.

In-process: raw mlx-lm's `BatchGenerator` vs Orchard's batch
(`replicas.engine.batch.local.LocalBatch`) with speculation off and on, same model, prompts and
`max_tokens`.

    python -m load.micro.speculative [--model builtin:bench] [--streams 1 8 32] [--rounds 3]

At each of `--streams` rows decoding together (`--max-tokens` per row: one value, or one per
stream count), for each workload:

- `greedy`: temperature 0 on the random-weight model, which falls into repeating its own
  output, so prompt-lookup drafts can hit (how often is the acceptance column);
- `sampled`: temperature 1.0, unseeded: on random weights the target seldom samples the
  draft, so this is mostly speculation's cost;
- `copy`: temperature 0, each prompt followed by the model's own greedy answer to it and then
  the prompt again (`speculative_runs.copy_prompts`, built before the round by raw mlx-lm and
  not timed): the request re-types a span its context holds, where prompt lookup is meant to
  hit. On `builtin:mtp-bench`, whose next token depends on the newest alone, every draft can.

Three engines, in an order that rotates each round: `raw` (plain
`mlx_lm.generate.BatchGenerator`), `off` (`LocalBatch`, `EngineConfig.speculative` None) and
`on` (`SpeculativeConfig` from the flags). `on` runs the speculation gate
(`replicas.engine.spec.gate`, `--no-gate`: none), one per workload and stream count kept
across rounds, as a server's engine keeps its own: the first rounds pay for measuring
drafting and plain steps (16 steps each), so short runs show less of what it keeps. Rows are built as `replicas.engine.scheduling.row_for`
builds them, with no stop ids, so every row makes exactly `max_tokens`; prompts are a
numbered random sentence each (`--prompt-words`), new each round (the engines of a round
share them), all prefilled in one batch. Decode tok/s counts the tokens after the first step
that produced any, over the time since (prefill and the first step left out). Tokens per
pass and acceptance come from `LocalBatch.decode_counts()`. Greedy outputs must be equal raw
vs off vs on, row by row: a difference stops the run (exit 1).

The bias tables: `--bias-streams` greedy rows (one of `--streams`; 0: none), one of them with
`logit_bias` {`--bias-token`: `--bias-value`}. "Before" is raw mlx-lm with that row's
`make_logits_processors(logit_bias=...)` (mlx-lm's per-row Python loop), "after" is
`LocalBatch`, speculation off, with the row's `Penalties` (one vectorized op for the batch);
each biased run right after the same engine's unbiased one. On `--model`, the unbiased runs
are the greedy table's own; then again on `--bias-model` (default `builtin:ceiling`, next to
no compute per token, where a step's Python shows), `--bias-model-tokens` per row. Biased
outputs must be equal raw vs Orchard.

Every figure is a median over `--rounds` (at least 3) with min-max; ratios are medians of the
per-round ratios. Writes load/out/bench_speculative.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import sys
import time
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx

from replicas.engine.config import SpeculativeConfig
from replicas.engine.model.mtp import load_mtp
from replicas.engine.spec.gate import SpeculationGate
from replicas.sources import load_source
from load.harness.stats import at_least_three, spread
from load.micro.speculative_runs import TIES, BatchRun, Outputs, copy_prompts, mismatch, \
    prompts, run_orchard, run_raw

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "load" / "out"
ENGINES = ("raw", "off", "on")
BIAS_KEYS = ("raw", "raw+bias", "off", "off+bias")
TEMPERATURE = {"greedy": 0.0, "sampled": 1.0, "copy": 0.0}
# What it measures: the batch, the drafters and the samplers' rooms, and the files beside them.
ENGINE_PARTS = ("batch", "spec", "sampling", "config.py", "stats.py", "model/mtp.py")


def fmt(values: list[float], digits: int = 1, width: int = 21) -> str:
    s = spread(values)
    return s.text(f".{0 if s.median >= 1000 else digits}f").rjust(width)


def engine_digest() -> str:
    """The engine files this measures, hashed: the run's JSON says which tree it saw."""
    digest = hashlib.sha256()
    engine = ROOT / "replicas" / "engine"
    for part in ENGINE_PARTS:
        for path in sorted((engine / part).rglob("*.py")) if (engine / part).is_dir() else [engine / part]:
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default="builtin:bench")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32],
                        help="rows decoding together")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[64, 16, 12],
                        help="tokens per row: one value, or one per --streams entry")
    parser.add_argument("--workloads", nargs="+", choices=sorted(TEMPERATURE),
                        default=["greedy", "sampled"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--draft-model", default=None, help="`on` drafts with this model "
                        "(speculative.method draft) instead of prompt lookup")
    parser.add_argument("--mtp", action="store_true", help="`on` drafts with the model's "
                        "MTP layer (speculative.method mtp; builtin:mtp-bench has one)")
    parser.add_argument("--lookup-min", type=int, default=1, help="prompt_lookup_min")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="no drafts while more rows than this decode (default: never)")
    parser.add_argument("--no-gate", action="store_true", help="draft at every batch size "
                        "(disable_when_slower false); by default `on` runs the speculation "
                        "gate, one per workload and stream count, kept across rounds")
    parser.add_argument("--prompt-words", type=int, default=2,
                        help="random words per prompt (about 2.7 tokens each)")
    parser.add_argument("--bias-streams", type=int, default=32,
                        help="rows of the logit_bias tables, one of --streams (0: no tables)")
    parser.add_argument("--bias-token", type=int, default=5)
    parser.add_argument("--bias-value", type=float, default=2.0)
    parser.add_argument("--bias-model", default="builtin:ceiling",
                        help="a second bias table on this model ('none': only --model's)")
    parser.add_argument("--bias-model-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0,
                        help="the prompts' words (round r uses seed + r)")
    parser.add_argument("--out", type=Path, default=OUT / "bench_speculative.json")
    return parser


def engine(loaded: Any, key: str, batch: list[list[int]], workload: str, tokens: int,
           spec: SpeculativeConfig, bias: dict[int, float], draft: Any = None,
           gate: SpeculationGate | None = None) -> tuple[BatchRun, Outputs]:
    """`key`: raw, off or on, "+bias" for row 0 biased; `gate`: `on`'s speculation gate."""
    name, biased = key.removesuffix("+bias"), key.endswith("+bias")
    temperature = TEMPERATURE[workload]
    start = time.perf_counter()
    if name == "raw":
        run, outputs = run_raw(loaded, batch, tokens, temperature, bias if biased else None)
    else:
        run, outputs = run_orchard(loaded, batch, tokens, temperature,
                                   spec if name == "on" else None, bias if biased else None,
                                   draft, gate if name == "on" else None)
    run.wall = time.perf_counter() - start
    if run.total_tokens != len(batch) * tokens:  # unequal work would skew every ratio
        raise SystemExit(f"{key}: {run.total_tokens} tokens, not {len(batch)} x {tokens}")
    return run, outputs


def verdict(drafting: bool | None) -> str:
    return {True: "kept", False: "stopped", None: "not yet measured"}[drafting]


def show(r: int, n: int, label: str, key: str, run: BatchRun) -> None:
    extra = (f"  {run.counted / run.passes:.2f} tok/pass, accepted {run.accepted}/"
             f"{run.drafted}" if run.passes else "")
    print(f"  round {r + 1} x{n:<3}{label:<8}{key:<9}{run.tps:>9.1f} tok/s{extra}", flush=True)


def differs(what: str, lines: list[str]) -> int:
    print(f"GREEDY OUTPUT DIFFERS ({what}):\n" + "\n".join(lines), flush=True)
    return 1


def bias_table(title: str, runs: dict[str, list[BatchRun]]) -> dict[str, Any]:
    tps = {k: [x.tps for x in runs[k]] for k in BIAS_KEYS}
    raw_ratio = [b / a for a, b in zip(tps["raw"], tps["raw+bias"])]
    off_ratio = [b / a for a, b in zip(tps["off"], tps["off+bias"])]
    orch_raw = [a / b for a, b in zip(tps["off+bias"], tps["raw+bias"])]
    off_path = {k: sum(x.rows_off_path for x in runs[k]) for k in ("off", "off+bias")}
    print(f"\n{title}")
    print(f"{'engine':<30}{'unbiased tok/s':>21}{'1 row biased':>21}{'biased/unbiased':>21}")
    print(f"{'before: raw mlx-lm (per row)':<30}{fmt(tps['raw'])}{fmt(tps['raw+bias'])}"
          f"{fmt(raw_ratio, 2)}")
    print(f"{'after: Orchard (batched)':<30}{fmt(tps['off'])}{fmt(tps['off+bias'])}"
          f"{fmt(off_ratio, 2)}")
    print(f"Orchard/raw, both with the biased row: {fmt(orch_raw, 2).strip()}; Orchard's rows "
          f"through a per-row Python call: {off_path['off+bias']} (unbiased {off_path['off']}); "
          "biased greedy outputs: raw == Orchard, every row")
    return {"raw_biased_over_unbiased": spread(raw_ratio)._asdict(),
            "orchard_biased_over_unbiased": spread(off_ratio)._asdict(),
            "orchard_over_raw_biased": spread(orch_raw)._asdict(),
            "tps": {k: spread(v)._asdict() for k, v in tps.items()}, "rows_off_path": off_path}


def main() -> int:
    args = build_parser().parse_args()
    at_least_three(args.rounds, "--rounds")
    if len(args.max_tokens) not in (1, len(args.streams)):
        raise SystemExit("--max-tokens takes one value, or one per --streams entry")
    budget = dict(zip(args.streams, args.max_tokens * len(args.streams)
                      if len(args.max_tokens) == 1 else args.max_tokens))
    if args.bias_streams and args.bias_streams not in args.streams:
        raise SystemExit("--bias-streams must be one of --streams (or 0)")
    if args.bias_streams and "greedy" not in args.workloads:
        raise SystemExit("the bias table on --model runs in the greedy workload")
    spec = SpeculativeConfig(args.num_speculative_tokens, args.lookup_max, args.lookup_min,
                             args.disable_by_batch_size, args.draft_model, args.mtp,
                             disable_when_slower=not args.no_gate)
    # As a server's engine keeps its gate for its lifetime, each (workload, streams) keeps
    # one across rounds: the first round pays for measuring both modes.
    gates = {(w, n): SpeculationGate() for w in args.workloads for n in args.streams}
    bias = {args.bias_token: args.bias_value}
    command = shlex.join(["python", os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    print(f"command: {command}", flush=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    digest = engine_digest()
    clock = time.monotonic()
    loaded = load_source(args.model)
    draft = load_mtp(loaded.model, loaded.path, loaded.config) if args.mtp else \
        load_source(args.draft_model).model if args.draft_model else None
    cheap = (load_source(args.bias_model)
             if args.bias_streams and args.bias_model != "none" else None)
    batches = [{n: prompts(loaded, n, args.prompt_words, args.seed + r) for n in args.streams}
               for r in range(args.rounds)]
    print("prompt tokens per row: " + ", ".join(
        f"x{n} {min(len(p) for b in batches for p in b[n])}-"
        f"{max(len(p) for b in batches for p in b[n])}" for n in args.streams), flush=True)

    # Warm-up: each engine at the smallest size, a few tokens (first-use costs).
    for name in ENGINES:
        engine(loaded, name, batches[0][min(args.streams)], "greedy", 4, spec, bias, draft)

    runs: dict[str, dict[int, dict[str, list[BatchRun]]]] = {
        w: {n: {e: [] for e in ENGINES} for n in args.streams} for w in args.workloads}
    bias_runs: dict[str, list[BatchRun]] = {k: [] for k in BIAS_KEYS}
    cheap_runs: dict[str, list[BatchRun]] = {k: [] for k in BIAS_KEYS}
    for r in range(args.rounds):
        for n in args.streams:
            for workload in args.workloads:
                with_bias = workload == "greedy" and n == args.bias_streams
                # A biased run right after its engine's unbiased one; the engines' order
                # rotates each round, so the machine's drift is spread over them.
                units = [(e, f"{e}+bias") if with_bias and e != "on" else (e,) for e in ENGINES]
                units = units[r % 3:] + units[:r % 3]
                prompt_rows = (copy_prompts(loaded, batches[r][n], budget[n] + 1 +
                                            spec.num_speculative_tokens)
                               if workload == "copy" else batches[r][n])
                outs: dict[str, Outputs] = {}
                for key in (k for unit in units for k in unit):
                    run, outs[key] = engine(loaded, key, prompt_rows, workload, budget[n],
                                            spec, bias, draft, gates[workload, n])
                    if key in ENGINES:
                        runs[workload][n][key].append(run)
                    if with_bias and key in bias_runs:
                        bias_runs[key].append(run)
                    show(r, n, workload, key, run)
                if TEMPERATURE[workload] > 0:
                    continue
                failures = (mismatch(f"round {r + 1} x{n} raw vs off", outs["raw"], outs["off"],
                                     loaded, prompt_rows)
                            + mismatch(f"round {r + 1} x{n} off vs on", outs["off"], outs["on"],
                                       loaded, prompt_rows))
                if with_bias:
                    failures += mismatch(f"round {r + 1} x{n} biased, raw vs Orchard",
                                         outs["raw+bias"], outs["off+bias"])
                if failures:
                    return differs("speculation, the batch or the bias changed what was "
                                   "decoded", failures)
        if cheap is not None:
            batch = prompts(cheap, args.bias_streams, args.prompt_words, args.seed + r)
            pairs = [("raw", "raw+bias"), ("off", "off+bias")]
            outs = {}
            for key in (k for unit in (pairs if r % 2 == 0 else pairs[::-1]) for k in unit):
                run, outs[key] = engine(cheap, key, batch, "greedy", args.bias_model_tokens,
                                        spec, bias)
                cheap_runs[key].append(run)
                show(r, args.bias_streams, "bias", key, run)
            failures = (mismatch(f"round {r + 1} {args.bias_model} raw vs off", outs["raw"],
                                 outs["off"])
                        + mismatch(f"round {r + 1} {args.bias_model} biased, raw vs Orchard",
                                   outs["raw+bias"], outs["off+bias"]))
            if failures:
                return differs(f"on {args.bias_model}", failures)

    minutes = (time.monotonic() - clock) / 60
    print(f"\nmodel {args.model} ({loaded.path.name}), {args.rounds} rounds, speculation "
          f"num_speculative_tokens {spec.num_speculative_tokens}, "
          + ("the model's MTP layer" if spec.mtp else
             f"draft model {spec.draft_model}" if spec.draft_model else
             f"prompt lookup {spec.prompt_lookup_min}..{spec.prompt_lookup_max}")
          + (f", off above {spec.disable_by_batch_size} rows" if spec.disable_by_batch_size
             is not None else "")
          + (", gate on (drafting kept where faster: "
             + ", ".join(f"{w} x{n} {verdict(g.drafting(n))}" for (w, n), g in gates.items())
             + ")" if spec.disable_when_slower else ", gate off")
          + f"; started {started}, "
          f"{minutes:.1f} min; load average now {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} CPUs; mlx {version('mlx')} on {mx.default_device()}, mlx-lm "
          f"{version('mlx-lm')}; engine files {digest}"
          f"{'' if engine_digest() == digest else ' (CHANGED during the run)'}")
    summary: dict[str, Any] = {}
    for workload in args.workloads:
        print(f"\n{workload} (temperature {TEMPERATURE[workload]:g}): decode tok/s, median "
              f"(min-max) of {args.rounds} rounds; ratios: median (min-max) of per-round ratios")
        print(f"{'streams':>7}{'tokens':>7}" + "".join(f"{e + ' tok/s':>21}" for e in ENGINES)
              + f"{'off/raw':>21}{'on/raw':>21}{'on/off':>21}{'tok/pass off-on':>17}"
              + f"{'accept':>8}")
        summary[workload] = {}
        for n in args.streams:
            by = runs[workload][n]
            tps = {e: [x.tps for x in by[e]] for e in ENGINES}
            ratio = {k: [a / b for a, b in zip(tps[x], tps[y])]
                     for k, x, y in (("off/raw", "off", "raw"), ("on/raw", "on", "raw"),
                                     ("on/off", "on", "off"))}
            per_pass = {e: sum(x.counted for x in by[e]) / max(1, sum(x.passes for x in by[e]))
                        for e in ("off", "on")}
            drafted = sum(x.drafted for x in by["on"])
            accepted = sum(x.accepted for x in by["on"])
            acceptance = accepted / drafted if drafted else 0.0
            print(f"{n:>7}{budget[n]:>7}" + "".join(fmt(tps[e]) for e in ENGINES)
                  + "".join(fmt(ratio[k], 2) for k in ratio)
                  + f"{per_pass['off']:>8.2f}-{per_pass['on']:<8.2f}{acceptance:>8.1%}")
            summary[workload][str(n)] = {
                "max_tokens": budget[n], "tps": {e: spread(v)._asdict() for e, v in tps.items()},
                "ratios": {k: spread(v)._asdict() for k, v in ratio.items()},
                "tokens_per_pass": per_pass, "drafted": drafted, "accepted": accepted,
                "acceptance": acceptance}
    print("tok/pass: decode_counts() tokens / passes (a pass counted once per row in it: a "
          "sequence's tokens per target pass), off and on; accept: accepted / drafted; both "
          "over all rounds.")
    if any(TEMPERATURE[w] == 0 for w in args.workloads):
        print("greedy outputs: raw == off == on, every row, every round"
              + (f", except {len(TIES)} that parted where the model's top two logits tie "
                 "(one step of its dtype; which one a batch picks is the order of a sum):\n"
                 + "\n".join(TIES) if TIES else ""))

    if args.bias_streams:
        summary["bias"] = bias_table(
            f"logit_bias {bias} on 1 of {args.bias_streams} greedy rows of {args.model}, "
            f"{budget[args.bias_streams]} tokens each, speculation off: decode tok/s, median "
            "(min-max); biased/unbiased: median (min-max) of per-round ratios", bias_runs)
    if cheap is not None:
        summary["bias_cheap_model"] = bias_table(
            f"the same on {args.bias_model} ({args.bias_model_tokens} tokens per row, next to "
            "no compute per token)", cheap_runs)
    print(f"\ncommand: {command}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": command, "started": started, "minutes": minutes, "engine_files": digest,
        "args": vars(args) | {"out": str(args.out)}, "summary": summary,
        "greedy_ties": TIES,
        "runs": {w: {str(n): {e: [asdict(x) for x in v] for e, v in by.items()}
                     for n, by in ws.items()} for w, ws in runs.items()},
        "bias_runs": {k: [asdict(x) for x in v] for k, v in bias_runs.items()},
        "bias_model_runs": {k: [asdict(x) for x in v] for k, v in cheap_runs.items()},
    }, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
