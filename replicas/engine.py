"""The engine thread: the sole owner of MLX in a replica.

It runs mlx-lm's BatchGenerator (continuous batching: requests join and leave between
steps), feeds each generated token through that request's output pipeline, and hands
events back to asyncio through the sinks' event loops. Commands (submit, cancel) arrive on
a thread-safe queue and are applied between steps, so a cancel frees its slot before the
next decode step.

Faults stay as small as they can: a request whose own processing raises (its sampler, its
logits processors, its output pipeline) fails alone while the batch runs on; a failed batch
step fails that batch; if the thread itself dies, every queued and in-flight request fails
at once and later submissions raise, so nothing waits on a thread that is gone.

Prefix reuse: a request joins the batch with the KV of the longest cached prefix of its
prompt (`replicas.prompt_cache`) and prefills the rest, kept at its last message boundary;
one that finishes normally leaves its prompt plus output behind for the next turn.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from replicas.contract import ErrorKind, Failed, FinishReason, OutputEvent, SamplingParams
from replicas.control import RequestController
from replicas.pipeline.decoding import RequestDecoder
from replicas.loading import LoadedModel
from replicas.prompt_cache import CacheHit, PromptCache, segments
from replicas.sampling import (
    GuardedProcessors,
    LogitsProcessor,
    Sampler,
    guarded_processors,
    make_request_sampler,
)

log = logging.getLogger(__name__)


class EventSink(Protocol):
    """Where one request's events go; `push` runs on `loop`, never on the engine thread."""

    loop: asyncio.AbstractEventLoop

    def push(self, events: list[OutputEvent]) -> None: ...


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 32  # sequences decoded together
    prefill_batch_size: int = 8
    prefill_step_size: int = 2048
    stuck_after_s: float = 120.0  # a step longer than this marks the engine unhealthy
    # KV of earlier prompts kept for reuse, bytes per replica (0: off). Sequences in the
    # batch are not counted: this is what stays resident between requests.
    prompt_cache_bytes: int = 2 * 1024**3


@dataclass
class Submission:
    """A validated request, ready for the batch. Built off the engine thread, pure Python."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]  # the user's; EOS ids come from the model
    decoder: RequestDecoder
    controller: RequestController | None
    sink: EventSink
    boundary: int = 0  # prompt tokens before the last message: their KV is kept once prefilled


@dataclass(frozen=True)
class EngineStats:
    active: int
    waiting: int
    steps: int
    finished: int
    submitted: int  # requests that reached the batch (a request cancelled in the queue never does)
    cancel_latency_steps: tuple[int, ...]  # decode steps between a cancel and the slot freeing
    cache_hits: int = 0  # requests that reused a cached prefix
    cache_misses: int = 0
    cache_evictions: int = 0
    cache_bytes: int = 0
    cache_entries: int = 0
    cached_tokens: int = 0  # prompt tokens not prefilled thanks to the cache


@dataclass
class _Active:
    uid: int
    sub: Submission
    guard: GuardedProcessors | None


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


class Engine:
    def __init__(self, loader: Callable[[], LoadedModel], config: EngineConfig) -> None:
        self._loader = loader
        self._config = config
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
        self._cache = PromptCache(config.prompt_cache_bytes) if config.prompt_cache_bytes > 0 \
            else None
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
        busy = bool(self._by_uid)
        if busy and time.monotonic() - self._heartbeat > self._config.stuck_after_s:
            raise EngineDead(f"engine step stuck for over {self._config.stuck_after_s:g}s")

    def stats(self) -> EngineStats:
        cache = self._cache.stats() if self._cache is not None else None
        return EngineStats(
            active=len(self._by_uid),
            waiting=self._commands.qsize(),
            steps=self._steps,
            finished=self._finished,
            submitted=self._submitted,
            cancel_latency_steps=tuple(self._cancel_latency),
            **({} if cache is None else cache.engine_fields()),
        )

    # ---- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loaded = self._loader()
            self._gen = self._new_generator()
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
                self._apply(self._take_commands(block=not self._by_uid))
                if self._by_uid:
                    self._step()
        except BaseException:  # noqa: BLE001 - the thread ends here either way
            log.exception("the engine thread died")
            self._die("the model engine stopped")
            return
        self._die("the replica is shutting down")

    def _die(self, reason: str) -> None:
        """Refuse new work, then fail everything queued or in flight."""
        with self._lock:
            self._dead = reason
            queued: list[tuple[EventSink, list[OutputEvent]]] = []
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(command, Submission):
                    queued.append((command.sink, [Failed(ErrorKind.INTERNAL, reason)]))
        _deliver(queued)
        self._fail_all(reason)

    def _new_generator(self) -> BatchGenerator:
        assert self._loaded is not None
        return BatchGenerator(
            self._loaded.model,
            completion_batch_size=self._config.max_batch_size,
            prefill_batch_size=self._config.prefill_batch_size,
            prefill_step_size=self._config.prefill_step_size,
            stream=mx.new_stream(mx.default_device()),
        )

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
        # A request cancelled while still queued never reaches the batch.
        submits = [s for s in commands.submits if s.request_id not in commands.cancels]
        if submits:
            self._insert(submits)
        gone = [self._by_rid[r] for r in commands.cancels if r in self._by_rid]
        if gone:
            self._gen.remove([a.uid for a in gone])
            for active in gone:
                self._forget(active)
                self._cancel_latency.append(self._steps - commands.cancels[active.sub.request_id])

    def _insert(self, subs: list[Submission]) -> None:
        assert self._loaded is not None
        eos = self._loaded.eos_token_ids
        ready: list[tuple[Submission, Sampler, GuardedProcessors | None]] = []
        failed: list[tuple[EventSink, list[OutputEvent]]] = []
        for sub in subs:
            try:  # a request whose sampling cannot be built fails alone
                ready.append((sub, make_request_sampler(sub.sampling), _guarded(sub)))
            except Exception:  # noqa: BLE001 - reported to that request
                log.exception("request %s: building its sampler failed", sub.request_id)
                failed.append((sub.sink, [Failed(ErrorKind.INTERNAL, _REQUEST_FAILED)]))
        _deliver(failed)
        if not ready:
            return
        hits = [self._lookup(s) for s, _, _ in ready]
        uids = self._gen.insert_segments(
            [segments(s.prompt_ids, h.length if h else 0, s.boundary)
             for (s, _, _), h in zip(ready, hits)],
            # None: mlx-lm starts an empty cache (its annotation does not say so).
            caches=[h.cache if h else None for h in hits],  # type: ignore[misc]
            # The tokens the cache holds: penalties and the batch's bookkeeping see them.
            all_tokens=[s.prompt_ids[:h.length] if h else [] for (s, _, _), h in zip(ready, hits)],
            max_tokens=[s.max_tokens for s, _, _ in ready],
            samplers=[sampler for _, sampler, _ in ready],
            # Rows without processors skip mlx-lm's per-row path entirely.
            logits_processors=[[guard] if guard else [] for _, _, guard in ready],
            stop_sequences=[StopSequences([[t] for t in eos | s.stop_token_ids])
                            for s, _, _ in ready],
        )
        for uid, (sub, _, guard) in zip(uids, ready):
            active = _Active(uid, sub, guard)
            self._by_uid[uid] = active
            self._by_rid[sub.request_id] = active
        self._submitted += len(ready)

    def _lookup(self, sub: Submission) -> CacheHit | None:
        if self._cache is None:
            return None
        hit = self._cache.fetch(sub.prompt_ids)
        sub.decoder.cached_tokens = hit.length if hit else 0
        return hit

    def _save(self, finished: list[tuple[list[int], list[object]]], batched: list[int]) -> None:
        """Keep finished requests' KV (`batched`: still batched); a failure costs reuse only."""
        if self._cache is None:
            return
        try:
            finished += [(t, c) for c, t in self._gen.extract_cache(batched).values()]
            for tokens, cache in finished:
                self._cache.save(list(tokens), cache)
        except Exception:  # noqa: BLE001 - the cache is an optimisation
            log.exception("saving a prompt cache entry failed")

    def _step(self) -> None:
        try:
            prefilled, responses = self._gen.next()
        except Exception as exc:  # noqa: BLE001 - one bad step must not kill the replica
            log.exception("batch step failed; failing the batch and starting a fresh one")
            self._fail_all(f"generation failed: {type(exc).__name__}")
            self._gen = self._new_generator()
            return
        self._steps += 1
        if self._cache is not None:
            self._cache.save_boundaries(self._gen, prefilled)
        outbox: list[tuple[EventSink, list[OutputEvent]]] = []
        to_remove: list[int] = []
        to_save: list[int] = []  # finished by us, still batched: their KV is extracted below
        saved: list[tuple[list[int], list[object]]] = []  # finished by mlx-lm, with their KV
        for response in responses:
            active = self._by_uid.get(response.uid)
            if active is None:
                continue
            try:
                events, done, still_batched = self._on_token(active, response)
            except Exception:  # noqa: BLE001 - one request's pipeline must not stop the batch
                log.exception("request %s: output processing failed", active.sub.request_id)
                events = [Failed(ErrorKind.INTERNAL, _REQUEST_FAILED)]
                done, still_batched = True, response.finish_reason is None
            if events:
                outbox.append((active.sub.sink, events))
            if done:
                self._forget(active)
                self._finished += 1
                ok = not any(isinstance(e, Failed) for e in events)
                if still_batched:
                    to_remove.append(response.uid)
                    if ok:
                        to_save.append(response.uid)
                elif ok and response.prompt_cache is not None:
                    saved.append((response.all_tokens, response.prompt_cache))
        if saved or to_save:
            self._save(saved, to_save)
        if to_remove:
            self._gen.remove(to_remove)
        _deliver(outbox)

    def _on_token(self, active: _Active, response: object) -> tuple[list[OutputEvent], bool, bool]:
        """Events for one generated token, whether the request is done, and whether the
        batch still holds it (mlx-lm drops requests it finished itself)."""
        sub = active.sub
        token: int = response.token  # type: ignore[attr-defined]
        finish: str | None = response.finish_reason  # type: ignore[attr-defined]
        decoder, ctrl = sub.decoder, sub.controller
        if ctrl is not None and ctrl.error is not None:
            return [Failed(ErrorKind.INTERNAL, f"constraint failed: {ctrl.error}")], True, finish is None
        if active.guard is not None and active.guard.error is not None:
            log.error("request %s: a logits processor failed: %s", sub.request_id,
                      active.guard.error)
            return [Failed(ErrorKind.INTERNAL, _REQUEST_FAILED)], True, finish is None
        if finish == "stop":  # an EOS or stop token id: it ends generation, it is not text
            decoder.count(token)
            if token in sub.stop_token_ids:
                return decoder.finish(FinishReason.STOP_TOKEN, token), True, False
            grammar_done = ctrl is not None and ctrl.grammar_complete
            reason = FinishReason.GRAMMAR_COMPLETE if grammar_done else FinishReason.EOS
            return decoder.finish(reason), True, False
        events = decoder.feed(token)
        if decoder.matched_stop is not None:
            return events + decoder.finish(FinishReason.STOP_SEQUENCE), True, finish is None
        if ctrl is not None and ctrl.grammar_complete:
            return events + decoder.finish(FinishReason.GRAMMAR_COMPLETE), True, finish is None
        if finish == "length":
            return events + decoder.finish(FinishReason.LENGTH), True, False
        return events, False, True

    def _forget(self, active: _Active) -> None:
        self._by_uid.pop(active.uid, None)
        self._by_rid.pop(active.sub.request_id, None)

    def _fail_all(self, message: str) -> None:
        outbox: list[tuple[EventSink, list[OutputEvent]]] = [
            (a.sub.sink, [Failed(ErrorKind.INTERNAL, message)]) for a in self._by_uid.values()]
        self._by_uid.clear()
        self._by_rid.clear()
        _deliver(outbox)


def _guarded(sub: Submission) -> GuardedProcessors | None:
    extra: list[LogitsProcessor] = [sub.controller] if sub.controller is not None else []
    return guarded_processors(sub.sampling, extra)


def _deliver(outbox: list[tuple[EventSink, list[OutputEvent]]]) -> None:
    """One thread hop per event loop per step, however many requests it carries."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[EventSink, list[OutputEvent]]]] = {}
    for sink, events in outbox:
        by_loop.setdefault(sink.loop, []).append((sink, events))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_push_all, items)
        except RuntimeError:  # the loop closed: its requests are gone
            pass


def _push_all(items: list[tuple[EventSink, list[OutputEvent]]]) -> None:
    for sink, events in items:
        sink.push(events)
