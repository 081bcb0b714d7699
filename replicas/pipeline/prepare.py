"""Request preparation (the counterpart of vLLM's input processor): a `GenerationRequest`
becomes an `EngineRequest` (token ids and how to pick each token) and the
`OutputProcessor` that turns its tokens into events.

Everything that can reject a request runs here, in a worker thread, before the request
reaches the engine: sampling values, stops (merged with the model's defaults), the prompt
through the chat template, max_tokens against the context, the channel and tool formats,
the grammar. Bad input is a 4xx with no engine time spent, and nothing a client sends can
wedge the batch.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
import time
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from replicas.contract import Channel, ChatPrompt, GenerationRequest, SamplingParams, TextPrompt
from replicas.pipeline.control import Grammar, RequestController
from replicas.engine.delivery import EventSink
from replicas.engine.request import EngineRequest
from replicas.errors import ContextLengthError, InvalidRequestError
from replicas.pipeline.logprob_trail import LogprobTrail, TokenPieces
from replicas.options import ReplicaOptions
from replicas.families.channel_format import ChannelFormat
from replicas.families.registry import get_channel_format
from replicas.families.tool_format import ToolFormat
from replicas.pipeline.channels import initial_channel, initial_state
from replicas.pipeline.decoding import RequestDecoder
from replicas.pipeline.output import OutputProcessor
from replicas.pipeline.tracker import ChannelTracker
from replicas.pipeline.detokenizer import Decode
from replicas.pipeline.stops import merge_stops
from replicas.pipeline.compose import with_tools, without_calls
from replicas.pipeline.prompt import RenderedPrompt, Seer, last_message_boundary, render_prompt
from replicas.engine.sampling.samplers import validate as validate_sampling
from replicas.timings import Timings
from replicas.pipeline.tool_plan import ToolPlan, plan_tools

if TYPE_CHECKING:  # imported on first guided request: llguidance is only loaded when used
    from replicas.pipeline.guided import GuidedTokenizer


@dataclass(frozen=True)
class Prepared:
    """A request ready for the engine: what it decodes, who reads its tokens, and the
    warnings its response carries."""

    request: EngineRequest
    output: OutputProcessor
    warnings: tuple[str, ...]


class TokenizedModel(Protocol):
    """What preparing a request reads of the loaded model (`replicas.engine.model.loading.
    LoadedModel` is one); a protocol so the pipeline need not import the model stack."""

    @property
    def hf_tokenizer(self) -> Any: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> frozenset[int]: ...


class InputProcessor:
    """Prepares requests for one loaded model; thread-safe (requests prepare in parallel)."""

    def __init__(self, options: ReplicaOptions, model: TokenizedModel, decode: Decode,
                 channels: ChannelFormat, tools: ToolFormat, context_length: int,
                 timings: Timings, kv_max_tokens: int | None = None,
                 seer: Seer | None = None) -> None:
        self._options = options
        self._seer = seer  # a model that sees: prompts with images go through it
        self.model = model
        self._decode = decode
        self._channels = channels
        self._tools = tools
        self._context_length = context_length
        self._kv_max_tokens = kv_max_tokens if kv_max_tokens is not None else context_length
        self._timings = timings
        self._guided_lock = threading.Lock()
        self._guided_tok: GuidedTokenizer | None = None
        self._pieces = TokenPieces(decode)  # token texts for logprobs, shared by requests

    def render(self, request: GenerationRequest) -> RenderedPrompt:
        model = self.model
        return render_prompt(model.hf_tokenizer, request.prompt, request.reasoning, model.vocab_size,
                             tools=request.tools, seer=self._seer)

    def prepare(self, request: GenerationRequest, sink: EventSink) -> Prepared:
        """The request as the engine runs it, its output side, and warnings for its
        response; raises a `ReplicaError` (a 4xx) for anything the request asks that cannot
        be served."""
        model = self.model
        validate_sampling(request.sampling, model.vocab_size)
        stops = self._stops(request)
        rendered = self.render(request)
        max_tokens, clamp_warning = self._max_tokens(request, len(rendered.token_ids))
        # Completions are raw continuations: channels and tool calls only apply to chat.
        chat = isinstance(request.prompt, ChatPrompt)
        base = self._channels if chat else get_channel_format("none")
        initial = initial_channel(base, rendered.text)
        state = initial_state(base, rendered.text)
        tools = self._tool_plan(request, chat)
        if tools.parsing is not None:
            fmt = with_tools(base, tools.parsing.format)
        elif tools.suppressed is not None:  # `tool_choice: none`: no marker reaches the answer
            fmt = without_calls(base, tools.suppressed)
        else:
            fmt = base
        if tools.grammar is not None:
            grammar: Grammar | None = self._matcher(tools.grammar)
        elif request.guided is not None:
            from replicas.pipeline.guided import compile_guided

            grammar = self._matcher(compile_guided(request.guided))
        else:
            grammar = None
        # A response_format grammar decides where the text ends, beside tools too; a tool
        # grammar alone leaves the text before a call free, so stops still apply to it.
        text_grammar = grammar is not None and (tools.grammar is None or tools.owns_answer)
        stop_ids = frozenset() if text_grammar else frozenset(request.stop.token_ids)
        # One detokenizer and router for the decoder and the controller.
        tracker = ChannelTracker(self._decode, fmt, initial, state)
        decoder = RequestDecoder(
            self._decode,
            fmt,
            initial,
            state,
            stops=() if text_grammar else stops,
            include_stop=request.stop.include_in_output,
            prompt_tokens=len(rendered.token_ids),
            tools=tools.parsing,
            tracker=tracker,
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
                tracker=tracker,
                end_ids=model.eos_token_ids | stop_ids,
            )
        top = request.sampling.logprobs
        echo = self._echo(request, rendered.token_ids)
        resume = request.resume or ()
        if len(resume) >= max_tokens:  # it would have ended, and its end been sent, before
            raise InvalidRequestError("a resumed request has no tokens left to generate",
                                      param="resume")
        engine_request = EngineRequest(
            request_id=request.request_id,
            prompt_ids=tuple(rendered.token_ids) + resume,
            max_tokens=max_tokens - len(resume),
            sampled_before=len(resume),
            sampling=_unsigned_seed(request.sampling),
            stop_token_ids=stop_ids,
            # With images the ids are the processor's, which a text render cannot match.
            boundary=last_message_boundary(model.hf_tokenizer, request.prompt, request.reasoning,
                                           rendered.token_ids, request.tools)
            if self._options.engine.prompt_cache_bytes and rendered.embeddings is None else 0,
            logits_processors=(controller,) if controller is not None else (),
            logprobs=top,
            score_prompt=echo is not None and top is not None and request.resume is None,
            embeddings=rendered.embeddings,
            tenancy=request.tenancy,
            adapter=request.adapter,
        )
        output = OutputProcessor(
            sink, decoder, controller, prompt_ids=rendered.token_ids,
            stop_token_ids=stop_ids, echo=echo, report_tokens=request.report_tokens,
            logprobs=None if top is None else LogprobTrail(top, self._pieces))
        if request.resume is not None:
            output.replay(resume, request.resume_logprobs)
        warnings = ((clamp_warning,) if clamp_warning else ()) + tools.warnings
        return Prepared(engine_request, output, warnings)

    def _echo(self, request: GenerationRequest, prompt_ids: Sequence[int]) -> str | None:
        """The prompt as the client wrote it (its tokens' text for a token prompt)."""
        if not request.echo:
            return None
        if isinstance(request.prompt, ChatPrompt):
            raise InvalidRequestError("echo applies to completions prompts only", param="echo")
        if isinstance(request.prompt, TextPrompt):
            return request.prompt.text
        return self._decode(list(prompt_ids))

    def _stops(self, request: GenerationRequest) -> tuple[str, ...]:
        for stop in request.stop.strings:
            if not isinstance(stop, str) or not stop:
                raise InvalidRequestError("stop strings must be non-empty strings", param="stop")
        stops = merge_stops(self._options.default_stops, request.stop.strings)
        if len(stops) > self._options.max_stops:
            raise InvalidRequestError(
                f"at most {self._options.max_stops} stop sequences are allowed "
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
        # The replica's KV memory budget caps a request like the context does: one that
        # could not fit even alone would wait forever (`replicas.engine.kv.budget`).
        context = min(self._context_length, self._kv_max_tokens)
        by_context = context == self._context_length
        what = (f"this model's maximum context length is {context} tokens" if by_context
                else f"this replica's KV memory budget holds at most {context} tokens")
        room = context - prompt_tokens
        wanted = request.sampling.max_tokens
        if wanted is not None and wanted < 1:
            raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
        if room < 1 or (wanted is not None and wanted > room
                        and self._options.max_tokens_past_context == "reject"):
            raise ContextLengthError(
                f"{what}; the prompt has {prompt_tokens} tokens and max_tokens asks for "
                f"{wanted or 1} more", param="max_tokens")
        if wanted is not None and wanted > room:
            where = f"of this model's {context}-token context" if by_context else \
                f"and {what}"
            return room, (f"max_tokens lowered from {wanted} to {room}: the prompt has "
                          f"{prompt_tokens} tokens {where}")
        return (wanted if wanted is not None else room), None

    def _budget(self, request: GenerationRequest) -> int | None:
        if request.reasoning.enabled is False or not self._channels.reasoning_end:
            return None
        budget = request.reasoning.budget_tokens
        if budget is None:
            budget = self._options.thinking_budget
        if budget is not None and budget < 1:
            raise InvalidRequestError("the thinking budget must be at least 1 token",
                                      param="thinking_budget")
        return budget

    def _tool_plan(self, request: GenerationRequest, chat: bool) -> ToolPlan:
        if request.tools and not chat:
            raise InvalidRequestError("tools need a chat request", param="tools")
        return plan_tools(request, self._tools, self._guided_tokenizer, self._encode)

    def _matcher(self, grammar: str) -> Grammar:
        from replicas.pipeline.guided import GuidedMatcher

        tokenizer = self._guided_tokenizer()  # built once: not part of a compile
        started = time.perf_counter()
        matcher = GuidedMatcher(tokenizer, grammar)
        self._timings.grammar_compiled(time.perf_counter() - started)
        return matcher

    def _guided_tokenizer(self) -> GuidedTokenizer:
        from replicas.pipeline.guided import GuidedTokenizer

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


def _unsigned_seed(sampling: SamplingParams) -> SamplingParams:
    """mlx seeds are unsigned 64-bit integers; any integer a client sends maps onto one."""
    if sampling.seed is None or 0 <= sampling.seed < 2**64:
        return sampling
    return dataclasses.replace(sampling, seed=sampling.seed % 2**64)
