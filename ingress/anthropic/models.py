"""Wire models for the Anthropic Messages API request side.

What pydantic can check lives here, so malformed input is a 400 before any work. Rules that
span fields or messages (role order, prefill, unsupported block types) live in `convert.py`.
Unknown fields are ignored, as Anthropic does, so newer clients keep working.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Wire):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Wire):
    """Reasoning from an earlier assistant turn, sent back by the client."""

    type: Literal["thinking"]
    thinking: str
    signature: str = ""  # Anthropic signs its thinking; this server has nothing to verify


class OtherBlock(_Wire):
    """Any other block type (image, document, tool_use, ...).

    Parsed rather than rejected here so `convert.py` can answer with a 400 that names the
    type, instead of a union error listing every type this server does not support.
    """

    type: str


def _block_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("text", "thinking") else "other"


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[OtherBlock, Tag("other")],
    Discriminator(_block_kind),
]


def _text_as_blocks(value: Any) -> Any:
    """Anthropic accepts a plain string wherever a list of text blocks is allowed.

    Normalising here keeps one code path and keeps error locations free of union member
    names. An empty string means "no blocks", so it meets the same emptiness rules.
    """
    if isinstance(value, str):
        return [{"type": "text", "text": value}] if value else []
    return value


class Message(_Wire):
    role: Literal["user", "assistant"]
    content: list[ContentBlock]

    _content_blocks = field_validator("content", mode="before")(_text_as_blocks)


class ThinkingEnabled(_Wire):
    type: Literal["enabled"]
    # Anthropic's service requires >= 1024; local models have no such floor.
    budget_tokens: int = Field(ge=1)


class ThinkingAdaptive(_Wire):
    """The model decides whether to think, within the served model's default budget."""

    type: Literal["adaptive"]


class ThinkingDisabled(_Wire):
    type: Literal["disabled"]


Thinking = Annotated[
    ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")
]


class Metadata(_Wire):
    """Validated for shape like Anthropic does; never used and never logged."""

    user_id: str | None = None


class CountTokensRequest(_Wire):
    """`POST /v1/messages/count_tokens`: the prompt-shaping part of a messages request."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: list[TextBlock] = []
    thinking: Thinking | None = None
    # Declared only so a request that relies on tools gets a clear 400 (see convert.py)
    # rather than a silent answer without them.
    tools: list[dict[str, Any]] | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system_blocks(cls, value: Any) -> Any:
        return [] if value is None else _text_as_blocks(value)


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None


def anthropic_validation_message(exc: RequestValidationError) -> str:
    """One line naming every offending field, in Anthropic's `path: problem` style.

    For the app's RequestValidationError handler on `/v1/messages*`, which should answer
    400 `invalid_request_error` (Anthropic never answers 422). Paths are dotted with list
    indexes (`messages.0.content.1.text.text`); FastAPI's leading `body` is dropped.
    """
    problems = []
    for error in exc.errors():
        if error["type"] == "json_invalid":
            problems.append("request body is not valid JSON")
            continue
        loc = [str(part) for part in error["loc"]]
        path = ".".join(loc[1:] if loc[:1] == ["body"] else loc)
        problems.append(f"{path}: {error['msg']}" if path else f"request body: {error['msg']}")
    return "; ".join(problems)
