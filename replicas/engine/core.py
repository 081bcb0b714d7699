"""The engine thread: the sole owner of MLX in a replica.

It drives the batch (`replicas.engine.batch.local`: mlx-lm's BatchGenerator with continuous
batching, requests join and leave between steps, and the KV prefix cache), hands each
generated token id to that request's `RequestOutput` (`replicas.engine.request`; the
pipeline's output processor, which alone turns tokens into events), and hands the events
back to asyncio through the sinks' event loops. Commands (submit, cancel, and `call`: any
other work with the model, such as embeddings) arrive on a thread-safe queue and are
applied between steps, so a cancel frees its slot before the next decode step.

Faults stay as small as they can: a request whose own processing raises (its sampler, its
logits processors, its output pipeline) fails alone while the batch runs on; a failed batch
step fails that batch; if the thread itself dies, every queued and in-flight request fails
at once and later submissions raise, so nothing waits on a thread that is gone
(`replicas.engine.failures` says what each hears).

Prefix reuse: a request joins the batch with the KV of the longest cached prefix of its
prompt (`replicas.engine.kv.prefix_cache`) and prefills the rest, kept at its last message boundary;
one that finishes normally leaves its prompt plus output behind for the next turn.

Memory: a request joins when its prompt's KV fits, and a row whose KV cannot grow preempts
the youngest, which rejoins later where it stopped (`replicas.engine.scheduling`).

The engine does not know how many processes run the model: on a sharded replica the batch
it is handed keeps the other ranks in lockstep (`replicas.engine.sharded.lockstep`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Sequence, TypeVar

from replicas.contract import ErrorKind, Failed, OutputEvent
from replicas.engine import failpoints, mlx_thread
from replicas.engine.batch.local import Batch
from replicas.engine.batch.rows import Done
from replicas.engine.calls import Call, Cancel, Command, Commands, take_commands
from replicas.engine.config import EngineConfig
from replicas.engine.delivery import EventSink, deliver
from replicas.engine.failures import REQUEST_FAILED, BatchLost, Outbox, abandoned, \
    batch_failed, batch_message, fail_rows, lost, refused
from replicas.engine.failures import EngineDead as EngineDead  # raised to the replica
from replicas.engine.model.loading import LoadedModel
from replicas.engine.sampling.logprobs import Asked, Picked, pick
from replicas.engine.kv.budget import KvBudget, RankMemory, tightest
from replicas.engine.request import EngineRequest, Generated, RequestOutput, Submitted
from replicas.engine.scheduling import Active, Prefills, Queued, Ready, Waiting, row_for
from replicas.engine.stats import EngineStats, memory_figures
from replicas.os_thread import name_os_thread

_THREAD_NAME = "orchard-engine"
log = logging.getLogger(__name__)

_T = TypeVar("_T")


# Opens the model and the batch that runs it, on the engine thread: a `LocalBatch`, or on a
# sharded replica's rank 0 a `LockstepBatch` that the other ranks follow; with each rank's
# memory (one for a whole model).
Opener = Callable[[], tuple[LoadedModel, Batch, tuple[RankMemory, ...]]]
# Called after every batch step with its duration and the rows that got a token (metrics).
StepCallback = Callable[[float, int], None]


class Engine:
    def __init__(self, opener: Opener, config: EngineConfig,
                 on_step: StepCallback | None = None, name: str = "") -> None:
        """`name`: the model id, which scopes test-only failpoints (`failpoints`)."""
        self._opener = opener
        self._config = config
        self._name = name
        self._on_step = on_step
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._loaded: LoadedModel | None = None
        self._by_uid: dict[int, Active] = {}
        self._by_rid: dict[str, Active] = {}
        self._prefills = Prefills()  # requests whose image prefix is being prefilled
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
        # Admitted by Serve, waiting for KV memory (`replicas.engine.scheduling`).
        self._waiting: Waiting | None = None
        self._thread: mlx_thread.Job | None = None  # the engine thread, once started

    # ---- asyncio side -------------------------------------------------------------------

    def start(self) -> None:
        self._thread = mlx_thread.start(_THREAD_NAME, self._run)

    def wait_ready(self, timeout: float | None = None) -> LoadedModel:
        if not self._ready.wait(timeout):
            raise TimeoutError("the engine did not load its model in time")
        if self._load_error is not None or self._loaded is None:
            raise EngineDead(f"model failed to load: {self._load_error}") from self._load_error
        return self._loaded

    def submit(self, request: EngineRequest, output: RequestOutput) -> None:
        """Queue a request for the batch; raises `EngineDead` if the engine cannot run it."""
        with self._lock:
            self.check_health()
            self._commands.put(Submitted(request, output))

    def cancel(self, request_id: str) -> None:
        self._commands.put(Cancel(request_id, self._steps))

    def call(self, fn: Callable[[], _T]) -> Future[_T]:
        """Run `fn` on the engine thread between steps (the thread owns MLX); its result or
        exception lands in the future. Raises `EngineDead` if the engine cannot run it; one
        queued when the engine dies gets `EngineDead` in its future."""
        future: Future[_T] = Future()
        with self._lock:
            self.check_health()
            self._commands.put(Call(fn, future))
        return future

    def shutdown(self) -> None:
        self._stopping = True
        self._commands.put(None)
        if self._thread is not None:
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
        batch, waiting = self._batch, self._waiting  # `Waiting` is falsy while empty
        cache, memory = memory_figures(batch.cache if batch is not None else None,
                                       waiting.kv if waiting is not None else None,
                                       len(waiting) if waiting is not None else 0)
        return EngineStats(
            active=len(self._by_uid),
            waiting=self._commands.qsize(),
            steps=self._steps,
            finished=self._finished,
            submitted=self._submitted,
            cancel_latency_steps=tuple(self._cancel_latency),
            memory=memory,
            decode=self._batch.decode_counts() if self._batch else None,
            tenants=waiting.tally.snapshot() if waiting is not None else (),
            **({} if cache is None else cache.engine_fields()),
        )

    # ---- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        name_os_thread(_THREAD_NAME)  # the threads MLX starts from here inherit it
        try:
            self._loaded, self._batch, ranks = self._opener()
            kv = KvBudget(tightest(ranks, self._loaded.context_length), ranks[0].layout,
                          self._config.max_memory_waiting, ranks)
            self._batch.page(kv, self._loaded.context_length)  # paged KV, where configured
            self._waiting = Waiting(kv, self._config)
        except BaseException as exc:  # noqa: BLE001 - reported through wait_ready
            log.exception("model load failed")
            self._load_error = exc
            self._die("the model failed to load")
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stopping:
                commands = self._take_commands(
                    block=not self._by_uid and not self._waiting and not self._prefills)
                # After the wait for work, not before: time spent idle is no stuck step.
                self._heartbeat = time.monotonic()
                self._apply(commands)
                if self._prefills:
                    self._advance_prefill()
                if self._by_uid:
                    self._step()
        except BatchLost as exc:  # no collective may follow: no close either
            log.exception("a sharded step failed; the replica stops")
            self._die(str(exc))
            return
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
            outbox = abandoned(take_commands(self._commands, block=False), self._waiting,
                               self._prefills, reason)
            outbox += fail_rows(self._by_uid, self._by_rid, self._kv(), lost(reason))
        deliver(outbox)

    def _kv(self) -> KvBudget | None:
        """The KV admission, once the model has loaded."""
        return self._waiting.kv if self._waiting is not None else None

    @property
    def kv_budget(self) -> KvBudget:
        """The KV admission of the loaded model (after `wait_ready`)."""
        assert self._waiting is not None
        return self._waiting.kv

    def _take_commands(self, block: bool) -> Commands:
        return take_commands(self._commands, block)

    def _apply(self, commands: Commands) -> None:
        assert self._batch is not None
        for call in commands.calls:  # first: nothing below may strand their futures
            call.run()
        # A request cancelled while still queued (or waiting for memory) never reaches the
        # batch; the rest join in order while their KV fits.
        assert self._waiting is not None
        admitted = self._waiting.admit(commands.submits, commands.cancels.__contains__,
                                       self._batch.bound_cache, self._by_uid, self._preempt)
        if admitted:
            self._insert(admitted)
        self._prefills.cancel(commands.cancels.__contains__, self._waiting.kv)
        gone = [self._by_rid[r] for r in commands.cancels if r in self._by_rid]
        if gone:
            self._batch.finish([Done(a.uid, keep=False) for a in gone])
            for active in gone:
                self._forget(active)
                self._cancel_latency.append(self._steps - commands.cancels[active.sub.request_id])
            self._waiting.kv.fit_cache(self._batch.bound_cache)

    def _insert(self, queued: list[Queued]) -> None:
        assert self._loaded is not None and self._batch is not None
        eos = self._loaded.eos_token_ids
        ready: list[Ready] = []
        failed: Outbox = []
        for q in queued:
            sub, request = q.sub, q.sub.request
            try:  # a request whose sampling or output cannot start fails alone
                if q.resumed is None:  # a preempted request has started already
                    first = sub.output.started(self._score(request))
                    if first:
                        deliver([(sub.output.sink, first)])
                row, guard = row_for(request, eos)
                prefill = self._batch.begin(row)
                if prefill is None:
                    ready.append((q, row, guard))
                else:  # its image prefix first, a chunk per loop (`_advance_prefill`)
                    self._prefills.add((q, row, guard), prefill)
            except Exception:  # noqa: BLE001 - reported to that request
                log.exception("request %s: starting it failed", request.request_id)
                failed.append(refused(q, self._kv()))
        deliver(failed)
        self._join(ready)

    def _join(self, ready: list[Ready]) -> None:
        """Rows into the batch, as their requests' `Active`s."""
        assert self._batch is not None
        if not ready:
            return
        try:
            placed = self._batch.insert([row for _, row, _ in ready])
        except Exception as exc:  # noqa: BLE001 - as a failed step: the batch starts over
            self._batch_failed(exc, [(q.sub.output.sink, q.request_id) for q, _, _ in ready])
            return
        for (uid, cached), (q, _, guard) in zip(placed, ready):
            if q.resumed is None:
                self._submitted += 1  # also each request's `order`: when it first joined
            active = Active(uid, q.sub, guard, q.resumed.cached if q.resumed else cached,
                            q.resumed.order if q.resumed else self._submitted,
                            preemptions=q.resumed.preemptions if q.resumed else 0)
            self._by_uid[uid] = active
            self._by_rid[q.request_id] = active

    def _advance_prefill(self) -> None:
        """A prefill step's worth of image prefixes: those done join the batch together,
        those that failed fail alone."""
        assert self._batch is not None
        done, failed = self._prefills.advance(self._batch.advance,
                                              self._config.prefill_step_size)
        deliver([refused(ready[0], self._kv()) for ready in failed])
        self._join(done)

    def _preempt(self, active: Active) -> None:
        """Take `active` out of the batch (`replicas.engine.scheduling` queues it again)."""
        assert self._batch is not None
        # Its KV goes to the prefix cache, into the room its release leaves (older entries
        # evicted first if memory stays short); a row still prefilling has none worth keeping.
        self._forget(active)
        if self._waiting is not None:
            self._waiting.kv.fit_cache(self._batch.bound_cache)
        self._batch.finish([Done(active.uid, keep=bool(active.tokens))])

    def _score(self, request: EngineRequest) -> list[Picked] | None:
        """The prompt's token logprobs from one prefill, when the request asked for them."""
        if not request.score_prompt or request.logprobs is None:
            return None
        assert self._batch is not None
        return self._batch.score(request.prompt_ids, request.logprobs, request.adapter)

    def _step(self) -> None:
        assert self._batch is not None
        assert self._waiting is not None
        self._waiting.grow(self._by_uid, self._batch.bound_cache, self._preempt)
        if not self._by_uid:  # everything was preempted for a row that then left too
            return
        started = time.perf_counter()
        try:
            if failpoints.ENABLED:  # test-only fault injection: off unless ORCHARD_FAILPOINTS
                failpoints.hit("step", self._name)
            responses = self._batch.step()
        except Exception as exc:  # noqa: BLE001 - one bad step must not kill the replica
            self._batch_failed(exc)
            return
        self._steps += 1
        if self._on_step is not None:
            self._on_step(time.perf_counter() - started, len(responses))
        outbox: Outbox = []
        done: list[Done] = []
        picked = self._logprobs(responses)
        for at, response in enumerate(responses):
            active = self._by_uid.get(response.uid)
            if active is None:  # gone, or ended earlier in this step's tokens
                continue
            try:
                events, finished = self._generated(active, response,
                                                   picked.get(at) if picked else None)
            except Exception:  # noqa: BLE001 - one request's pipeline must not stop the batch
                log.exception("request %s: output processing failed", active.sub.request_id)
                events, finished = [Failed(ErrorKind.INTERNAL, REQUEST_FAILED)], True
            if events:
                outbox.append((active.output.sink, events))
            active.tokens.append(response.token)
            if finished:
                self._forget(active)
                self._finished += 1
                ok = not any(isinstance(e, Failed) for e in events)
                done.append(Done(response.uid, keep=ok))
        if done:
            # What the ended rows released, the cache may take: their KV is saved into it.
            self._waiting.kv.fit_cache(self._batch.bound_cache)
            self._batch.finish(done)
        deliver(outbox)

    def _generated(self, active: Active, response: Any,
                   logprob: Picked | None) -> tuple[list[OutputEvent], bool]:
        """The request's events for its token, and whether it is done."""
        if active.guard is not None and active.guard.error is not None:
            log.error("request %s: a logits processor failed: %s", active.sub.request_id,
                      active.guard.error)
            return [Failed(ErrorKind.INTERNAL, REQUEST_FAILED)], True
        if active.sub.request.logprobs is not None and logprob is None:
            raise RuntimeError("no logprobs for this token")  # fails this request alone
        return active.output.generated(
            Generated(response.token, response.finish_reason, logprob, active.cached,
                      active.preemptions))

    def _logprobs(self, responses: list[Any]) -> dict[int, Picked] | None:
        """The step's numbers for the tokens whose requests asked, by their place in
        `responses` (a row may have several); None: computing them failed."""
        asked = [Asked(at, r.token, r.logprobs, a.sub.request.sampling.temperature, top)
                 for at, r in enumerate(responses)
                 if (a := self._by_uid.get(r.uid)) and (top := a.sub.request.logprobs) is not None]
        try:
            return pick(asked)
        except Exception:  # noqa: BLE001 - those requests fail alone, below
            log.exception("computing logprobs failed")
            return None

    def _forget(self, active: Active) -> None:
        if self._by_uid.pop(active.uid, None) is not None and self._waiting is not None:
            self._waiting.kv.release(active.sub.request_id)
        self._by_rid.pop(active.sub.request_id, None)

    def _batch_failed(self, exc: Exception,
                      joining: Sequence[tuple[EventSink, str]] = ()) -> None:
        """A step or an insert raised: the batch starts over, failing what it held and the
        requests that were `joining` it; a sharded batch cannot, and the replica stops."""
        message = batch_message(exc)
        assert self._batch is not None
        if not self._batch.recover():  # a sharded batch cannot start over
            raise BatchLost(message) from exc
        log.exception("the batch failed; failing its requests and starting a fresh one")
        deliver(batch_failed(message, joining, self._by_uid, self._by_rid, self._kv()))
