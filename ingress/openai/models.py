"""OpenAI wire models (and the vLLM-style extensions Orchard accepts)."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ingress.effort import Effort
from ingress.images import ImageSource
from ingress.media import Content, MediaParts


class _Wire(BaseModel):
    # Unknown fields are ignored, as vLLM does, so newer SDKs keep working.
    model_config = ConfigDict(extra="ignore")


class TextPart(_Wire):
    type: Literal["text"]
    text: str


class ImageUrl(_Wire):
    url: str  # a base64 `data:` URL, or an http(s) one
    detail: str | None = None  # OpenAI's resolution hint; the model's processor decides


class MediaPart(_Wire):
    """An image, audio or file part: an image for a model that sees, else a placeholder
    (`ingress/media.py`)."""

    type: Literal["image_url", "input_audio", "file"]
    image_url: ImageUrl | None = None

    def source(self) -> ImageSource:
        return ImageSource(url=self.image_url.url if self.image_url else None)


class FunctionCallIn(_Wire):
    name: str
    arguments: str  # JSON text of an object, checked in tools.py


class ToolCallIn(_Wire):
    """A call from an earlier assistant turn, as the client sends it back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[Union[TextPart, MediaPart]], None] = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns
    name: str | None = None

    def content_of(self, media: MediaParts, where: str) -> Content:
        """The content's text and images; what `media` cannot pass on is a placeholder."""
        if self.content is None or isinstance(self.content, str):
            return Content(self.content or "")
        return Content.join(Content(part.text) if isinstance(part, TextPart)
                            else media.replace(part.type, f"{where}.{position}", part.source())
                            or Content()
                            for position, part in enumerate(self.content))


class FunctionDef(_Wire):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Wire):
    # Any type parses, so tools.py can answer a hosted tool (web_search, ...) with a 400
    # that names it rather than a union error.
    type: str
    function: FunctionDef | None = None


class NamedFunction(_Wire):
    name: str


class NamedToolChoice(_Wire):
    type: Literal["function"]
    function: NamedFunction


ToolChoiceField = Union[Literal["none", "auto", "required"], NamedToolChoice, None]


class StreamOptions(_Wire):
    include_usage: bool = False


class JsonSchemaFormat(_Wire):
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Wire):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


StopField = Union[str, list[str], None]


class SamplingFields(_Wire):
    """Fields shared by chat and completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=8)  # ingress/openai/choices.py: MAX_CHOICES
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopField = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM-style extensions
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    stop_token_ids: list[int] | None = None
    # vLLM's: lower runs sooner. Orchard's tenants may only lower their own (a higher value).
    priority: int | None = None
    include_stop_str_in_output: bool = False
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops_are_non_empty(cls, value: StopField) -> StopField:
        stops = [value] if isinstance(value, str) else (value or [])
        if any(stop == "" for stop in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: ResponseFormat | None = None
    reasoning_effort: Effort | None = None  # mapped as the Responses API maps it
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_budget: int | None = Field(default=None, ge=1)
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoiceField = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # Sends a conversation's turns to one replica, whose prefix cache holds it.
    prompt_cache_key: str | None = None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
