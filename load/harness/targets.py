"""The table of targets a serving benchmark measures, and the raw ones it drives itself.

raw and raw_arrivals run mlx-lm's `BatchGenerator` in this process (`RawModel`); orchard is
a `serve run` reached on its replica's own port as the shipped config's clients reach it,
orchard_proxy the same server through Serve's proxy one port above; mlx_server is
`mlx_lm.server` on the same model files (`servers.mlx_server`)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from load.harness.prompts import PROMPT
from load.harness.serve_settings import serve_settings
from load.harness.servers import (HOST, MAX_BATCH, MLX_PORT, ORCHARD_PORT, PORT,
                                  PREFILL_BATCH, Target)
from load.harness.stats import Run


@dataclass(frozen=True)
class TargetKind:
    name: str
    port: int | None  # None: in this process, no HTTP
    what: str


TARGETS: dict[str, TargetKind] = {t.name: t for t in (
    TargetKind("raw", None, "mlx-lm's BatchGenerator, all N sequences start and end together"),
    TargetKind("raw_arrivals", None, "the same engine, N in flight, each replaced the step it "
                                     "ends, as a closed loop of clients feeds a server"),
    TargetKind("orchard", PORT, "serve run of the shipped settings, its replica's own port"),
    TargetKind("orchard_proxy", PORT + 1, "the same server through Serve's proxy"),
    TargetKind("mlx_server", MLX_PORT, "mlx_lm.server on the same model files, as shipped"),
)}


class RawModel:
    """Raw mlx-lm on the same model files, loaded by the production loading code."""

    def __init__(self, source: str) -> None:
        from mlx_lm.sample_utils import make_sampler

        from replicas.sources import load_source as load_model

        self.loaded = load_model(source)
        self.prompt = self.tokens(PROMPT)
        self.sampler = make_sampler(temp=0.0)
        self.single(8)  # warm-up

    def tokens(self, text: str) -> list[int]:
        return list(self.loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True))

    def single(self, max_tokens: int, text: str = PROMPT) -> Run:
        """`mlx_lm.stream_generate`, one sequence: tokens, seconds and its TTFT."""
        import mlx_lm

        prompt = self.prompt if text == PROMPT else self.tokens(text)
        start = time.perf_counter()
        first = None
        n = 0
        for _ in mlx_lm.stream_generate(self.loaded.model, self.loaded.tokenizer, prompt,
                                        max_tokens=max_tokens, sampler=self.sampler):
            first = first or time.perf_counter() - start
            n += 1
        return Run(n, time.perf_counter() - start, [first or 0.0])

    def _generator(self, batch: int) -> Any:
        """mlx-lm's `BatchGenerator` with the servers' limits (8 prefilling at a time)."""
        from mlx_lm.generate import BatchGenerator

        return BatchGenerator(self.loaded.model, completion_batch_size=max(batch, 8),
                              prefill_batch_size=8)

    def batched(self, max_tokens: int, batch: int) -> Run:
        """The raw target: `batch` copies of the prompt, all started and ended together."""
        gen = self._generator(batch)
        start = time.perf_counter()
        gen.insert([list(self.prompt)] * batch, max_tokens=[max_tokens] * batch)
        n, live = 0, batch
        while live:
            _, responses = gen.next()
            for r in responses:
                n += 1
                live -= r.finish_reason is not None
        return Run(n, time.perf_counter() - start)

    def arrivals(self, max_tokens: int, batch: int, prompts: list[list[int]]) -> Run:
        """The raw_arrivals target: mlx-lm's `BatchGenerator` as a server drives it, `batch`
        sequences in flight, each replaced by the next of `prompts` (tokenized already) the
        step it ends, as a closed loop of clients would. The first `batch` end at staggered
        lengths, so rows join and leave one at a time as in a steady state; timed until the
        last prompt has joined."""
        gen = self._generator(batch)
        queue = iter(prompts)
        start = time.perf_counter()
        gen.insert([next(queue) for _ in range(batch)],
                   max_tokens=[max(1, max_tokens * (i + 1) // batch) for i in range(batch)])
        n, left = 0, len(prompts) - batch
        while left > 0:
            _, responses = gen.next()
            n += len(responses)
            for r in responses:
                if r.finish_reason is not None and left > 0:
                    gen.insert([next(queue)], max_tokens=[max_tokens])
                    left -= 1
        return Run(n, time.perf_counter() - start)


def orchard_replicas(source: str, replicas: int, workdir: Path) -> tuple[Target, list[str]]:
    """Orchard with `replicas` replicas of one model on `ORCHARD_PORT`, with mlx_lm.server's
    batching limits, as a command for `servers.running`."""
    config = {
        **serve_settings(ORCHARD_PORT),
        "applications": [{
            "name": "orchard", "route_prefix": "/", "import_path": "deployments.app:build_app",
            "args": {"models": [{
                "id": "bench", "source": source, "num_replicas": replicas, "max_ongoing_requests": 64,
                "engine": {"max_batch_size": MAX_BATCH, "prefill_batch_size": PREFILL_BATCH},
            }]},
        }],
    }
    path = workdir / f"orchard_x{replicas}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    serve = Path(sys.executable).with_name("serve")
    return Target(f"orchard x{replicas}", f"http://{HOST}:{ORCHARD_PORT}", "bench"), [str(serve), "run", str(path)]
