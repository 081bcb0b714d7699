"""OpenAI chat tools -> contract: `tools`, `tool_choice` and the messages that carry calls.

Every rule the replica cannot check cheaply (unknown tool types, a choice naming no tool,
a result for a call that was never made, arguments that are not a JSON object) is a 400
here, before any replica time.
"""

from __future__ import annotations

import json

from ingress.media import Content, MediaParts
from ingress.openai.models import ChatCompletionRequest, ChatMessageIn, NamedToolChoice
from replicas.contract import ChatMessage, ToolCall, ToolChoice, ToolSpec
from replicas.errors import InvalidRequestError

# What a function without `parameters` accepts: OpenAI documents it as an empty parameter list.
EMPTY_PARAMETERS = '{"type": "object", "properties": {}}'


def tool_specs(body: ChatCompletionRequest) -> tuple[ToolSpec, ...]:
    specs: list[ToolSpec] = []
    for index, tool in enumerate(body.tools or ()):
        if tool.type != "function":
            raise InvalidRequestError(
                f"tools[{index}]: tool type {tool.type!r} is not supported; only 'function' is",
                param=f"tools.{index}.type",
            )
        function = tool.function
        if function is None:
            raise InvalidRequestError(f"tools[{index}].function is required",
                                      param=f"tools.{index}.function")
        if any(spec.name == function.name for spec in specs):
            raise InvalidRequestError(f"tools[{index}]: duplicate function name {function.name!r}",
                                      param=f"tools.{index}.function.name")
        parameters = EMPTY_PARAMETERS if function.parameters is None else json.dumps(
            function.parameters)
        specs.append(ToolSpec(function.name, function.description, parameters,
                              bool(function.strict)))
    return tuple(specs)


def tool_choice(body: ChatCompletionRequest, specs: tuple[ToolSpec, ...]) -> ToolChoice:
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    choice = body.tool_choice
    if choice is None or choice in ("auto", "none"):
        # Without tools "auto" and "none" mean the same: there is nothing to call.
        return ToolChoice("none" if choice == "none" else "auto", parallel=parallel)
    if not specs:
        raise InvalidRequestError("tool_choice requires tools; none were given",
                                  param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if all(spec.name != name for spec in specs):
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not in tools",
                                      param="tool_choice")
        return ToolChoice("required", name, parallel)
    return ToolChoice("required", parallel=parallel)


def chat_messages(messages: list[ChatMessageIn],
                  media: MediaParts) -> tuple[ChatMessage, ...]:
    """History as contract messages; a tool result learns its tool's name from its call.
    Media parts are images or placeholders, as `media` decides."""
    called: dict[str, str] = {}  # call id -> tool name, from earlier assistant turns
    out: list[ChatMessage] = []
    for index, message in enumerate(messages):
        content = message.content_of(media, f"messages.{index}.content")
        if message.role == "tool":
            out.append(_tool_result(message, content, index, called))
            continue
        calls = _calls(message, index) if message.role == "assistant" else ()
        called.update((call.id, call.name) for call in calls)
        out.append(ChatMessage(
            role="system" if message.role == "developer" else message.role,
            content=content.text,
            images=content.images,
            reasoning=message.reasoning_content,
            tool_calls=calls,
        ))
    return tuple(out)


def _calls(message: ChatMessageIn, index: int) -> tuple[ToolCall, ...]:
    calls: list[ToolCall] = []
    for position, call in enumerate(message.tool_calls or ()):
        where = f"messages.{index}.tool_calls.{position}.function.arguments"
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            raise InvalidRequestError(f"{where} must be a JSON object", param=where)
        calls.append(ToolCall(call.id, call.function.name, call.function.arguments))
    return tuple(calls)


def _tool_result(message: ChatMessageIn, content: Content, index: int,
                 called: dict[str, str]) -> ChatMessage:
    where = f"messages.{index}.tool_call_id"
    call_id = message.tool_call_id
    if call_id is None:
        raise InvalidRequestError(f"{where} is required for role 'tool'", param=where)
    if call_id not in called:
        raise InvalidRequestError(
            f"{where}: {call_id!r} matches no tool call of an earlier assistant message",
            param=where)
    return ChatMessage("tool", content.text, images=content.images, tool_call_id=call_id,
                       name=called[call_id])
