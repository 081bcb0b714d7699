"""The serving driver that `overhead`, `ceiling`, `vs_mlx_server` and `settings_ab` are
presets of: a target from the harness's table started (`orchard`, or `mlx_lm.server` through
`servers.running`), measured level by level, stopped, never two servers at once; a level is
a warm-up request, then N workers in a closed loop (`measure_http`), or the same engine
driven in this process (`raw_level`, `arrivals_level`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from load.harness.bare_client import Result, bounded
from load.harness.process_cpu import CpuSnapshot, thread_seconds, threads_between
from load.harness.prompts import unique_prompt
from load.harness.servers import PORT, require_alive, start_server, stop_server, wait_port_free
from load.harness.targets import RawModel

MODEL_ID = "ceiling"  # the name Orchard serves `builtin:ceiling` under in these presets


@dataclass
class LevelRun:
    """One target at one level in one round."""

    tokens: int
    seconds: float
    errors: int = 0
    requests: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    cpu_s: dict[str, float] = field(default_factory=dict)  # by process role, timed part only
    loadgen_cpu_s: float = 0.0  # this process during HTTP levels (it shares the cores)
    # The decoding process by thread (`process_cpu.thread_seconds`): raw's own, Orchard's
    # model replica's; the Python loop that drives the batch is raw's main thread and
    # Orchard's `orchard-engine`.
    threads_s: dict[str, float] = field(default_factory=dict)

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@contextlib.contextmanager
def orchard(source: str, model: str, *, wait: bool = False,
            **config: Any) -> Iterator[subprocess.Popen[bytes]]:
    """Orchard (`servers.start_server` with `config`) for the block, checked alive at its
    end and stopped after; `wait`: wait out someone else's server on the port first."""
    if wait:
        wait_port_free(PORT)
    proc = start_server(source, model, **config)
    try:
        yield proc
        require_alive(proc)
    finally:
        stop_server(proc)


async def waves(port: int, model: str, streams: int, args: argparse.Namespace,
                bias: dict[str, float], tag: str) -> tuple[float, list[Result]]:
    """N workers in a closed loop, `waves` requests each, so N stay in flight throughout."""
    results: list[Result] = []

    async def worker(w: int) -> None:
        for i in range(args.waves):
            results.append(await bounded(port, model, unique_prompt(f"{tag}-{w}-{i}"),
                                         args.tokens, bias, args.timeout))

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(streams)))
    return time.perf_counter() - start, results


def measure_http(port: int, model: str, pids: Callable[[], list[int]], streams: int,
                 args: argparse.Namespace, bias: dict[str, float], tag: str) -> LevelRun:
    """A warm-up request, then the timed waves, with the CPU of the server's processes
    (`pids()` lists them) and of this process over the timed part only."""
    async def level() -> tuple[CpuSnapshot, float, float, list[Result]]:
        await bounded(port, model, unique_prompt(f"{tag}-warmup"), 8, bias, args.timeout)
        before, cpu = CpuSnapshot.take(pids()), time.process_time()
        seconds, results = await waves(port, model, streams, args, bias, tag)
        return before, time.process_time() - cpu, seconds, results

    before, cpu, seconds, results = asyncio.run(level())
    after = CpuSnapshot.take(pids())
    spent = after.since(before)
    ok = [r for r in results if r.error is None]
    for r in results:
        if r.error:
            print(f"    error ({tag}): {r.error}", flush=True)
    return LevelRun(sum(r.tokens for r in ok), seconds, len(results) - len(ok), len(results),
                    [r.ttft * 1e3 for r in ok if r.ttft is not None], spent, cpu,
                    after.replica_threads_since(before))


def raw_level(raw: RawModel, streams: int, args: argparse.Namespace) -> LevelRun:
    """The raw target: `waves` batches of N sequences started and ended together."""
    raw.batched(8, streams)  # warm-up: this batch size's first steps
    cpu, threads = time.process_time(), thread_seconds(os.getpid())
    runs = [raw.batched(args.tokens, streams) for _ in range(args.waves)]
    cpu = time.process_time() - cpu
    return LevelRun(sum(r.count for r in runs), sum(r.seconds for r in runs), 0,
                    streams * args.waves, [], {"raw (this process)": cpu},
                    threads_s=threads_between(threads, thread_seconds(os.getpid())))


def arrivals_level(raw: RawModel, streams: int, args: argparse.Namespace,
                   tag: str) -> LevelRun:
    """The same engine fed as the servers are: as many requests as an HTTP level makes,
    each joining when one leaves (`RawModel.arrivals`), with unique prompts tokenized
    before the clock starts. What joining and leaving cost mlx-lm itself, without HTTP."""
    requests = streams * args.waves
    prompts = [raw.tokens(unique_prompt(f"{tag}-{i}")) for i in range(requests + streams)]
    cpu = time.process_time()
    run = raw.arrivals(args.tokens, streams, prompts)
    cpu = time.process_time() - cpu
    return LevelRun(run.count, run.seconds, 0, requests, [], {"raw (this process)": cpu})


def orchard_flush_ms() -> float:
    """Orchard's own default stream_flush_ms, read from the code so it cannot drift."""
    from replicas.options import ReplicaOptions

    return ReplicaOptions(model_id="", source="").flush_interval_s * 1000
