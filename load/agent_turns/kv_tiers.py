"""TTFT of a turn whose history is in the prefix cache's memory tier, on its disk tier (a
restarted replica), on another replica (pulled over Ray's object store), or nowhere.

    python -m load.agent_turns.kv_tiers [--source builtin:tiny] [--tokens 8192 30000] [--runs 3]

Each run salts a history of about `--tokens` tokens (so no run reuses another's KV) and
sends it as a chat with `max_tokens` 1 to a `ModelReplica` (no HTTP) whose disk tier is a
fresh directory: first cold (nowhere: the whole prompt is prefilled), then again (memory),
then to a second replica started on the same directory after the first shut down and wrote
its cache there (disk). For the remote tier two replicas run in Ray actors of their own
(two processes, a private local Ray on 127.0.0.1): one serves the history, the other is
sent the turn and pulls the KV from the first (`load/harness/remote.py`). TTFT is from the
request to its first event, the pull included. Prints each tier's median TTFT with its
range, the cached tokens each tier served, the ratio of cold to each tier (the median of
the runs' ratios), and the pull's bytes and rate (bytes over the remote turn's TTFT).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
from pathlib import Path

import ray

from load.harness.prompts import history
from load.harness.remote import remote_turn, timed_turn
from load.harness.stats import at_least_three, spread
from replicas.engine.config import EngineConfig
from replicas.replica import ModelReplica, ReplicaOptions

TIERS = ("nowhere", "memory", "disk", "remote")


def replica(source: str, directory: Path) -> ModelReplica:
    rep = ModelReplica(ReplicaOptions(model_id="m", source=source, engine=EngineConfig(
        disk_cache_dir=str(directory), prompt_cache_bytes=8 * 1024**3)))
    rep.start()
    return rep


def turn(rep: ModelReplica, text: str) -> tuple[float, int, int]:
    """(TTFT seconds, prompt tokens, cached tokens) of one greedy one-token turn."""
    return asyncio.run(timed_turn(rep, text))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--source", default="builtin:tiny")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 30000],
                        help="history lengths, about (the built-in tokenizer's count)")
    parser.add_argument("--runs", type=int, default=3)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    run_tiers(args.source, args.tokens, args.runs)


def run_tiers(source: str, lengths: list[int], runs: int) -> None:
    """Every tier's row for each history length (also `load/agent_turns/bench.py --tiers`)."""
    at_least_three(runs, "--runs")
    rng = random.Random(1234)
    root = str(Path(__file__).resolve().parents[2])  # the actors import this repository
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": root}})
    print(f"model {source}, {runs} runs per history length, max_tokens 1; TTFT "
          "medians (min-max)")
    print(f"{'tokens':>7}" + "".join(f"{t + ' TTFT ms':>24}" for t in TIERS)
          + f"{'cached mem/disk/remote':>24}" + "".join(f"{'nowhere/' + t:>16}"
                                                        for t in TIERS[1:])
          + f"{'pulled MiB':>12}{'MB/s':>8}")
    try:
        for tokens in lengths:
            tiers(source, tokens, runs, rng)
    finally:
        ray.shutdown()


def tiers(source: str, tokens: int, runs: int, rng: random.Random) -> None:
    """One row: every tier's TTFT for histories of about `tokens` tokens."""
    ttft: dict[str, list[float]] = {t: [] for t in TIERS}
    cached: dict[str, list[int]] = {t: [] for t in TIERS}
    prompts, pulled = [], []
    for _ in range(runs):
        text = history(tokens, rng)
        with tempfile.TemporaryDirectory() as directory:
            first = replica(source, Path(directory))
            try:
                for tier in ("nowhere", "memory"):
                    seconds, prompt, hit = turn(first, text)
                    ttft[tier].append(seconds)
                    cached[tier].append(hit)
            finally:
                first.shutdown()  # the memory tier goes to disk
            second = replica(source, Path(directory))
            try:
                seconds, prompt, hit = turn(second, text)
                ttft["disk"].append(seconds)
                cached["disk"].append(hit)
            finally:
                second.shutdown()
        seconds, prompt, hit, nbytes = remote_turn(source, text)
        ttft["remote"].append(seconds)
        cached["remote"].append(hit)
        pulled.append(nbytes)
        prompts.append(prompt)

    ratios = [statistics.median(n / v for n, v in zip(ttft["nowhere"], ttft[t]))
              for t in TIERS[1:]]
    rate = statistics.median(b / s for b, s in zip(pulled, ttft["remote"])) / 1e6
    print(f"{statistics.median(prompts):>7.0f}"
          + "".join(f"{spread(ttft[t]).text('.0f', 1000):>24}" for t in TIERS)
          + f"{'/'.join(f'{statistics.median(cached[t]):.0f}' for t in TIERS[1:]):>24}"
          + "".join(f"{r:>16.1f}" for r in ratios)
          + f"{statistics.median(pulled) / 2**20:>12.1f}{rate:>8.0f}")


if __name__ == "__main__":
    main()
