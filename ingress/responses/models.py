"""OpenAI Responses API wire models (`POST /v1/responses`).

Unknown fields are ignored, so newer SDKs and clients such as Codex CLI keep working.
Item and tool types this server does not model are parsed loosely (`OtherItem`,
`HostedTool`) so `convert.py` can answer with a 400 that names the type, or leave a hosted
tool out with a warning, instead of failing on a union error.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from ingress.effort import Effort
from ingress.images import ImageSource


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Wire):
    """Text in a message: `input_text` from the user, `output_text` from an earlier reply."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class OtherPart(_Wire):
    """Images (for a model that sees) and files (placeholders, `ingress/media.py`),
    refusals...: convert.py answers any type that is not media with a 400 naming it."""

    type: str
    # An input_image's (and input_file's `file_id`). Kept as fields, not ignored, so a
    # stored response's input carries its images into the next turn's history.
    image_url: str | None = None  # a base64 `data:` URL, or an http(s) one
    file_id: str | None = None
    detail: str | None = None  # OpenAI's resolution hint; the model's processor decides

    def source(self) -> ImageSource:
        return ImageSource(url=self.image_url, file_id=self.file_id)


def _part_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "text" if kind in ("input_text", "output_text", "text") else "other"


Part = Annotated[
    Annotated[TextPart, Tag("text")] | Annotated[OtherPart, Tag("other")],
    Discriminator(_part_kind),
]


def _text_as_parts(value: Any) -> Any:
    """A plain string is one text part: one code path, and errors name no union branch."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


class MessageItem(_Wire):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[Part]

    _content_parts = field_validator("content", mode="before")(_text_as_parts)


class FunctionCallItem(_Wire):
    """A call the assistant made earlier; `call_id` is passed back to the model unchanged."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = "{}"


class FunctionCallOutputItem(_Wire):
    type: Literal["function_call_output"]
    call_id: str
    output: list[Part]

    _output_parts = field_validator("output", mode="before")(_text_as_parts)


class ReasoningText(_Wire):
    type: str = "reasoning_text"  # `summary_text` in summaries
    text: str


class ReasoningItem(_Wire):
    """Earlier reasoning; its text becomes the next assistant turn's reasoning."""

    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None


class OtherItem(_Wire):
    type: str


def _item_kind(value: Any) -> str:
    if isinstance(value, dict):
        kind = value.get("type")
        # An "easy input message" has a role and no type.
        if kind is None and "role" in value:
            return "message"
    else:
        kind = getattr(value, "type", None)
    known = ("message", "function_call", "function_call_output", "reasoning")
    return kind if kind in known else "other"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_kind),
]


class FunctionTool(_Wire):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # omitted: best effort (convert.py), only true is strict


class HostedTool(_Wire):
    """A tool OpenAI runs itself (web_search, file_search, mcp, ...): left out here."""

    type: str


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "function" if kind == "function" else "hosted"


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[HostedTool, Tag("hosted")],
    Discriminator(_tool_kind),
]


class NamedToolChoice(_Wire):
    type: str  # "function" names one of the tools; hosted types are refused
    name: str | None = None


ToolChoiceField = Union[Literal["auto", "none", "required"], NamedToolChoice]


class TextFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Wire):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(_Wire):
    effort: Effort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Wire):
    model: str
    input: list[InputItem] = []  # a string is one user message
    instructions: str | None = None
    tools: list[Tool] = []
    tool_choice: ToolChoiceField = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    background: bool = False
    # "message.output_text.logprobs" asks for the answer's token logprobs (so does
    # `top_logprobs`); the other values name hosted tools' outputs and are ignored.
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    prompt_cache_key: str | None = None
    client_metadata: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_items(cls, value: Any) -> Any:
        return [{"type": "message", "role": "user", "content": value}] if isinstance(
            value, str) else value
