"""The replica contract: what the ingress sends a replica and what comes back.

Plain frozen dataclasses with no MLX imports, so they pickle across Ray handles and the
ingress can build and read them without the model stack installed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, Mapping, Union


class Channel(str, Enum):
    REASONING = "reasoning"
    ANSWER = "answer"
    # The body of a tool call as the model writes it (markers removed). Only the replica's
    # pipeline sees this channel: it leaves as ToolCall* events, never as TextDelta.
    TOOL = "tool"


class FinishReason(str, Enum):
    EOS = "eos"
    STOP_SEQUENCE = "stop_sequence"
    STOP_TOKEN = "stop_token"
    LENGTH = "length"
    GRAMMAR_COMPLETE = "grammar_complete"
    CANCELLED = "cancelled"
    TOOL_CALLS = "tool_calls"  # the turn ended with one or more tool calls


class ErrorKind(str, Enum):
    INVALID_REQUEST = "invalid_request"
    NOT_FOUND = "not_found"
    CONTEXT_LENGTH = "context_length"
    OVERLOADED = "overloaded"
    UNAUTHORIZED = "unauthorized"
    RATE_LIMITED = "rate_limited"  # past a tenant's limit at the edge: 429
    TIMEOUT = "timeout"
    INTERNAL = "internal"


@dataclass(frozen=True)
class ToolCall:
    """A call the assistant made in an earlier turn, as the client sends it back."""

    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class ImageData:
    """An image as the client sent it (inline, or fetched by the ingress where config
    allows), checked by the ingress against the configured limits: its encoded bytes."""

    data: bytes
    media_type: str  # "image/png" | "image/jpeg" | "image/webp" | "image/gif"


@dataclass(frozen=True)
class ImageAt:
    """An image inside a message: it stands before character `offset` of the content."""

    offset: int
    image: ImageData


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    # Images among the text, in order, for a model that sees (`capabilities` has "vision");
    # a text-only model gets placeholders in `content` instead (ingress/media.py).
    images: tuple[ImageAt, ...] = ()
    reasoning: str | None = None  # prior assistant reasoning, for templates that keep it
    tool_calls: tuple[ToolCall, ...] = ()  # assistant turns: the calls it made
    tool_call_id: str | None = None  # tool turns: the call this is the result of
    name: str | None = None  # tool turns: the called tool's name


@dataclass(frozen=True)
class ChatPrompt:
    messages: tuple[ChatMessage, ...]


@dataclass(frozen=True)
class TextPrompt:
    text: str


@dataclass(frozen=True)
class TokenPrompt:
    token_ids: tuple[int, ...]


Prompt = Union[ChatPrompt, TextPrompt, TokenPrompt]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling knobs; defaults follow the OpenAI API (temperature 1, nucleus off)."""

    max_tokens: int | None = None  # None: up to the model's context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    # None: no logprobs; k: each generated token's logprob and the k most likely (0..20).
    logprobs: int | None = None


@dataclass(frozen=True)
class StopSpec:
    """Stops apply to the answer channel; `strings` match decoded text, never token ids."""

    strings: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()
    include_in_output: bool = False


@dataclass(frozen=True)
class ReasoningSpec:
    enabled: bool | None = None  # None: the template's default
    budget_tokens: int | None = None  # None: the model's default budget (if any)
    effort: str | None = None  # OpenAI reasoning_effort, passed to the template
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)


GuidedKind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class GuidedSpec:
    """A constraint on the answer text.

    `value` is the JSON schema text (json_schema), the pattern (regex), the Lark grammar
    (grammar), the choices (choice) or None (json_object).
    """

    kind: GuidedKind
    value: str | tuple[str, ...] | None = None
    strict: bool = True


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call. `parameters` is a JSON schema as JSON text."""

    name: str
    description: str | None = None
    parameters: str = '{"type": "object"}'
    strict: bool = False  # OpenAI `strict`: the schema must be fully enforceable


ToolChoiceMode = Literal["auto", "none", "required"]


@dataclass(frozen=True)
class ToolChoice:
    """`auto`: text, calls or both; `none`: never a call; `required`: at least one call,
    to `name` only when set. `parallel`: more than one call per turn is allowed."""

    mode: ToolChoiceMode = "auto"
    name: str | None = None
    parallel: bool = True


@dataclass(frozen=True)
class Tenancy:
    """Whom a request is for, as the edge resolved its API key (`ingress/tenancy/`). The
    replica admits to the batch by weighted fair queuing over tenants by `share`, and by
    `priority` within a tenant (lower first, vLLM's convention); preemption takes the highest
    `priority` value, youngest, first."""

    tenant: str = "default"
    priority: int = 0
    share: float = 1.0


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    model: str
    prompt: Prompt
    sampling: SamplingParams = SamplingParams()
    stop: StopSpec = StopSpec()
    reasoning: ReasoningSpec = ReasoningSpec()
    guided: GuidedSpec | None = None
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    # The client's session (OpenAI `prompt_cache_key`, Anthropic `metadata.user_id`): the
    # router sends its requests to one replica, whose prefix cache holds the conversation.
    session_key: str | None = None
    tenancy: Tenancy = Tenancy()  # the API key's tenant, and the priority the batch sees
    # Completions' `echo`: the prompt comes back as the answer's first text, with its own
    # tokens' logprobs when `sampling.logprobs` is set (one prefill scores them).
    echo: bool = False
    # The replica reports the token ids behind each batch of events (`TokenIds`), so the
    # client can resume the stream elsewhere if this replica dies (`resume`).
    report_tokens: bool = False
    # A resumed stream: the token ids the request generated and the client received before
    # its replica failed (maybe none: only the echo). The new replica prefills them after
    # the prompt, runs them through the pipeline without sending their events again, and
    # continues; None: a new request.
    resume: tuple[int, ...] | None = None
    # The logprob entries the failed replica still held at the cut (`TokenIds.held`): they
    # ride out with the resumed stream's first text, as they would have.
    resume_logprobs: tuple["TokenLogprob", ...] = ()
    # The model's LoRA adapter the request runs with (`model: "BASE:NAME"` or an alias of
    # the pair); None: the base model. Its KV is that adapter's alone.
    adapter: str | None = None


@dataclass(frozen=True)
class TokenizerInfo:
    """A model's tokenizer as clients that tokenize on their own need it (vLLM's
    `/tokenizer_info`: evaluation harnesses read it to pick a remote tokenizer)."""

    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int  # prompt plus output tokens one request may use
    vocab_size: int


# One input of `/v1/embeddings`: a text (tokenized by the replica) or token ids as sent.
EmbeddingInput = Union[str, tuple[int, ...]]


@dataclass(frozen=True)
class EmbeddingRequest:
    request_id: str
    model: str
    inputs: tuple[EmbeddingInput, ...]  # at least one, none empty (the ingress checks)
    # Matryoshka truncation: the first N values, re-normalized; only where the model's
    # config allows it (`embedding_dimensions`), else the replica answers 400.
    dimensions: int | None = None


@dataclass(frozen=True)
class EmbeddingResult:
    vectors: tuple[tuple[float, ...], ...]  # one per input, in order; float32 values
    prompt_tokens: int  # the inputs' tokens, special tokens the tokenizer added included


@dataclass(frozen=True)
class RerankRequest:
    request_id: str
    model: str
    query: str  # not empty (the ingress checks)
    documents: tuple[str, ...]  # at least one (the ingress checks)
    # Each document cut to its first N tokens before scoring; None: whole (past the
    # model's input length is a 400).
    max_tokens_per_doc: int | None = None
    # Qwen3-Reranker's `<Instruct>` line; None: its default (web search). Cross-encoders
    # have none and ignore it.
    instruction: str | None = None


@dataclass(frozen=True)
class RerankResult:
    scores: tuple[float, ...]  # one per document, in request order; 0..1
    prompt_tokens: int  # every scored pair's tokens, the template's included


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from a prefix cache
    preemptions: int = 0  # times the replica took it out of the batch for KV memory

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and its `top` alternatives (best first), from
    the distribution it was sampled from (after penalties, bias, masks and temperature)."""

    token: str  # the tokenizer's piece for the id
    token_id: int
    logprob: float | None  # None only for a prompt's first token (`echo`): nothing predicts it
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class TextDelta:
    channel: Channel
    text: str
    # The tokens this text came from, when the request asked for logprobs. A token whose
    # text is held back (a marker, a possible stop) rides with the next text, or with an
    # empty delta before `Finished`.
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call opens. `index` counts calls within this response from 0; `id` is unique
    per call (adapters add their protocol's prefix, e.g. `call_` or `toolu_`)."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of the call's arguments (JSON text); the pieces concatenate to the whole."""

    index: int
    arguments: str


@dataclass(frozen=True)
class ToolCallEnd:
    """The call is complete. `arguments` repeats the whole text the deltas added up to."""

    index: int
    arguments: str


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    usage: Usage
    stop: str | int | None = None  # the stop string the user gave, or the stop token id
    # What the server changed about the request, for the client to see (e.g. a max_tokens
    # lowered to fit the context); adapters put them in a top-level `orchard_warnings` field.
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Failed:
    kind: ErrorKind
    message: str
    param: str | None = None  # the request field at fault, when one is
    # The replica failed, not the request (its engine stopped, a shard was lost): the same
    # request may resume on another replica.
    replica_fault: bool = False


@dataclass(frozen=True)
class TokenIds:
    """The token ids behind the events before it in the same batch (only with
    `GenerationRequest.report_tokens`; model clients take it out, adapters never see it)."""

    ids: tuple[int, ...]
    # The logprob entries still held back after these tokens (their text is not sent yet,
    # e.g. a possible stop's prefix): a resume hands them to the next replica.
    held: tuple[TokenLogprob, ...] = ()


OutputEvent = Union[TextDelta, ToolCallStart, ToolCallDelta, ToolCallEnd, Finished, Failed,
                    TokenIds]
TerminalEvent = Union[Finished, Failed]


def is_terminal(event: OutputEvent) -> bool:
    return isinstance(event, (Finished, Failed))


def merge_deltas(events: list[OutputEvent]) -> list[OutputEvent]:
    """Adjacent text of one channel, and adjacent argument pieces of one call, as one event:
    a chunk that carries several tokens is rendered and sent as one delta, not one per
    token (the pieces still concatenate to the same whole). A batch's `TokenIds` go first,
    as one: a client receives a batch whole, so its ids and its events arrive together."""
    merged: list[OutputEvent] = []
    ids = tuple(i for e in events if isinstance(e, TokenIds) for i in e.ids)
    if ids:  # what is held after the batch is what its last token left held
        held = next(e.held for e in reversed(events) if isinstance(e, TokenIds))
        merged.append(TokenIds(ids, held))
        events = [e for e in events if not isinstance(e, TokenIds)]
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, TextDelta) and isinstance(last, TextDelta) \
                and last.channel == event.channel:
            merged[-1] = TextDelta(event.channel, last.text + event.text,
                                   last.logprobs + event.logprobs)
        elif isinstance(event, ToolCallDelta) and isinstance(last, ToolCallDelta) \
                and last.index == event.index:
            merged[-1] = ToolCallDelta(event.index, last.arguments + event.arguments)
        else:
            merged.append(event)
    return merged
