"""The engine thread: the sole owner of MLX in a replica.

It drives the batch (`replicas.engine.batch`: mlx-lm's BatchGenerator with continuous batching,
requests join and leave between steps, and the KV prefix cache), feeds each generated token through that request's output pipeline, and hands
events back to asyncio through the sinks' event loops. Commands (submit, cancel) arrive on
a thread-safe queue and are applied between steps, so a cancel frees its slot before the
next decode step.

Faults stay as small as they can: a request whose own processing raises (its sampler, its
logits processors, its output pipeline) fails alone while the batch runs on; a failed batch
step fails that batch; if the thread itself dies, every queued and in-flight request fails
at once and later submissions raise, so nothing waits on a thread that is gone.

Prefix reuse: a request joins the batch with the KV of the longest cached prefix of its
prompt (`replicas.engine.prompt_cache`) and prefills the rest, kept at its last message boundary;
one that finishes normally leaves its prompt plus output behind for the next turn.

The engine does not know how many processes run the model: on a sharded replica the batch
it is handed keeps the other ranks in lockstep (`replicas.engine.lockstep`).
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from replicas.engine.batch import Batch, Done, EngineConfig, Row
from replicas.engine.delivery import EventSink, Submission, deliver
from replicas.contract import ErrorKind, Failed, FinishReason, OutputEvent, TextDelta
from replicas.engine.loading import LoadedModel
from replicas.engine.logprobs import Asked, Picked, pick
from replicas.engine.stats import EngineStats
from replicas.errors import ReplicaError
from replicas.engine.memory import KvBudget, open_budget
from replicas.engine.scoring import echo_delta
from replicas.engine.sampling import (
    GuardedProcessors,
    LogitsProcessor,
    guarded_processors,
    make_request_sampler,
)

log = logging.getLogger(__name__)


@dataclass
class _Active:
    uid: int
    sub: Submission
    guard: GuardedProcessors | None
    reserved: int  # KV bytes admission set aside for it
    cached: int  # prompt tokens the prefix cache served, for its usage


@dataclass(frozen=True)
class _Cancel:
    request_id: str
    step: int  # the engine step when the cancel was asked for


# What the engine thread is told; None only wakes it (to see `_stopping`).
_Command = Submission | _Cancel | None


@dataclass
class _Commands:
    submits: list[Submission] = field(default_factory=list)
    cancels: dict[str, int] = field(default_factory=dict)  # request id -> step seen


class EngineDead(RuntimeError):
    pass


# What a client is told when its request failed inside the engine; the log has the details.
_REQUEST_FAILED = "generation failed for this request"
_MEMORY_FULL = "this replica's KV memory is taken and too many requests wait for it; retry later"


# Opens the model and the batch that runs it, on the engine thread: a `LocalBatch`, or on a
# sharded replica's rank 0 a `LockstepBatch` that the other ranks follow.
Opener = Callable[[], tuple[LoadedModel, Batch]]
# Called after every batch step with its duration and the rows that got a token (metrics).
StepCallback = Callable[[float, int], None]


class Engine:
    def __init__(self, opener: Opener, config: EngineConfig,
                 on_step: StepCallback | None = None) -> None:
        self._opener = opener
        self._config = config
        self._on_step = on_step
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._loaded: LoadedModel | None = None
        self._by_uid: dict[int, _Active] = {}
        self._by_rid: dict[str, _Active] = {}
        self._steps = 0
        self._finished = 0
        self._submitted = 0
        # Set once, when the thread ends; guarded by `_lock` together with the command queue,
        # so a submission is either taken by the thread or failed by its death, never lost.
        self._dead: str | None = None
        self._lock = threading.Lock()
        self._cancel_latency: deque[int] = deque(maxlen=256)
        self._heartbeat = time.monotonic()
        self._stopping = False
        self._batch: Batch | None = None
        self._kv: KvBudget | None = None
        self._waiting: deque[Submission] = deque()  # admitted by Serve, waiting for memory
        self._thread = threading.Thread(target=self._run, name="orchard-engine", daemon=True)

    # ---- asyncio side -------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> LoadedModel:
        if not self._ready.wait(timeout):
            raise TimeoutError("the engine did not load its model in time")
        if self._load_error is not None or self._loaded is None:
            raise EngineDead(f"model failed to load: {self._load_error}") from self._load_error
        return self._loaded

    def submit(self, sub: Submission) -> None:
        """Queue a request for the batch; raises `EngineDead` if the engine cannot run it."""
        with self._lock:
            self.check_health()
            self._commands.put(sub)

    def cancel(self, request_id: str) -> None:
        self._commands.put(_Cancel(request_id, self._steps))

    def shutdown(self) -> None:
        self._stopping = True
        self._commands.put(None)
        self._thread.join(timeout=10)

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDead(self._dead)
        if self.stalled_for() > self._config.stuck_after_s:
            raise EngineDead(f"engine step stuck for over {self._config.stuck_after_s:g}s")

    def abort(self, reason: str) -> None:
        """Fail everything queued and in flight now, from any thread, and refuse new work.

        For a fault the engine thread cannot see itself: it may be blocked for good inside
        a collective whose peer (another rank of a sharded replica) is gone."""
        if not self._ready.is_set():  # still loading: `wait_ready` raises at once
            self._load_error = RuntimeError(reason)
            self._ready.set()
        self._die(reason)

    def stalled_for(self) -> float:
        """Seconds the current batch step has run, while requests are in it; else 0."""
        return time.monotonic() - self._heartbeat if self._by_uid else 0.0

    def stats(self) -> EngineStats:
        cache = self._batch.cache.stats() if self._batch and self._batch.cache else None
        memory = self._kv.stats(len(self._waiting)) if self._kv is not None else None
        return EngineStats(
            active=len(self._by_uid),
            waiting=self._commands.qsize(),
            steps=self._steps,
            finished=self._finished,
            submitted=self._submitted,
            cancel_latency_steps=tuple(self._cancel_latency),
            memory=memory,
            **({} if cache is None else cache.engine_fields()),
        )

    # ---- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loaded, self._batch = self._opener()
            self._kv = open_budget(self._loaded.model, self._loaded.config,
                                   self._config.kv_budget_bytes,
                                   self._config.max_memory_waiting)
        except BaseException as exc:  # noqa: BLE001 - reported through wait_ready
            log.exception("model load failed")
            self._load_error = exc
            self._die("the model failed to load")
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stopping:
                self._heartbeat = time.monotonic()
                self._apply(self._take_commands(block=not self._by_uid and not self._waiting))
                if self._by_uid:
                    self._step()
        except BaseException:  # noqa: BLE001 - the thread ends here either way
            log.exception("the engine thread died")
            self._die("the model engine stopped")
            return
        self._die("the replica is shutting down")
        if self._batch is not None:
            self._batch.close()

    def _die(self, reason: str) -> None:
        """Refuse new work, then fail everything queued or in flight."""
        with self._lock:
            if self._dead is None:
                self._dead = reason
            queued: list[tuple[EventSink, list[OutputEvent]]] = []
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(command, Submission):
                    queued.append((command.sink, [Failed(ErrorKind.INTERNAL, reason)]))
            waiting, self._waiting = list(self._waiting), deque()
            queued += [(sub.sink, [Failed(ErrorKind.INTERNAL, reason)]) for sub in waiting]
            outbox = queued + self._fail_all_outbox(reason)
        deliver(outbox)

    @property
    def kv_budget(self) -> KvBudget:
        """The KV admission of the loaded model (after `wait_ready`)."""
        assert self._kv is not None
        return self._kv

    def _take_commands(self, block: bool) -> _Commands:
        commands = _Commands()
        try:
            item = self._commands.get(block=block)
            while True:
                if isinstance(item, Submission):
                    commands.submits.append(item)
                elif isinstance(item, _Cancel):
                    commands.cancels[item.request_id] = item.step
                item = self._commands.get_nowait()
        except queue.Empty:
            pass
        return commands

    def _apply(self, commands: _Commands) -> None:
        assert self._batch is not None
        # A request cancelled while still queued (or waiting for memory) never reaches the
        # batch; the rest join in order while their KV fits.
        pending = [s for s in (*self._waiting, *commands.submits)
                   if s.request_id not in commands.cancels]
        admitted, self._waiting = self._admit(pending)
        if admitted:
            self._insert(admitted)
        gone = [self._by_rid[r] for r in commands.cancels if r in self._by_rid]
        if gone:
            self._batch.finish([Done(a.uid, keep=False) for a in gone])
            for active in gone:
                self._forget(active)
                self._cancel_latency.append(self._steps - commands.cancels[active.sub.request_id])

    def _admit(self, pending: list[Submission]) -> tuple[list[Submission], deque[Submission]]:
        """Those whose KV fits now, in order; the rest wait; past the waiting bound the
        newest get the overloaded error."""
        assert self._kv is not None and self._batch is not None
        batch, cache = self._batch, self._batch.cache
        admitted, waiting, refused = self._kv.take(
            pending, lambda s: len(s.prompt_ids) + s.max_tokens,
            lambda: cache.nbytes if cache else 0, batch.evict_cache_to)
        for sub, reserved in admitted:
            sub.reserved = reserved
        deliver([(s.sink, [Failed(ErrorKind.OVERLOADED, _MEMORY_FULL)]) for s in refused])
        return [sub for sub, _ in admitted], waiting

    def _insert(self, subs: list[Submission]) -> None:
        assert self._loaded is not None and self._batch is not None
        eos = self._loaded.eos_token_ids
        ready: list[tuple[Submission, Row, GuardedProcessors | None]] = []
        failed: list[tuple[EventSink, list[OutputEvent]]] = []
        for sub in subs:
            try:  # a request whose sampling cannot be built fails alone
                if sub.echo is not None:
                    deliver([(sub.sink, [self._echo(sub)])])
                guard = _guarded(sub)
                row = Row(tuple(sub.prompt_ids), sub.boundary, sub.max_tokens,
                          eos | sub.stop_token_ids, make_request_sampler(sub.sampling),
                          (guard,) if guard else ())
                ready.append((sub, row, guard))
            except Exception:  # noqa: BLE001 - reported to that request
                log.exception("request %s: building its sampler failed", sub.request_id)
                failed.append((sub.sink, [Failed(ErrorKind.INTERNAL, _REQUEST_FAILED)]))
        deliver(failed)
        if not ready:
            return
        placed = self._batch.insert([row for _, row, _ in ready])
        for (uid, cached), (sub, _, guard) in zip(placed, ready):
            active = _Active(uid, sub, guard, sub.reserved, cached)
            self._by_uid[uid] = active
            self._by_rid[sub.request_id] = active
        self._submitted += len(ready)

    def _echo(self, sub: Submission) -> TextDelta:
        """The prompt's text, and its tokens' logprobs scored by one prefill if asked."""
        assert self._batch is not None and sub.echo is not None
        trail = sub.logprobs
        picked = self._batch.score(sub.prompt_ids, trail.top) if trail is not None else None
        return echo_delta(sub.echo, sub.prompt_ids, picked, trail)

    def _step(self) -> None:
        assert self._batch is not None
        started = time.perf_counter()
        try:
            responses = self._batch.step()
        except Exception as exc:  # noqa: BLE001 - one bad step must not kill the replica
            log.exception("batch step failed; failing the batch and starting a fresh one")
            # A ReplicaError's message is written for clients; anything else shows its type.
            reason = exc.message if isinstance(exc, ReplicaError) else type(exc).__name__
            self._fail_all(f"generation failed: {reason}")
            self._batch.reset()
            return
        self._steps += 1
        if self._on_step is not None:
            self._on_step(time.perf_counter() - started, len(responses))
        outbox: list[tuple[EventSink, list[OutputEvent]]] = []
        done: list[Done] = []
        picked = self._logprobs(responses)
        for response in responses:
            active = self._by_uid.get(response.uid)
            if active is None:
                continue
            try:
                events, finished = self._on_token(active, response)
                if active.sub.logprobs is not None:
                    events = active.sub.logprobs.on_token(events, picked, response)
            except Exception:  # noqa: BLE001 - one request's pipeline must not stop the batch
                log.exception("request %s: output processing failed", active.sub.request_id)
                events, finished = [Failed(ErrorKind.INTERNAL, _REQUEST_FAILED)], True
            if events:
                outbox.append((active.sub.sink, events))
            if finished:
                self._forget(active)
                self._finished += 1
                ok = not any(isinstance(e, Failed) for e in events)
                done.append(Done(response.uid, keep=ok))
        if done:
            self._batch.finish(done)
        if self._kv is not None and (cache := self._batch.cache) is not None:
            self._kv.fit_cache(cache.nbytes, self._batch.evict_cache_to)
        deliver(outbox)

    def _on_token(self, active: _Active, response: object) -> tuple[list[OutputEvent], bool]:
        """Events for one generated token, and whether the request is done."""
        sub = active.sub
        token: int = response.token  # type: ignore[attr-defined]
        finish: str | None = response.finish_reason  # type: ignore[attr-defined]
        decoder, ctrl = sub.decoder, sub.controller
        end = functools.partial(decoder.finish, cached_tokens=active.cached)
        if ctrl is not None and ctrl.error is not None:
            return [Failed(ErrorKind.INTERNAL, f"constraint failed: {ctrl.error}")], True
        if active.guard is not None and active.guard.error is not None:
            log.error("request %s: a logits processor failed: %s", sub.request_id,
                      active.guard.error)
            return [Failed(ErrorKind.INTERNAL, _REQUEST_FAILED)], True
        if finish == "stop":  # an EOS or stop token id: it ends generation, it is not text
            decoder.count(token)
            if token in sub.stop_token_ids:
                return end(FinishReason.STOP_TOKEN, token), True
            grammar_done = ctrl is not None and ctrl.grammar_complete
            reason = FinishReason.GRAMMAR_COMPLETE if grammar_done else FinishReason.EOS
            return end(reason), True
        events = decoder.feed(token)
        if decoder.matched_stop is not None:
            return events + end(FinishReason.STOP_SEQUENCE), True
        if ctrl is not None and ctrl.grammar_complete:
            return events + end(FinishReason.GRAMMAR_COMPLETE), True
        if finish == "length":
            return events + end(FinishReason.LENGTH), True
        return events, False

    def _logprobs(self, responses: list[Any]) -> dict[int, Picked] | None:
        """The step's numbers for the rows that asked (None: computing them failed)."""
        asked = [Asked(r.uid, r.token, r.logprobs, a.sub.sampling.temperature, a.sub.logprobs.top)
                 for r in responses if (a := self._by_uid.get(r.uid)) and a.sub.logprobs]
        try:
            return pick(asked)
        except Exception:  # noqa: BLE001 - those requests fail alone, below
            log.exception("computing logprobs failed")
            return None

    def _forget(self, active: _Active) -> None:
        if self._by_uid.pop(active.uid, None) is not None and self._kv is not None:
            self._kv.release(active.reserved)
        self._by_rid.pop(active.sub.request_id, None)

    def _fail_all(self, message: str) -> None:
        deliver(self._fail_all_outbox(message))

    def _fail_all_outbox(self, message: str) -> list[tuple[EventSink, list[OutputEvent]]]:
        outbox: list[tuple[EventSink, list[OutputEvent]]] = [
            (a.sub.sink, [Failed(ErrorKind.INTERNAL, message)]) for a in list(self._by_uid.values())]
        if self._kv is not None:
            for active in list(self._by_uid.values()):
                self._kv.release(active.reserved)
        self._by_uid.clear()
        self._by_rid.clear()
        return outbox


def _guarded(sub: Submission) -> GuardedProcessors | None:
    extra: list[LogitsProcessor] = [sub.controller] if sub.controller is not None else []
    return guarded_processors(sub.sampling, extra)
