"""Wire models for the Anthropic Messages API request side.

What pydantic can check lives here, so malformed input is a 400 before any work. Rules that
span fields or messages (role order, prefill, unsupported block types, tool ids) live in
`convert.py` and `tools.py`. Unknown fields (`cache_control`, `context_management`, betas'
additions) are ignored, as Anthropic does, so newer clients keep working.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from ingress.images import ImageSource


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


class ToolUseBlock(_Wire):
    """A call from an earlier assistant turn."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class OtherBlock(_Wire):
    """Any other block type (image, document, server tool blocks, ...).

    Parsed rather than rejected here: `convert.py` passes image blocks on to a model that
    sees, turns other image and document blocks into placeholders (`ingress/media.py`) and
    answers any other type with a 400 that names it, instead of a union error listing every
    type this server does not support.
    """

    type: str
    # Untyped: its shape differs by block type (a search_result's is a string), and a
    # placeholder must not fail on it; `image_source` reads an image's.
    source: Any = None

    def image_source(self) -> ImageSource:
        """An image block's `source` (base64, url or file) as the shared checker reads it."""
        source = self.source if isinstance(self.source, dict) else {}

        def field(name: str) -> str | None:
            value = source.get(name)
            return value if isinstance(value, str) else None

        kind = source.get("type")
        if kind == "base64":
            return ImageSource(data=field("data"), media_type=field("media_type"))
        if kind == "url":
            return ImageSource(url=field("url"))
        if kind == "file":
            return ImageSource(file_id=field("file_id") or "")
        return ImageSource()


def _block_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("text", "thinking", "tool_use", "tool_result") else "other"


def _result_kind(value: Any) -> str:
    return "text" if _block_kind(value) == "text" else "other"


# What a tool_result may hold: text, or another type (an image, or its placeholder;
# tools.py names any type that is not media in its 400).
ResultBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[OtherBlock, Tag("other")],
    Discriminator(_result_kind),
]


def _text_as_blocks(value: Any) -> Any:
    """Anthropic accepts a plain string wherever a list of text blocks is allowed.

    Normalising here keeps one code path and keeps error locations free of union member
    names. An empty string means "no blocks", so it meets the same emptiness rules.
    """
    if isinstance(value, str):
        return [{"type": "text", "text": value}] if value else []
    return value


class ToolResultBlock(_Wire):
    """A tool's output, in the user message after the assistant's call."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: list[ResultBlock] = []
    is_error: bool = False

    @field_validator("content", mode="before")
    @classmethod
    def _content_blocks(cls, value: Any) -> Any:
        return [] if value is None else _text_as_blocks(value)  # a result may have no content


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[OtherBlock, Tag("other")],
    Discriminator(_block_kind),
]


class Message(_Wire):
    # "system" inside `messages` is what current clients (Claude Code 2.x) send.
    role: Literal["user", "assistant", "system"]
    content: list[ContentBlock]

    _content_blocks = field_validator("content", mode="before")(_text_as_blocks)


class Tool(_Wire):
    """A tool definition. Server tools (`web_search_20250305`, ...) parse too, so
    `tools.py` can name them in its 400; custom tools have no type or `custom`."""

    type: str | None = None
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceAuto(_Wire):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Wire):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Wire):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Wire):
    type: Literal["none"]


ToolChoiceIn = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")
]


# "summarized" (the default) shows the reasoning, "omitted" sends thinking blocks with empty
# text. Any other value is accepted and shows it, so a newer client is never refused.
ThinkingDisplay = str | None


class ThinkingEnabled(_Wire):
    type: Literal["enabled"]
    # Anthropic's service requires >= 1024; local models have no such floor.
    budget_tokens: int = Field(ge=1)
    display: ThinkingDisplay = None


class ThinkingAdaptive(_Wire):
    """The model decides whether to think, within a budget set by `output_config.effort`
    or else the served model's default."""

    type: Literal["adaptive"]
    display: ThinkingDisplay = None


class ThinkingDisabled(_Wire):
    type: Literal["disabled"]


Thinking = Annotated[
    ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")
]


class Metadata(_Wire):
    """Validated for shape like Anthropic does; `user_id` only keys cache-aware routing
    (a conversation's turns go to one replica) and is never logged."""

    user_id: str | None = None


Effort = Literal["low", "medium", "high", "xhigh", "max"]


class OutputConfig(_Wire):
    effort: Effort | None = None


class CountTokensRequest(_Wire):
    """`POST /v1/messages/count_tokens`: the prompt-shaping part of a messages request."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: list[TextBlock] = []
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceIn | None = None
    # Accepted and ignored: this server keeps no state between requests to edit.
    context_management: dict[str, Any] | None = None

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
