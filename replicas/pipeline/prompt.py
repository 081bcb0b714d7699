"""Prompt rendering: chat messages through the model's own chat template, or raw text/ids."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from replicas.contract import (
    ChatMessage,
    ChatPrompt,
    ImageData,
    Prompt,
    ReasoningSpec,
    TextPrompt,
    TokenPrompt,
    ToolSpec,
)
from replicas.engine.request import PromptEmbeddings, common_prefix
from replicas.errors import InvalidRequestError


@dataclass(frozen=True)
class RenderedPrompt:
    token_ids: tuple[int, ...]
    text: str  # the template output; the channel router reads its tail
    embeddings: PromptEmbeddings | None = None  # a prompt with images: its start's


class Seer(Protocol):
    """A model that sees (`replicas.vision.VisionModel`): the template's text and the
    images it places, tokenized by the model's processor."""

    def prompt(self, text: str, images: Sequence[ImageData]) -> RenderedPrompt: ...


def render_prompt(
    hf_tokenizer: Any,
    prompt: Prompt,
    reasoning: ReasoningSpec,
    vocab_size: int,
    tools: tuple[ToolSpec, ...] = (),
    seer: Seer | None = None,
) -> RenderedPrompt:
    if isinstance(prompt, ChatPrompt):
        text = render_chat_text(hf_tokenizer, prompt, reasoning, tools)
        images = [at.image for m in prompt.messages for at in m.images]
        if images:
            if seer is None:
                raise InvalidRequestError("this model reads text only; it takes no images",
                                          param="messages")
            return seer.prompt(encodable(text, "messages"), images)
        ids = hf_tokenizer.encode(encodable(text, "messages"), add_special_tokens=False)
    elif isinstance(prompt, TextPrompt):
        text = prompt.text
        ids = hf_tokenizer.encode(encodable(text, "prompt"))
    elif isinstance(prompt, TokenPrompt):
        ids = list(prompt.token_ids)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                param="prompt",
            )
        text = hf_tokenizer.decode(ids, skip_special_tokens=False)
    else:  # pragma: no cover - the union is closed
        raise InvalidRequestError(f"unsupported prompt type {type(prompt).__name__}")
    if not ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    return RenderedPrompt(tuple(ids), text)


def last_message_boundary(hf_tokenizer: Any, prompt: Prompt, reasoning: ReasoningSpec,
                          ids: tuple[int, ...], tools: tuple[ToolSpec, ...] = ()) -> int:
    """Prompt tokens before a chat's last message, or 0 (not a chat, one message, or no
    shared start). The prefix cache keeps the KV there, so a retry or an edit of the last
    message still reuses all before it. Costs one more render of the template."""
    if not isinstance(prompt, ChatPrompt) or len(prompt.messages) < 2:
        return 0
    try:
        text = render_chat_text(hf_tokenizer, ChatPrompt(prompt.messages[:-1]), reasoning, tools)
        before = hf_tokenizer.encode(text, add_special_tokens=False)
    except Exception:  # noqa: BLE001 - a template that refuses the shorter chat: no boundary
        return 0
    # The longest common start: the shorter chat may render its end differently.
    return common_prefix(before, ids)


def encodable(text: str, param: str) -> str:
    """`text`, or a 400 for text no tokenizer can take: JSON may carry a lone UTF-16
    surrogate (`"\\ud800"`), which Python accepts and the Rust tokenizer refuses."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"`{param}` holds a lone UTF-16 surrogate (character {exc.start} of the rendered "
            "prompt); send valid Unicode", param=param) from None
    return text


def render_chat_text(
    hf_tokenizer: Any, prompt: ChatPrompt, reasoning: ReasoningSpec,
    tools: tuple[ToolSpec, ...] = (),
) -> str:
    if getattr(hf_tokenizer, "chat_template", None) is None:
        raise InvalidRequestError(
            "this model has no chat template; use /v1/completions", param="messages"
        )
    messages = [template_message(m) for m in prompt.messages]
    # A trailing assistant message is a prefill: the model continues it.
    prefill = bool(messages) and messages[-1]["role"] == "assistant"
    kwargs = dict(reasoning.template_kwargs)
    if reasoning.enabled is not None:
        kwargs["enable_thinking"] = reasoning.enabled
    if reasoning.effort is not None:
        kwargs["reasoning_effort"] = reasoning.effort
    # Only when there are tools: templates test `tools is defined` as well as truthiness.
    if tools:
        kwargs["tools"] = [template_tool(t) for t in tools]
    try:
        return str(
            hf_tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=not prefill,
                continue_final_message=prefill,
                **kwargs,
            )
        )
    except Exception as exc:  # jinja raises for e.g. roles that do not alternate
        raise InvalidRequestError(f"the chat template rejected the messages: {exc}",
                                  param="messages") from exc


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message in the shape transformers' chat templates take (as in its docs:
    call arguments as a dict, tool results with their call id and tool name)."""
    entry: dict[str, Any] = {"role": message.role, "content": _content(message)}
    if message.reasoning:
        entry["reasoning_content"] = message.reasoning
    if message.tool_calls:
        entry["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments(call.arguments)},
            }
            for call in message.tool_calls
        ]
    # Set only when known: templates test these with `is defined`.
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        entry["name"] = message.name
    return entry


def _content(message: ChatMessage) -> str | list[dict[str, str]]:
    """The text, or with images the parts transformers' templates take: text parts and an
    image part where each image stands."""
    if not message.images:
        return message.content
    parts: list[dict[str, str]] = []
    start = 0
    for at in message.images:
        if at.offset > start:
            parts.append({"type": "text", "text": message.content[start:at.offset]})
        parts.append({"type": "image"})
        start = max(start, at.offset)
    if start < len(message.content):
        parts.append({"type": "text", "text": message.content[start:]})
    return parts


def template_tool(tool: ToolSpec) -> dict[str, Any]:
    """A tool as transformers passes it to templates: an OpenAI function tool."""
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    try:
        function["parameters"] = json.loads(tool.parameters)
    except ValueError as exc:
        raise InvalidRequestError(
            f"tool {tool.name!r}: parameters is not valid JSON: {exc}", param="tools"
        ) from exc
    return {"type": "function", "function": function}


def _arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidRequestError(
            f"tool call arguments must be a JSON object, got {text[:80]!r}", param="messages"
        )
    return value
