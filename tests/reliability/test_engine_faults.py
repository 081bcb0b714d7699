"""Engine faults with the real tiny model, without Ray: one request's failure stays its own,
and a dead or stuck engine fails requests at once and fails its health check."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any, Callable, Iterator

import mlx.core as mx
import pytest

import replicas.engine.scheduling as scheduling_module
import replicas.engine.core as core_module
from deployments.model_deployment import ModelDeployment
from replicas.builtin import script
from replicas.contract import (
    Channel,
    ChatMessage,
    ChatPrompt,
    ErrorKind,
    Failed,
    Finished,
    GenerationRequest,
    OutputEvent,
    SamplingParams,
    TextDelta,
)
from replicas.engine.config import EngineConfig
from replicas.engine.core import Engine, EngineDead
from replicas.replica import ModelReplica, ReplicaOptions
from tests.streams import collect

pytestmark = pytest.mark.reliability

MARK = 0.0123  # a presence penalty that marks the request a test sabotages
BYSTANDERS = ("cities", "planets", "hello")


@pytest.fixture
def replica() -> Iterator[ModelReplica]:
    """A fresh replica per test: some of these tests break it on purpose."""
    # mlx-lm decodes max(max_batch_size, prefill_batch_size) sequences at once: both are 4,
    # so a fifth request really waits for a slot.
    rep = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny",
                                      engine=EngineConfig(max_batch_size=4, prefill_batch_size=4,
                                                          stuck_after_s=0.3)))
    rep.start()
    yield rep
    rep.shutdown()


# A fail-fast path answers in milliseconds; broken, it waits on a dead or stuck thread for
# good. The bound is far above the milliseconds: CI's loaded box has stalled for a minute.
FAIL_FAST_S = 90.0


async def eventually(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll until `condition` holds: a generous deadline instead of a fixed sleep."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        await asyncio.sleep(0.01)


def healthy(replica: ModelReplica) -> bool:
    try:
        replica.check_health()
    except EngineDead:
        return False
    return True


def request(sid: str, rid: str, **sampling: Any) -> GenerationRequest:
    s = script(sid)
    prompt = ChatPrompt(tuple(ChatMessage(m.role, m.content) for m in s.messages))
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 400, **sampling})
    return GenerationRequest(request_id=rid, model="tiny", prompt=prompt, sampling=params)


def endless(replica: ModelReplica, rid: str, **sampling: Any) -> GenerationRequest:
    bias = {t: -1e4 for t in replica.model.eos_token_ids}
    return request("hello", rid, max_tokens=3000, logit_bias=bias, **sampling)


def answer(events: list[OutputEvent]) -> str:
    return "".join(e.text for e in events
                   if isinstance(e, TextDelta) and e.channel is Channel.ANSWER)


def run_with_victim(replica: ModelReplica, victim: GenerationRequest) -> list[OutputEvent]:
    """Run the victim alongside scripted bystanders; they must all be reproduced exactly."""

    async def together() -> list[list[OutputEvent]]:
        requests = [victim] + [request(sid, f"by-{sid}") for sid in BYSTANDERS]
        return await asyncio.gather(*(collect(replica.stream(r)) for r in requests))

    results = asyncio.run(together())
    for sid, events in zip(BYSTANDERS, results[1:]):
        assert answer(events) == script(sid).answer and isinstance(events[-1], Finished)
    assert replica.stats().active == 0
    return results[0]


class Sabotage:
    """A logits processor that misbehaves on its `after`-th call."""

    def __init__(self, how: str, after: int = 3) -> None:
        self.how, self.after, self.calls = how, after, 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self.calls += 1
        if self.calls < self.after:
            return logits
        if self.how == "raise":
            raise RuntimeError("penalty table corrupt")
        return logits[:, :10]  # a wrong shape: would break the whole batch's concatenation


def sabotage_marked(monkeypatch: pytest.MonkeyPatch, make: Callable[[], Any]) -> None:
    """The marked request's row gets one more processor of its own, after the pipeline's."""
    real = core_module.row_for

    def row_for(request: Any, eos: frozenset[int]) -> Any:
        if request.sampling.presence_penalty == MARK:
            request = dataclasses.replace(
                request, logits_processors=(*request.logits_processors, make()))
        return real(request, eos)

    monkeypatch.setattr(core_module, "row_for", row_for)


@pytest.mark.parametrize("how", ["raise", "shape"])
def test_a_failing_logits_processor_fails_only_its_request(
    replica: ModelReplica, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    sabotage_marked(monkeypatch, lambda: Sabotage(how))
    events = run_with_victim(replica, request("ocean-prose", "victim", presence_penalty=MARK))
    assert events[-1] == Failed(ErrorKind.INTERNAL, "generation failed for this request")


def test_a_sampler_that_cannot_be_built_fails_only_its_request(
    replica: ModelReplica, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = scheduling_module.make_request_sampler

    def sampler(params: SamplingParams, *args: Any) -> Any:
        if params.presence_penalty == MARK:
            raise OverflowError("seed out of range")
        return real(params, *args)

    monkeypatch.setattr(scheduling_module, "make_request_sampler", sampler)
    events = run_with_victim(replica, request("ocean-prose", "victim", presence_penalty=MARK))
    assert [type(e) for e in events] == [Failed]


def test_a_failing_output_pipeline_fails_only_its_request(
    replica: ModelReplica, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = Engine._generated

    def generated(self: Engine, active: Any, *args: Any) -> Any:
        if active.sub.request_id == "victim":  # as the request's output processor raising
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "broken detokenizer")
        return real(self, active, *args)

    monkeypatch.setattr(Engine, "_generated", generated)
    events = run_with_victim(replica, request("ocean-prose", "victim"))
    assert isinstance(events[-1], Failed)


def test_any_integer_seed_is_accepted(replica: ModelReplica) -> None:
    for seed in (-1, 2**64, -(2**63)):
        events = asyncio.run(collect(replica.stream(
            request("hello", f"seed{seed}", temperature=1.0, seed=seed, max_tokens=8))))
        assert isinstance(events[-1], Finished), events[-1]


def test_a_dead_engine_thread_fails_everything_at_once(replica: ModelReplica) -> None:
    def boom(block: bool) -> Any:
        raise RuntimeError("engine bug")

    async def scenario() -> None:
        running = replica.stream(endless(replica, "in-flight"))
        assert isinstance((await running.__anext__())[0], TextDelta)
        replica._engine._take_commands = boom  # type: ignore[method-assign]
        rest = await asyncio.wait_for(collect(running), FAIL_FAST_S)
        assert isinstance(rest[-1], Failed)
        with pytest.raises(EngineDead):
            replica.check_health()
        # Broken, it would wait forever on a thread that is gone: a deadline, not a stopwatch.
        later = await asyncio.wait_for(collect(replica.stream(request("hello", "later"))),
                                       FAIL_FAST_S)
        # The replica's fault, not the request's: a two-hop client resumes it elsewhere.
        assert later == [Failed(ErrorKind.INTERNAL,
                                "the model is unavailable: the model engine stopped",
                                replica_fault=True)]

    asyncio.run(scenario())


def test_a_stuck_engine_fails_its_health_check_and_new_requests_fail_fast(
    replica: ModelReplica, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = threading.Event(), threading.Event()

    def blocking() -> Callable[[mx.array, mx.array], mx.array]:
        def block(tokens: mx.array, logits: mx.array) -> mx.array:
            entered.set()
            release.wait(2 * FAIL_FAST_S)  # past the bound below, so a queued call fails it
            return logits
        return block

    sabotage_marked(monkeypatch, blocking)

    async def scenario() -> None:
        stuck = asyncio.ensure_future(collect(replica.stream(
            request("hello", "stuck", presence_penalty=MARK))))
        assert await asyncio.to_thread(entered.wait, FAIL_FAST_S)
        await eventually(lambda: not healthy(replica), "the health check to see the stall")
        with pytest.raises(EngineDead, match="stuck"):
            replica.check_health()
        # Broken, it would queue behind the stall (2 x FAIL_FAST_S): the bound is short of it.
        refused = await asyncio.wait_for(collect(replica.stream(request("hello", "new"))),
                                         FAIL_FAST_S)
        assert [type(e) for e in refused] == [Failed]
        release.set()  # it comes unstuck: health and service return
        assert isinstance((await asyncio.wait_for(stuck, FAIL_FAST_S))[-1], Finished)
        replica.check_health()
        ok = await collect(replica.stream(request("hello", "after")))
        assert answer(ok) == script("hello").answer

    asyncio.run(scenario())


def test_a_request_cancelled_while_waiting_for_a_batch_slot_never_decodes(
    replica: ModelReplica,
) -> None:
    async def scenario() -> None:
        runners = [replica.stream(endless(replica, f"run{i}")) for i in range(4)]
        for runner in runners:  # the batch (max_batch_size 4) is full
            await runner.__anext__()
        seen: list[OutputEvent] = []

        async def consume() -> None:
            async for batch in replica.stream(endless(replica, "waiting")):
                seen.extend(batch)

        waiting = asyncio.ensure_future(consume())
        await eventually(lambda: replica.stats().active == 5, "the fifth request to queue")
        # Its own pipeline counts every token the batch gives it (engine internals: the
        # contract has no per-request counter before the request finishes).
        decoder = replica._engine._by_rid["waiting"].sub.output.decoder  # type: ignore[attr-defined]
        runner_decoder = replica._engine._by_rid["run0"].sub.output.decoder  # type: ignore[attr-defined]
        steps, runner_tokens = replica.stats().steps, runner_decoder.completion_tokens
        await eventually(lambda: replica.stats().steps >= steps + 5, "the batch to decode on")
        assert not waiting.done()
        waiting.cancel()  # what a client leaving does to its stream
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await eventually(lambda: replica.stats().active == 4, "the cancel to free the queue")
        # The batch decoded meanwhile (the counter works), the queued request not one token.
        assert runner_decoder.completion_tokens >= runner_tokens + 5
        assert decoder.completion_tokens == 0 and seen == [], seen
        for runner in runners:
            await runner.aclose()  # type: ignore[attr-defined]  # an async generator

    asyncio.run(scenario())


def test_the_deployment_health_check_fails_when_the_engine_dies() -> None:
    cls = ModelDeployment.func_or_class  # type: ignore[attr-defined]  # the class Serve runs
    deployment = cls({"id": "tiny", "source": "builtin:tiny"})
    try:
        deployment.check_health()
        engine = deployment._replica._engine

        def boom(block: bool) -> Any:
            raise RuntimeError("engine bug")

        engine._take_commands = boom  # type: ignore[method-assign]
        engine.cancel("wake")  # the idle thread wakes, loops, and dies
        engine._thread.join(5)
        with pytest.raises(EngineDead):
            deployment.check_health()  # Serve replaces a replica whose check raises
    finally:
        deployment._replica.shutdown()


class _Unrecoverable:
    """A batch that, like a sharded one, cannot start over after a failed step; it fails
    a step on demand and records every call it gets after that."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.fail = threading.Event()
        self.after_failure: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr) or name == "recover":
            return attr
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.fail.is_set() and name != "step":
                self.after_failure.append(name)
            return attr(*args, **kwargs)
        return call

    def step(self) -> Any:
        if self.fail.is_set():
            raise RuntimeError("a collective failed on rank 0 only")
        return self._inner.step()

    def recover(self) -> bool:
        return False


def test_a_failed_step_on_a_batch_that_cannot_start_over_stops_the_replica_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sharded batch's failed step (here injected on this rank only) is never followed
    by a reset or any other batch call, which would send collectives into a group whose
    other ranks may be mid-step: the engine stops, every request hears it is the replica's
    fault (so the client resumes it elsewhere), and the health check fails."""
    batches: list[_Unrecoverable] = []
    real_open = ModelReplica._open

    def opened(self: ModelReplica) -> Any:
        model, batch, memory = real_open(self)
        batches.append(_Unrecoverable(batch))
        return model, batches[-1], memory

    monkeypatch.setattr(ModelReplica, "_open", opened)
    rep = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny"))
    rep.start()
    try:
        async def scenario() -> None:
            running = rep.stream(endless(rep, "in-flight"))
            assert isinstance((await running.__anext__())[0], TextDelta)
            batches[0].fail.set()
            rest = await asyncio.wait_for(collect(running), FAIL_FAST_S)
            failed = rest[-1]
            assert isinstance(failed, Failed) and failed.replica_fault, failed
            assert "a collective failed" not in failed.message  # no internals to clients
            with pytest.raises(EngineDead):
                rep.check_health()
            later = await asyncio.wait_for(collect(rep.stream(request("hello", "later"))),
                                           FAIL_FAST_S)
            assert isinstance(later[-1], Failed) and later[-1].replica_fault

        asyncio.run(scenario())
        assert batches[0].after_failure == []  # no reset, no close, no collective after it
    finally:
        rep.shutdown()


def test_time_spent_idle_is_no_stuck_step(replica: ModelReplica) -> None:
    """A replica idle past `stuck_after_s` (0.3 s here) is not "stuck" when work arrives:
    the step clock starts when the engine takes the work, not when it began to wait for
    it (else the health check, and every submission, failed during its first step)."""
    time.sleep(1.0)
    healthy_throughout: list[bool] = []

    async def scenario() -> list[object]:
        async def watch() -> None:
            while True:
                healthy_throughout.append(healthy(replica))
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        try:
            return await collect(replica.stream(request("cities", "after-idle", max_tokens=40)))
        finally:
            watcher.cancel()

    events = asyncio.run(scenario())
    assert isinstance(events[-1], Finished), events[-1]
    assert healthy_throughout and all(healthy_throughout)


def test_a_failed_insert_starts_the_batch_over_and_the_engine_runs_on(
    replica: ModelReplica, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mlx-lm's insert raising (as a failed step would) fails the requests it held and the
    one joining, then the batch starts over: the engine thread lives, and serves the next."""
    batch = replica._engine._batch
    assert batch is not None
    real_insert = batch.insert
    fail = threading.Event()

    def insert(rows: Any) -> Any:
        if fail.is_set():
            fail.clear()
            raise RuntimeError("merging caches failed")
        return real_insert(rows)

    monkeypatch.setattr(batch, "insert", insert)

    async def scenario() -> None:
        running = replica.stream(endless(replica, "in-flight"))
        assert isinstance((await running.__anext__())[0], TextDelta)
        fail.set()
        joining = await asyncio.wait_for(collect(replica.stream(request("hello", "joining"))),
                                         FAIL_FAST_S)
        rest = await asyncio.wait_for(collect(running), FAIL_FAST_S)
        for events in (joining, rest):
            assert isinstance(events[-1], Failed) and "RuntimeError" in events[-1].message
        assert healthy(replica)
        later = await asyncio.wait_for(collect(replica.stream(request("hello", "later"))),
                                       60)
        assert answer(later) == script("hello").answer

    asyncio.run(scenario())
    assert replica.stats().active == 0
