"""Anthropic Messages request -> GenerationRequest.

Checks the rules pydantic cannot express (role order, emptiness, prefill, block types) with
Anthropic's wording where the real API has one; every failure is a `ReplicaError`, which the
app renders as an Anthropic error body. Tool definitions and tool blocks are in `tools.py`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from ingress.anthropic.models import (
    ContentBlock,
    CountTokensRequest,
    Message,
    MessagesRequest,
    TextBlock,
    ThinkingAdaptive,
    ThinkingBlock,
    ThinkingEnabled,
    ToolResultBlock,
    ToolUseBlock,
)
from ingress.anthropic.tools import tool_call, tool_choice, tool_result, tool_specs
from ingress.client import ModelCard
from ingress.media import Content, MediaParts
from replicas.contract import (
    ChatMessage,
    ChatPrompt,
    GenerationRequest,
    ReasoningSpec,
    SamplingParams,
    StopSpec,
    ToolCall,
)
from replicas.errors import InvalidRequestError

# Consecutive same-role messages become one turn (as Anthropic documents); their texts are
# joined like paragraphs. Blocks inside one message are concatenated as-is, since clients
# split one text into blocks (e.g. for cache breakpoints) without meaning a separator.
TURN_SEPARATOR = "\n\n"

# `output_config.effort` as a thinking budget for adaptive thinking. Anthropic publishes no
# token numbers for its levels; these are ours: low 1024, medium 4096, high 16384,
# xhigh 32768, and max None, i.e. no cap but the served model's own default budget.
EFFORT_BUDGET: dict[str, int | None] = {
    "low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768, "max": None,
}
# Chat templates know OpenAI's three `reasoning_effort` levels; the two above "high" are "high".
TEMPLATE_EFFORT = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def to_generation_request(body: MessagesRequest, card: ModelCard,
                          media: MediaParts | None = None) -> GenerationRequest:
    """The request, its image and document blocks as `media` decides (none given:
    placeholders); where `media` reads images, await `media.resolve` on it before it goes
    anywhere."""
    thinking = body.thinking
    if isinstance(thinking, ThinkingEnabled) and thinking.budget_tokens >= body.max_tokens:
        raise InvalidRequestError(
            "`max_tokens` must be greater than `thinking.budget_tokens`", param="max_tokens"
        )
    tools = tool_specs(body.tools)
    return GenerationRequest(
        request_id=new_message_id(),
        model=card.id,
        prompt=to_prompt(body, MediaParts() if media is None else media),
        sampling=SamplingParams(
            max_tokens=body.max_tokens,
            # Anthropic's defaults: temperature 1.0, nucleus and top-k sampling off.
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
        ),
        stop=StopSpec(strings=tuple(body.stop_sequences or ())),
        reasoning=_reasoning(body),
        tools=tools,
        tool_choice=tool_choice(body.tool_choice, tools),
        session_key=body.metadata.user_id if body.metadata is not None else None,
    )


def to_count_request(body: CountTokensRequest, card: ModelCard) -> GenerationRequest:
    """The request whose prompt would be counted; thinking and tools change the template."""
    tools = tool_specs(body.tools)
    return GenerationRequest(
        request_id=new_message_id(),
        model=card.id,
        # Media as placeholders, whatever the model: a count is no reason to fetch and
        # decode images (a model that sees counts each as its placeholder's text).
        prompt=to_prompt(body, MediaParts()),
        reasoning=_reasoning(body),
        tools=tools,
        tool_choice=tool_choice(body.tool_choice, tools),
    )


def omits_thinking(body: CountTokensRequest) -> bool:
    """`thinking.display: "omitted"`: thinking blocks are sent with empty text, as Anthropic
    does (the model still reasons; only the text is withheld)."""
    thinking = body.thinking
    return isinstance(thinking, (ThinkingEnabled, ThinkingAdaptive)) and (
        thinking.display == "omitted")


def _reasoning(body: CountTokensRequest) -> ReasoningSpec:
    # Anthropic does not think unless asked, whatever the model's template would default to.
    effort = body.output_config.effort if body.output_config else None
    template_effort = TEMPLATE_EFFORT[effort] if effort else None
    if isinstance(body.thinking, ThinkingEnabled):  # an explicit budget beats the effort's
        return ReasoningSpec(enabled=True, budget_tokens=body.thinking.budget_tokens,
                             effort=template_effort)
    if isinstance(body.thinking, ThinkingAdaptive):
        budget = EFFORT_BUDGET[effort] if effort else None
        return ReasoningSpec(enabled=True, budget_tokens=budget, effort=template_effort)
    return ReasoningSpec(enabled=False, effort=template_effort)


@dataclass
class _Turn:
    role: str
    contents: list[Content] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    result: ChatMessage | None = None  # a tool turn: the message as is

    def message(self) -> ChatMessage:
        if self.result is not None:
            return self.result
        reasoning = TURN_SEPARATOR.join(self.reasoning) or None
        content = Content.join(self.contents, TURN_SEPARATOR)
        return ChatMessage(self.role, content.text, images=content.images,
                           reasoning=reasoning, tool_calls=tuple(self.calls))


@dataclass
class _Parts:
    """What one message holds, by kind."""

    content: Content = Content()
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    results: list[ChatMessage] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.content or self.reasoning or self.calls or self.results)


def to_prompt(body: CountTokensRequest, media: MediaParts) -> ChatPrompt:
    """System first, then one message per turn; each tool_result is a `tool` message.
    Image and document blocks are images or placeholders, as `media` decides.

    Leading `system` messages join the `system` prompt; later ones stay system turns. A final
    assistant message is a prefill: it stays the last message, and the replica continues that
    message instead of opening a new assistant turn.
    """
    leading = next((i for i, m in enumerate(body.messages) if m.role != "system"), None)
    if leading is None or body.messages[leading].role != "user":
        raise InvalidRequestError('messages: first message must use the "user" role')

    called: dict[str, str] = {}  # tool_use id -> tool name, for the results that follow
    last = len(body.messages) - 1
    turns: list[_Turn] = []
    for index, message in enumerate(body.messages):
        parts = _message_parts(message, f"messages.{index}", called, media)
        _check_content(parts, message.role, index, last)
        _add(turns, message.role, parts)

    messages = [turn.message() for turn in turns]
    system = [Content(_system_text(body.system))]
    if leading:  # the leading system messages, merged into one turn
        merged = messages.pop(0)
        system.append(Content(merged.content, merged.images))
    content = Content.join((part for part in system if part), TURN_SEPARATOR)
    if content:
        messages.insert(0, ChatMessage("system", content.text, images=content.images))
    return ChatPrompt(tuple(messages))


def _check_content(parts: _Parts, role: str, index: int, last: int) -> None:
    prefill = index == last and role == "assistant"
    if parts.empty() and not prefill:
        raise InvalidRequestError(
            f"messages.{index}: all messages must have non-empty content except for the "
            "optional final assistant message"
        )
    if prefill and not parts.calls and parts.content.text != parts.content.text.rstrip():
        raise InvalidRequestError(
            "messages: final assistant content cannot end with trailing whitespace"
        )


def _add(turns: list[_Turn], role: str, parts: _Parts) -> None:
    """Merges the message into the open turn of its role; tool results never merge."""
    turns.extend(_Turn("tool", result=result) for result in parts.results)
    if not (parts.content or parts.reasoning or parts.calls):
        return  # results only; or an empty final assistant message: no prefill to continue
    if not turns or turns[-1].role != role:
        turns.append(_Turn(role))
    turn = turns[-1]
    if parts.content:
        turn.contents.append(parts.content)
    if parts.reasoning:
        turn.reasoning.append(parts.reasoning)
    turn.calls.extend(parts.calls)


def _message_parts(message: Message, where: str, called: dict[str, str],
                   media: MediaParts) -> _Parts:
    parts = _Parts()
    contents: list[Content] = []
    thoughts: list[str] = []
    for position, block in enumerate(message.content):
        at = f"{where}.content.{position}"
        _check_role(block, message.role, at)
        if isinstance(block, TextBlock):
            contents.append(Content(_non_empty(block, at)))
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            parts.calls.append(tool_call(block))
        elif isinstance(block, ToolResultBlock):
            parts.results.append(tool_result(block, at, called, media))
        elif (content := media.replace(block.type, at, block.image_source())) is not None:
            contents.append(content)
        else:
            raise InvalidRequestError(
                f"{at}: content blocks of type {block.type!r} are not supported by this server; "
                "only text, image, document, tool_use and tool_result (and thinking in assistant "
                "messages) are"
            )
    called.update((call.id, call.name) for call in parts.calls)
    parts.content, parts.reasoning = Content.join(contents), "".join(thoughts)
    return parts


# Which role each block type belongs to (text goes anywhere).
_BLOCK_ROLE = {ThinkingBlock: "assistant", ToolUseBlock: "assistant", ToolResultBlock: "user"}


def _check_role(block: ContentBlock, role: str, at: str) -> None:
    allowed = _BLOCK_ROLE.get(type(block))
    if allowed is not None and allowed != role:
        raise InvalidRequestError(
            f"{at}: {block.type} blocks are only allowed in {allowed} messages"
        )


# Claude Code puts its billing attribution in a system block ("x-anthropic-billing-header:
# cc_version=...; ..."), a value that changes between requests. Anthropic's API reads it as
# a header, not as prompt text; kept, it would make every turn's prompt (and so its prefix)
# differ from the last.
_BILLING_HEADER = "x-anthropic-billing-header:"


def _system_text(blocks: list[TextBlock]) -> str:
    return "".join(_non_empty(block, f"system.{index}") for index, block in enumerate(blocks)
                   if not block.text.startswith(_BILLING_HEADER))


def _non_empty(block: TextBlock, at: str) -> str:
    if not block.text:
        raise InvalidRequestError(f"{at}: text content blocks must be non-empty")
    return block.text
