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


class FinishReason(str, Enum):
    EOS = "eos"
    STOP_SEQUENCE = "stop_sequence"
    STOP_TOKEN = "stop_token"
    LENGTH = "length"
    GRAMMAR_COMPLETE = "grammar_complete"
    CANCELLED = "cancelled"


class ErrorKind(str, Enum):
    INVALID_REQUEST = "invalid_request"
    NOT_FOUND = "not_found"
    CONTEXT_LENGTH = "context_length"
    OVERLOADED = "overloaded"
    UNAUTHORIZED = "unauthorized"
    INTERNAL = "internal"


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    reasoning: str | None = None  # prior assistant reasoning, for templates that keep it


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
class GenerationRequest:
    request_id: str
    model: str
    prompt: Prompt
    sampling: SamplingParams = SamplingParams()
    stop: StopSpec = StopSpec()
    reasoning: ReasoningSpec = ReasoningSpec()
    guided: GuidedSpec | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TextDelta:
    channel: Channel
    text: str


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    usage: Usage
    stop: str | int | None = None  # the stop string the user gave, or the stop token id


@dataclass(frozen=True)
class Failed:
    kind: ErrorKind
    message: str
    param: str | None = None  # the request field at fault, when one is


OutputEvent = Union[TextDelta, Finished, Failed]
TerminalEvent = Union[Finished, Failed]


def is_terminal(event: OutputEvent) -> bool:
    return isinstance(event, (Finished, Failed))
