"""Anthropic Messages request -> GenerationRequest.

Checks the rules pydantic cannot express (role order, emptiness, prefill, block types) with
Anthropic's wording where the real API has one; every failure is a `ReplicaError`, which the
app renders as an Anthropic error body.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from ingress.anthropic.models import (
    ContentBlock,
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ThinkingAdaptive,
    ThinkingBlock,
    ThinkingEnabled,
)
from ingress.client import ModelCard
from replicas.contract import (
    ChatMessage,
    ChatPrompt,
    GenerationRequest,
    ReasoningSpec,
    SamplingParams,
    StopSpec,
)
from replicas.errors import InvalidRequestError

# Consecutive same-role messages become one turn (as Anthropic documents); their texts are
# joined like paragraphs. Blocks inside one message are concatenated as-is, since clients
# split one text into blocks (e.g. for cache breakpoints) without meaning a separator.
TURN_SEPARATOR = "\n\n"


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def to_generation_request(body: MessagesRequest, card: ModelCard) -> GenerationRequest:
    thinking = body.thinking
    if isinstance(thinking, ThinkingEnabled) and thinking.budget_tokens >= body.max_tokens:
        raise InvalidRequestError(
            "`max_tokens` must be greater than `thinking.budget_tokens`", param="max_tokens"
        )
    return GenerationRequest(
        request_id=new_message_id(),
        model=card.id,
        prompt=to_prompt(body),
        sampling=SamplingParams(
            max_tokens=body.max_tokens,
            # Anthropic's defaults: temperature 1.0, nucleus and top-k sampling off.
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
        ),
        stop=StopSpec(strings=tuple(body.stop_sequences or ())),
        reasoning=_reasoning(body),
    )


def to_count_request(body: CountTokensRequest, card: ModelCard) -> GenerationRequest:
    """The request whose prompt would be counted; thinking matters, as it changes the template."""
    return GenerationRequest(
        request_id=new_message_id(),
        model=card.id,
        prompt=to_prompt(body),
        reasoning=_reasoning(body),
    )


def _reasoning(body: CountTokensRequest) -> ReasoningSpec:
    # Anthropic does not think unless asked, whatever the model's template would default to.
    if isinstance(body.thinking, ThinkingEnabled):
        return ReasoningSpec(enabled=True, budget_tokens=body.thinking.budget_tokens)
    if isinstance(body.thinking, ThinkingAdaptive):
        return ReasoningSpec(enabled=True)
    return ReasoningSpec(enabled=False)


@dataclass
class _Turn:
    role: str
    texts: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)

    def message(self) -> ChatMessage:
        reasoning = TURN_SEPARATOR.join(self.reasoning) or None
        return ChatMessage(self.role, TURN_SEPARATOR.join(self.texts), reasoning=reasoning)


def to_prompt(body: CountTokensRequest) -> ChatPrompt:
    """System first, then one message per turn.

    A final assistant message is a prefill: it stays the last message, and the replica
    continues that message instead of opening a new assistant turn.
    """
    if body.tools:
        raise InvalidRequestError("tools: tool use is not supported by this server", param="tools")
    if body.messages[0].role != "user":
        raise InvalidRequestError('messages: first message must use the "user" role')

    last = len(body.messages) - 1
    turns: list[_Turn] = []
    for index, message in enumerate(body.messages):
        where = f"messages.{index}"
        text, reasoning = _message_parts(message.content, message.role, where)
        if not (text or reasoning) and not (index == last and message.role == "assistant"):
            raise InvalidRequestError(
                f"{where}: all messages must have non-empty content except for the optional "
                "final assistant message"
            )
        if index == last and message.role == "assistant" and text != text.rstrip():
            raise InvalidRequestError(
                "messages: final assistant content cannot end with trailing whitespace"
            )
        if not turns or turns[-1].role != message.role:
            turns.append(_Turn(message.role))
        if text:
            turns[-1].texts.append(text)
        if reasoning:
            turns[-1].reasoning.append(reasoning)

    # An empty final assistant message asks for nothing to continue: no prefill.
    messages = [turn.message() for turn in turns if turn.texts or turn.reasoning]
    system = _system_text(body.system)
    if system:
        messages.insert(0, ChatMessage("system", system))
    return ChatPrompt(tuple(messages))


def _message_parts(blocks: list[ContentBlock], role: str, where: str) -> tuple[str, str]:
    """The message's text and its reasoning (thinking blocks of an earlier assistant turn)."""
    texts: list[str] = []
    thoughts: list[str] = []
    for position, block in enumerate(blocks):
        at = f"{where}.content.{position}"
        if isinstance(block, TextBlock):
            texts.append(_non_empty(block, at))
        elif isinstance(block, ThinkingBlock) and role == "assistant":
            thoughts.append(block.thinking)
        elif isinstance(block, ThinkingBlock):
            raise InvalidRequestError(
                f"{at}: thinking blocks are only allowed in assistant messages"
            )
        else:
            raise InvalidRequestError(
                f"{at}: content blocks of type {block.type!r} are not supported by this server; "
                "only text (and thinking in assistant messages) is"
            )
    return "".join(texts), "".join(thoughts)


def _system_text(blocks: list[TextBlock]) -> str:
    return "".join(_non_empty(block, f"system.{index}") for index, block in enumerate(blocks))


def _non_empty(block: TextBlock, at: str) -> str:
    if not block.text:
        raise InvalidRequestError(f"{at}: text content blocks must be non-empty")
    return block.text
