"""The serving driver that `overhead`, `ceiling`, `vs_mlx_server` and `settings_ab` are
presets of: a server target of the harness's table (`orchard_server`, or `command_server`
for `mlx_lm.server`) started, measured level by level, stopped, never two servers at once
(`serve_levels`). A preset picks its targets, levels and measure: here N workers in a
closed loop on the bare socket (`measure_http`), or the raw targets' engine driven in this
process (`raw_level`, `arrivals_level`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from load.harness.bare_client import Result, bounded
from load.harness.process_cpu import CpuSnapshot, process_tree, thread_seconds, threads_between
from load.harness.prompts import unique_prompt
from load.harness.servers import (HOST, PORT, Target, require_alive, running, start_server,
                                  stop_server, wait_port_free)
from load.harness.targets import RawModel

T = TypeVar("T")

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


@dataclass(frozen=True)
class Live:
    """A started server: where its clients connect (`target`), the processes that are its
    own (`pids()`, for CPU per token) and Orchard's `serve run` to check it is still ours."""

    target: Target
    pids: Callable[[], list[int]]
    proc: subprocess.Popen[bytes] | None = None

    def check(self) -> None:
        if self.proc is not None:
            require_alive(self.proc)


@dataclass(frozen=True)
class Server:
    """A server target of the harness's table and how to start it: `start()` is a context
    manager that yields it `Live` and stops it after."""

    label: str
    start: Callable[[], AbstractContextManager[Live]]


def orchard_server(label: str, source: str, model: str, *, connect: int = PORT,
                   wait: bool = False, **config: Any) -> Server:
    """Orchard (`servers.start_server` with `config`), its clients on port `connect` (the
    replica's own, or Serve's proxy one above); `wait`: wait out someone else's server on
    the port first."""
    @contextlib.contextmanager
    def start() -> Iterator[Live]:
        if wait:
            wait_port_free(config.get("port", PORT))
        proc = start_server(source, model, **config)
        try:
            live = Live(Target(label, f"http://{HOST}:{connect}", model),
                        lambda: process_tree(proc.pid), proc)
            yield live
            live.check()
        finally:
            stop_server(proc)

    return Server(label, start)


def command_server(target: Target, command: list[str], log: Path) -> Server:
    """A server `command` starts (`mlx_lm.server`, or a `serve run` of a config written for
    the run), through `servers.running`; its processes are this process's tree less itself."""
    @contextlib.contextmanager
    def start() -> Iterator[Live]:
        me = os.getpid()
        with running(target, command, log):
            yield Live(target, lambda: [p for p in process_tree(me) if p != me])

    return Server(target.label, start)


def serve_levels(server: Server, levels: Sequence[int], measure: Callable[[Live, int], T],
                 before: Callable[[Live], object] | None = None) -> dict[int, T]:
    """The driver: `server` started, `before` run on it (a warm-up, or a preset's own phase),
    measured at each level (checked still ours after each), stopped; never two servers at
    once."""
    with server.start() as live:
        if before is not None:
            before(live)
        runs: dict[int, T] = {}
        for n in levels:
            runs[n] = measure(live, n)
            live.check()
        return runs


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


def measure_http(live: Live, streams: int, args: argparse.Namespace, bias: dict[str, float],
                 tag: str) -> LevelRun:
    """A warm-up request, then the timed waves, with the CPU of the server's processes
    (`live.pids()`) and of this process over the timed part only."""
    port, model, pids = live.target.port, live.target.model, live.pids
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
