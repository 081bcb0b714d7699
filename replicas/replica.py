"""ModelReplica: one model, one engine thread, an async stream of events per request.

Everything that can reject a request (stops, sampling values, context length, a schema that
does not compile) runs here before the request reaches the engine, so bad input is a 4xx
with no engine time spent and nothing a client sends can wedge the batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncGenerator

from replicas.contract import (
    Channel,
    ChatPrompt,
    ErrorKind,
    Failed,
    GenerationRequest,
    OutputEvent,
    SamplingParams,
    is_terminal,
)
from replicas.control import Grammar, RequestController
from replicas.decoding import RequestDecoder
from replicas.detokenizer import Decode, make_decode
from replicas.engine import Engine, EngineConfig, EngineDead, EngineStats, Submission
from replicas.errors import ContextLengthError, InvalidRequestError, ReplicaError
from replicas.loading import LoadedModel, load_model
from replicas.pipeline.channels import (
    ChannelFormat,
    detect_format,
    get_format,
    initial_channel,
    initial_state,
)
from replicas.pipeline.stops import merge_stops
from replicas.prompt import RenderedPrompt, render_prompt
from replicas.sampling import validate as validate_sampling

if TYPE_CHECKING:  # imported on first guided request: llguidance is only loaded when used
    from replicas.guided import GuidedTokenizer


@dataclass(frozen=True)
class ReplicaOptions:
    model_id: str
    source: str
    default_stops: tuple[str, ...] = ()
    max_stops: int = 16
    channel_format: str | None = None  # None: detected from the tokenizer
    thinking_budget: int | None = None  # default budget for reasoning, in tokens
    engine: EngineConfig = field(default_factory=EngineConfig)
    load_timeout_s: float = 600.0
    # After the first flush, events are held at most this long so one message carries many
    # tokens when decode is fast: every message costs a hop through Ray and HTTP.
    flush_interval_s: float = 0.005


class _QueueSink:
    """Receives a request's events on the replica's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[list[OutputEvent]] = asyncio.Queue()

    def push(self, events: list[OutputEvent]) -> None:
        self.queue.put_nowait(events)


class ModelReplica:
    def __init__(self, options: ReplicaOptions) -> None:
        self.options = options
        self._engine = Engine(lambda: load_model(options.source), options.engine)
        self._model: LoadedModel | None = None
        self._format: ChannelFormat = get_format("none")
        self._decode: Decode | None = None
        self._guided_lock = threading.Lock()
        self._guided_tokenizer: GuidedTokenizer | None = None

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Load the model on the engine thread and wait for it (blocking)."""
        self._engine.start()
        model = self._engine.wait_ready(self.options.load_timeout_s)
        self._model = model
        self._decode = make_decode(model.hf_tokenizer)
        name = self.options.channel_format or detect_format(
            model.chat_template, model.hf_tokenizer.get_vocab().keys()
        )
        self._format = get_format(name)

    def shutdown(self) -> None:
        self._engine.shutdown()

    def check_health(self) -> None:
        self._engine.check_health()

    def stats(self) -> EngineStats:
        return self._engine.stats()

    @property
    def model(self) -> LoadedModel:
        if self._model is None:
            raise RuntimeError("the replica has not started")
        return self._model

    @property
    def channel_format(self) -> ChannelFormat:
        return self._format

    # ---- requests -----------------------------------------------------------------------

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[list[OutputEvent], None]:
        """Events in order, coalesced: the first batch leaves at once, later ones at most
        every `flush_interval_s`, each holding everything that arrived meanwhile."""
        sink = _QueueSink(asyncio.get_running_loop())
        try:
            sub = await asyncio.to_thread(self._prepare, request, sink)
        except ReplicaError as exc:
            yield [exc.as_event()]
            return
        try:
            self._engine.submit(sub)
        except EngineDead as exc:  # fail fast: Serve replaces this replica on its health check
            yield [Failed(ErrorKind.INTERNAL, f"the model is unavailable: {exc}")]
            return
        done = False
        loop = asyncio.get_running_loop()
        next_flush = 0.0
        try:
            while not done:
                batch = await sink.queue.get()
                wait = next_flush - loop.time()
                if wait > 0 and not any(is_terminal(e) for e in batch):
                    await asyncio.sleep(wait)
                while not sink.queue.empty():
                    batch.extend(sink.queue.get_nowait())
                done = any(is_terminal(e) for e in batch)
                yield batch
                next_flush = loop.time() + self.options.flush_interval_s
        finally:
            if not done:  # the consumer left: free the batch slot
                self._engine.cancel(request.request_id)

    async def count_tokens(self, request: GenerationRequest) -> int | Failed:
        """Prompt tokens after rendering, or the reason the prompt cannot be rendered."""
        try:
            rendered = await asyncio.to_thread(self._render, request)
        except ReplicaError as exc:
            return exc.as_event()
        return len(rendered.token_ids)

    def _render(self, request: GenerationRequest) -> RenderedPrompt:
        model = self.model
        return render_prompt(model.hf_tokenizer, request.prompt, request.reasoning, model.vocab_size)

    def _prepare(self, request: GenerationRequest, sink: _QueueSink) -> Submission:
        model = self.model
        assert self._decode is not None
        validate_sampling(request.sampling, model.vocab_size)
        stops = self._stops(request)
        rendered = self._render(request)
        max_tokens = self._max_tokens(request, len(rendered.token_ids))
        # Completions are raw continuations: channels only apply to chat.
        chat = isinstance(request.prompt, ChatPrompt)
        fmt = self._format if chat else get_format("none")
        initial = initial_channel(fmt, rendered.text)
        state = initial_state(fmt, rendered.text)
        grammar = self._grammar(request) if request.guided is not None else None
        decoder = RequestDecoder(
            self._decode,
            fmt,
            initial,
            state,
            stops=() if grammar is not None else stops,  # the grammar decides where it ends
            include_stop=request.stop.include_in_output,
            prompt_tokens=len(rendered.token_ids),
        )
        budget = self._budget(request) if chat else None
        controller = None
        if grammar is not None or budget is not None:
            controller = RequestController(
                self._decode,
                fmt,
                initial,
                state,
                budget=budget,
                forced_end_ids=self._encode(fmt.reasoning_end),
                grammar=grammar,
                reasoning_open_ids=self._open_ids(fmt),
                eos_ids=model.eos_token_ids,
            )
        return Submission(
            request_id=request.request_id,
            prompt_ids=list(rendered.token_ids),
            max_tokens=max_tokens,
            sampling=_unsigned_seed(request.sampling),
            stop_token_ids=frozenset() if grammar is not None else frozenset(request.stop.token_ids),
            decoder=decoder,
            controller=controller,
            sink=sink,
        )

    def _stops(self, request: GenerationRequest) -> tuple[str, ...]:
        for stop in request.stop.strings:
            if not isinstance(stop, str) or not stop:
                raise InvalidRequestError("stop strings must be non-empty strings", param="stop")
        stops = merge_stops(self.options.default_stops, request.stop.strings)
        if len(stops) > self.options.max_stops:
            raise InvalidRequestError(
                f"at most {self.options.max_stops} stop sequences are allowed "
                f"(got {len(stops)}, including the model's defaults)",
                param="stop",
            )
        for token_id in request.stop.token_ids:
            if not 0 <= token_id < self.model.vocab_size:
                raise InvalidRequestError(
                    f"stop_token_ids: {token_id} is outside the vocabulary", param="stop_token_ids"
                )
        return stops

    def _max_tokens(self, request: GenerationRequest, prompt_tokens: int) -> int:
        context = self.model.context_length
        room = context - prompt_tokens
        wanted = request.sampling.max_tokens
        if wanted is not None and wanted < 1:
            raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
        if room < 1 or (wanted is not None and wanted > room):
            raise ContextLengthError(
                f"this model's maximum context length is {context} tokens; the prompt has "
                f"{prompt_tokens} tokens and max_tokens asks for {wanted or 1} more",
                param="max_tokens",
            )
        return wanted if wanted is not None else room

    def _budget(self, request: GenerationRequest) -> int | None:
        if request.reasoning.enabled is False or not self._format.reasoning_end:
            return None
        budget = request.reasoning.budget_tokens
        if budget is None:
            budget = self.options.thinking_budget
        if budget is not None and budget < 1:
            raise InvalidRequestError("the thinking budget must be at least 1 token",
                                      param="thinking_budget")
        return budget

    def _grammar(self, request: GenerationRequest) -> Grammar:
        from replicas.guided import GuidedMatcher, GuidedTokenizer, compile_guided

        assert request.guided is not None
        grammar = compile_guided(request.guided)
        with self._guided_lock:  # built once per model, on first use
            tokenizer = self._guided_tokenizer
            if tokenizer is None:
                model = self.model
                tokenizer = self._guided_tokenizer = GuidedTokenizer.from_hf(
                    model.hf_tokenizer,
                    vocab_size=model.vocab_size,
                    eos_token_ids=sorted(model.eos_token_ids),
                )
        return GuidedMatcher(tokenizer, grammar)

    def _encode(self, text: str) -> tuple[int, ...]:
        if not text:
            return ()
        return tuple(self.model.hf_tokenizer.encode(text, add_special_tokens=False))

    def _open_ids(self, fmt: ChannelFormat) -> frozenset[int]:
        """Single tokens that open a reasoning block, allowed before the grammar starts."""
        ids = set()
        answer = fmt.states[fmt.answer_state]
        for rule in answer.rules:
            target = fmt.states.get(rule.to) if isinstance(rule.to, str) else None
            if target is None or target.channel is not Channel.REASONING:
                continue
            encoded = self._encode(rule.marker)
            if len(encoded) == 1:
                ids.add(encoded[0])
        return frozenset(ids)


def _unsigned_seed(sampling: SamplingParams) -> SamplingParams:
    """mlx seeds are unsigned 64-bit integers; any integer a client sends maps onto one."""
    if sampling.seed is None or 0 <= sampling.seed < 2**64:
        return sampling
    return dataclasses.replace(sampling, seed=sampling.seed % 2**64)
