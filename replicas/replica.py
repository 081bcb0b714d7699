"""ModelReplica: one model, one engine thread, an async stream of events per request.

Everything that can reject a request (stops, sampling values, context length, a schema that
does not compile) runs here before the request reaches the engine, so bad input is a 4xx
with no engine time spent and nothing a client sends can wedge the batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncGenerator

from replicas.contract import (
    Channel,
    ChatPrompt,
    ErrorKind,
    Failed,
    Finished,
    GenerationRequest,
    OutputEvent,
    SamplingParams,
    is_terminal,
)
from replicas.control import Grammar, RequestController
from replicas.pipeline.decoding import RequestDecoder
from replicas.pipeline.detokenizer import Decode, make_decode
from replicas.engine import EngineConfig, EngineDead, EngineStats, Submission
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
from replicas.pipeline.tool_formats import (
    ToolFormat,
    detect_tool_format,
    get_tool_format,
    with_tools,
)
from replicas.prompt import RenderedPrompt, last_message_boundary, render_prompt
from replicas.sampling import validate as validate_sampling
from replicas.timings import TimedEngine, Timings, TimingSamples
from replicas.tool_plan import ToolPlan, plan_tools

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
    tool_format: str | None = None  # None: detected from the chat template and vocabulary
    # Caps the model's context (vLLM's max_model_len): KV memory grows with it, and a Mac
    # with little memory can serve a long-context model at a shorter length.
    max_model_len: int | None = None
    # A max_tokens past the context: "clamp" lowers it to what is left, "reject" is a 400.
    max_tokens_past_context: str = "clamp"
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
        self._timings = Timings()
        self._engine = TimedEngine(lambda: load_model(options.source), options.engine,
                                   self._timings)
        self._model: LoadedModel | None = None
        self._format: ChannelFormat = get_format("none")
        self._decode: Decode | None = None
        self._guided_lock = threading.Lock()
        self._guided_tok: GuidedTokenizer | None = None
        self._tool_format: ToolFormat = get_tool_format("none")

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Load the model on the engine thread and wait for it (blocking)."""
        self._engine.start()
        model = self._engine.wait_ready(self.options.load_timeout_s)
        self._model = model
        self._decode = make_decode(model.hf_tokenizer)
        vocab = model.hf_tokenizer.get_vocab().keys()
        name = self.options.channel_format or detect_format(model.chat_template, vocab)
        self._format = get_format(name)
        tool_name = self.options.tool_format or detect_tool_format(model.chat_template, vocab)
        self._tool_format = get_tool_format(tool_name)

    @property
    def tool_format(self) -> ToolFormat:
        return self._tool_format

    def shutdown(self) -> None:
        self._engine.shutdown()

    def check_health(self) -> None:
        self._engine.check_health()

    def stats(self) -> EngineStats:
        return self._engine.stats()

    def drain_timings(self) -> TimingSamples:
        """Step and grammar-compile samples since the last call (for metrics)."""
        return self._timings.drain()

    @property
    def model(self) -> LoadedModel:
        if self._model is None:
            raise RuntimeError("the replica has not started")
        return self._model

    @property
    def context_length(self) -> int:
        """Prompt plus output tokens one request may use."""
        limit = self.options.max_model_len
        native = self.model.context_length
        return native if limit is None else min(native, limit)

    @property
    def channel_format(self) -> ChannelFormat:
        return self._format

    # ---- requests -----------------------------------------------------------------------

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[list[OutputEvent], None]:
        """Events in order, coalesced: the first batch leaves at once, later ones at most
        every `flush_interval_s`, each holding everything that arrived meanwhile."""
        sink = _QueueSink(asyncio.get_running_loop())
        try:
            sub, warnings = await asyncio.to_thread(self._prepare, request, sink)
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
                if done and warnings:
                    batch = [_with_warnings(e, warnings) for e in batch]
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
        return render_prompt(model.hf_tokenizer, request.prompt, request.reasoning, model.vocab_size,
                             tools=request.tools)

    def _prepare(self, request: GenerationRequest,
                 sink: _QueueSink) -> tuple[Submission, tuple[str, ...]]:
        model = self.model
        assert self._decode is not None
        validate_sampling(request.sampling, model.vocab_size)
        stops = self._stops(request)
        rendered = self._render(request)
        max_tokens, clamp_warning = self._max_tokens(request, len(rendered.token_ids))
        # Completions are raw continuations: channels and tool calls only apply to chat.
        chat = isinstance(request.prompt, ChatPrompt)
        base = self._format if chat else get_format("none")
        initial = initial_channel(base, rendered.text)
        state = initial_state(base, rendered.text)
        tools = self._tool_plan(request, chat)
        fmt = with_tools(base, tools.parsing.format) if tools.parsing is not None else base
        if tools.grammar is not None:
            grammar: Grammar | None = self._matcher(tools.grammar)
        elif request.guided is not None:
            from replicas.guided import compile_guided

            grammar = self._matcher(compile_guided(request.guided))
        else:
            grammar = None
        # A response_format grammar decides where the text ends; a tool grammar leaves the
        # text before a call free, so stops still apply to it.
        text_grammar = grammar is not None and tools.grammar is None
        decoder = RequestDecoder(
            self._decode,
            fmt,
            initial,
            state,
            stops=() if text_grammar else stops,
            include_stop=request.stop.include_in_output,
            prompt_tokens=len(rendered.token_ids),
            tools=tools.parsing,
        )
        budget = self._budget(request) if chat else None
        controller = None
        if grammar is not None or budget is not None or tools.banned_ids:
            controller = RequestController(
                self._decode,
                fmt,
                initial,
                state,
                budget=budget,
                forced_end_ids=self._encode(tools.forced_end or fmt.reasoning_end),
                grammar=grammar,
                reasoning_open_ids=self._open_ids(fmt),
                eos_ids=model.eos_token_ids,
                banned_ids=tools.banned_ids,
                grammar_start=tools.grammar_start,
            )
        sub = Submission(
            request_id=request.request_id,
            prompt_ids=list(rendered.token_ids),
            max_tokens=max_tokens,
            sampling=_unsigned_seed(request.sampling),
            stop_token_ids=frozenset() if text_grammar else frozenset(request.stop.token_ids),
            decoder=decoder,
            controller=controller,
            sink=sink,
            boundary=last_message_boundary(model.hf_tokenizer, request.prompt, request.reasoning,
                                           rendered.token_ids, request.tools)
            if self.options.engine.prompt_cache_bytes else 0,
        )
        return sub, (clamp_warning,) if clamp_warning else ()

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

    def _max_tokens(self, request: GenerationRequest, prompt_tokens: int) -> tuple[int, str | None]:
        """The generation limit, and a warning when a too-large max_tokens was clamped.

        Clients such as Claude Code ask for a fixed max_tokens (32000) whatever the model's
        context; refusing that would fail every request on a small model, so by default it
        is lowered to what is left. A prompt that itself leaves no room is always a 400.
        """
        context = self.context_length
        room = context - prompt_tokens
        wanted = request.sampling.max_tokens
        if wanted is not None and wanted < 1:
            raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
        if room < 1 or (wanted is not None and wanted > room
                        and self.options.max_tokens_past_context == "reject"):
            raise ContextLengthError(
                f"this model's maximum context length is {context} tokens; the prompt has "
                f"{prompt_tokens} tokens and max_tokens asks for {wanted or 1} more",
                param="max_tokens",
            )
        if wanted is not None and wanted > room:
            return room, (f"max_tokens lowered from {wanted} to {room}: the prompt has "
                          f"{prompt_tokens} tokens of this model's {context}-token context")
        return (wanted if wanted is not None else room), None

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

    def _tool_plan(self, request: GenerationRequest, chat: bool) -> ToolPlan:
        if request.tools and not chat:
            raise InvalidRequestError("tools need a chat request", param="tools")
        return plan_tools(request, self._tool_format, self._guided_tokenizer, self._encode)

    def _matcher(self, grammar: str) -> Grammar:
        from replicas.guided import GuidedMatcher

        tokenizer = self._guided_tokenizer()  # built once: not part of a compile
        started = time.perf_counter()
        matcher = GuidedMatcher(tokenizer, grammar)
        self._timings.grammar_compiled(time.perf_counter() - started)
        return matcher

    def _guided_tokenizer(self) -> GuidedTokenizer:
        from replicas.guided import GuidedTokenizer

        with self._guided_lock:  # built once per model, on first use
            tokenizer = self._guided_tok
            if tokenizer is None:
                model = self.model
                tokenizer = self._guided_tok = GuidedTokenizer.from_hf(
                    model.hf_tokenizer,
                    vocab_size=model.vocab_size,
                    eos_token_ids=sorted(model.eos_token_ids),
                )
        return tokenizer

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


def _with_warnings(event: OutputEvent, warnings: tuple[str, ...]) -> OutputEvent:
    if isinstance(event, Finished):
        return dataclasses.replace(event, warnings=event.warnings + warnings)
    return event


def _unsigned_seed(sampling: SamplingParams) -> SamplingParams:
    """mlx seeds are unsigned 64-bit integers; any integer a client sends maps onto one."""
    if sampling.seed is None or 0 <= sampling.seed < 2**64:
        return sampling
    return dataclasses.replace(sampling, seed=sampling.seed % 2**64)
