"""A small KV budget against an ample one for short chats that fit in it (issue 58), in
process, no HTTP.

    python -m load.micro.small_budget [--rounds 3] [--budget-mib 96] [--chats 15]

The model is a Qwen3 shape with wide KV (8 KV heads of 128 in 4 float32 layers: 32 KiB a
token) and `builtin:tiny`'s tokenizer, random weights, built in a temporary directory: its
15 short chats (29 prompt tokens, 32 new) hold 14-29 MiB of KV between them. Four replicas live in this process
together (padded and paged, each under `--budget-mib` and under an ample 1 GiB; the prefix
cache off), and each round sends the chats to each of them at once, in alternating order.

Per replica: the last first token's time, the process's CPU seconds for the round, the
engine steps the round took and the most requests that waited for KV memory; and per
batch kind the small/ample ratio of the time and of the CPU (median of the rounds' ratios,
min-max). All four share MLX's one memory limit, which must cover every one of them
(`replicas.engine.kv.budget.process_limit`). Last, the paged small-budget replica again,
with MLX's limit as it was before that (the last replica planned set its own: here the
small one's, below what the ample replicas' pool holds) against the process's, alternating:
MLX waits on every evaluation while active memory is past its limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from load.harness.stats import Spread, at_least_three, spread

MIB = 2**20
AMPLE = 1024 * MIB


def wide_kv_model(out: Path) -> Path:
    """The wide-KV Qwen3 shape, random weights (seeded), `builtin:tiny`'s tokenizer."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3

    from replicas.builtin import ensure_builtin

    tiny = ensure_builtin("tiny")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / name, out / name)
    config = json.loads((tiny / "config.json").read_text())
    config.update(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                  head_dim=128, intermediate_size=256)
    (out / "config.json").write_text(json.dumps(config))
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    mx.random.seed(7)
    model.update(nn.utils.tree_map(lambda a: mx.random.normal(a.shape) * 0.05
                                   if isinstance(a, mx.array) else a, model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out


def _chat(i: int, round_: int) -> Any:
    from replicas.contract import ChatMessage, ChatPrompt, GenerationRequest, SamplingParams

    return GenerationRequest(
        request_id=f"chat-{round_}-{i}", model="wide",
        prompt=ChatPrompt((ChatMessage("user", f"Hello there number {i}, tell me a short "
                                               f"story {round_}."),)),
        sampling=SamplingParams(temperature=0.0, max_tokens=32))


async def _first_token(rep: Any, request: Any) -> float:
    started, first = time.perf_counter(), None
    async for batch in rep.stream(request):
        if first is None and batch:
            first = time.perf_counter() - started
    return first if first is not None else float("nan")


async def _round(rep: Any, chats: int, round_: int, peaks: Counter[str]) -> float:
    from load.harness.replica import watched

    work = asyncio.gather(*(_first_token(rep, _chat(i, round_)) for i in range(chats)))
    return max(await watched(rep, work, peaks))


def main() -> None:
    args = build_parser().parse_args()
    at_least_three(args.rounds, "--rounds")
    from replicas.engine.config import EngineConfig
    from replicas.replica import ModelReplica, ReplicaOptions

    tmp = Path(tempfile.mkdtemp(prefix="small-budget-"))
    try:
        source = str(wide_kv_model(tmp / "wide"))
        small = args.budget_mib * MIB
        reps: dict[tuple[str, int], Any] = {}
        for mode in ("off", "on"):
            for budget in (AMPLE, small):
                config = EngineConfig(kv_budget_bytes=budget, prompt_cache_bytes=0,
                                      paged_kv=mode)  # type: ignore[arg-type]
                rep = ModelReplica(ReplicaOptions(model_id="wide", source=source,
                                                  engine=config))
                rep.start()
                reps[mode, budget] = rep
        per_token = next(iter(reps.values()))._engine.kv_budget.layout.per_token
        print(f"wide-KV Qwen3 shape: {per_token} KV bytes a token; {args.chats} chats; "
              f"small {args.budget_mib} MiB against ample {AMPLE // MIB} MiB", flush=True)
        got: dict[tuple[str, int], list[tuple[float, float, int, int]]] = \
            {key: [] for key in reps}
        for r in range(args.rounds):
            for key in (list(reps) if r % 2 == 0 else list(reversed(reps))):
                rep, peaks = reps[key], Counter[str]()
                steps, cpu = rep.stats().steps, time.process_time()
                ttft = asyncio.run(_round(rep, args.chats, r, peaks))
                got[key].append((ttft, time.process_time() - cpu,
                                 rep.stats().steps - steps, peaks["waiting"]))
        _report(got, small, args.budget_mib)
        _as_before(reps["on", small], args.chats, args.rounds)
        for rep in reps.values():
            rep.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _report(got: dict[tuple[str, int], list[tuple[float, float, int, int]]], small: int,
            budget_mib: int) -> None:
    for (mode, budget), runs in got.items():
        name = f"{'paged' if mode == 'on' else 'padded'} {budget // MIB} MiB"
        first, used = spread(r[0] for r in runs), spread(r[1] for r in runs)
        print(f"{name:<18} last first token {first.text('.2f')} s, CPU {used.text('.2f')} s, "
              f"steps {sorted({r[2] for r in runs})}, waited for memory "
              f"{max(r[3] for r in runs)}", flush=True)
    for mode in ("off", "on"):
        pairs = list(zip(got[mode, small], got[mode, AMPLE]))
        ttft: Spread = spread(s[0] / a[0] for s, a in pairs)
        cpu: Spread = spread(s[1] / a[1] for s, a in pairs)
        print(f"{'paged' if mode == 'on' else 'padded'}: {budget_mib} MiB / ample: last first "
              f"token {ttft.text('.2f')}, CPU {cpu.text('.2f')}", flush=True)


def _as_before(rep: Any, chats: int, rounds: int) -> None:
    """The paged small-budget replica's CPU a round under its own limit (as before
    `process_limit`) over the process's, alternating."""
    import mlx.core as mx

    process, own = mx.get_memory_limit(), rep._engine.kv_budget.ranks[0].limit
    cpu: dict[int, list[float]] = {process: [], own: []}
    try:
        for r in range(rounds):
            for limit in ((own, process) if r % 2 == 0 else (process, own)):
                mx.set_memory_limit(limit)
                started = time.process_time()
                asyncio.run(_round(rep, chats, 100 + r, Counter()))
                cpu[limit].append(time.process_time() - started)
    finally:
        mx.set_memory_limit(process)
    ratio = spread(a / b for a, b in zip(cpu[own], cpu[process]))
    print(f"paged small budget, MLX limit as before ({own // MIB} MiB) / the process's "
          f"({process // MIB} MiB, active {mx.get_active_memory() // MIB} MiB): CPU "
          f"{ratio.text('.2f')} ({spread(cpu[own]).text('.2f')} s against "
          f"{spread(cpu[process]).text('.2f')} s)", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-mib", type=int, default=96, help="the small budget")
    parser.add_argument("--chats", type=int, default=15, help="short chats sent at once")
    return parser


if __name__ == "__main__":
    main()
