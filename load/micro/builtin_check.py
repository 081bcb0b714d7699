"""The built-in model's check (replicas/builtin/verify.py), pass by pass, against decoding
each script alone one token at a time (mlx-lm's `generate_step`, as the check did before).

    python -m load.micro.builtin_check --rounds 3

On the built `builtin:tiny` (built first if missing), every script in every rendering:
- `per-token`: greedy decoding of each alone with `generate_step` (the former single pass);
- `forced`: the teacher-forced pass that replaced it (`forced_argmax`);
- `batched`: the padded batch through `BatchGenerator` (unchanged);
- `check`: `verify_model_dir` as a build runs it (on a CPU the two passes on two threads).
Wall and CPU seconds (this process's, all threads) per round; medians with their spread and
ratios against the former check (per-token + batched, one after the other), in the same
run. CPU seconds hold on a loaded machine where wall seconds do not.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step

from replicas.builtin import ensure_builtin, load_scripts
from replicas.builtin.build import _examples
from replicas.builtin.verify import forced_argmax, generate_batched, verify_model_dir


def _timed(work: Callable[[], object]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    work()
    return time.perf_counter() - wall, time.process_time() - cpu


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    path = ensure_builtin("tiny")
    model, tokenizer = mlx_lm.load(str(path))[:2]
    eos = set(tokenizer.eos_token_ids)
    examples = _examples(path, load_scripts(), min(eos))
    max_tokens = max(len(e.completion) for e in examples) + 8

    def per_token() -> None:
        for e in examples:
            tokens: list[int] = []
            for token, _ in generate_step(mx.array(list(e.prompt)), model, max_tokens=max_tokens):
                tokens.append(int(token))
                if tokens[-1] in eos:
                    break
            assert tokens == list(e.completion), e.script_id

    def forced() -> None:
        for e in examples:
            assert forced_argmax(model, e.prompt, e.completion) == list(e.completion)

    def batched() -> None:
        generate_batched(model, [e.prompt for e in examples], max_tokens, eos)

    parts: dict[str, Callable[[], object]] = {
        "per-token": per_token, "forced": forced, "batched": batched,
        "check": lambda: verify_model_dir(path, examples)}
    print(f"{len(examples)} scripts, {sum(len(e.prompt) for e in examples)} prompt and "
          f"{sum(len(e.completion) for e in examples)} completion tokens; "
          f"device {mx.default_device()}", flush=True)
    seen: dict[str, list[tuple[float, float]]] = {name: [] for name in parts}
    for round_ in range(args.rounds):
        for name, work in parts.items():
            seen[name].append(_timed(work))
        print(f"round {round_ + 1}: " + ", ".join(
            f"{n} {seen[n][-1][0]:.2f}s wall / {seen[n][-1][1]:.2f}s cpu" for n in parts),
            flush=True)
    former_wall = [p[0] + b[0] for p, b in zip(seen["per-token"], seen["batched"])]
    former_cpu = [p[1] + b[1] for p, b in zip(seen["per-token"], seen["batched"])]

    def summary(values: list[float]) -> str:
        return f"{statistics.median(values):.2f}s ({min(values):.2f}-{max(values):.2f})"

    print("\nmedian (spread) over rounds:")
    for name in parts:
        wall = [w for w, _ in seen[name]]
        cpu = [c for _, c in seen[name]]
        print(f"  {name:9} wall {summary(wall)}  cpu {summary(cpu)}")
    print(f"  former    wall {summary(former_wall)}  cpu {summary(former_cpu)}"
          "  (per-token + batched)")
    check_wall = statistics.median(w for w, _ in seen["check"])
    check_cpu = statistics.median(c for _, c in seen["check"])
    print(f"check / former: wall {check_wall / statistics.median(former_wall):.2f}, "
          f"cpu {check_cpu / statistics.median(former_cpu):.2f}")


if __name__ == "__main__":
    main()
