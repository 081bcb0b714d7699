"""Anthropic tools -> contract: `tools`, `tool_choice`, and tool_use / tool_result blocks.

Only custom tools run here: a server tool (`web_search_20250305`, `bash_20250124`, ...) is
executed by Anthropic's service itself, so accepting one would silently drop it.
"""

from __future__ import annotations

import json

from ingress.anthropic.models import (
    TextBlock,
    Tool,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceIn,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from ingress.media import Content, MediaParts
from replicas.contract import ChatMessage, ToolCall, ToolChoice, ToolSpec
from replicas.errors import InvalidRequestError

CUSTOM_TOOL_TYPES = (None, "custom")

# A tool_result with is_error is marked in its text, so the model sees the call failed.
ERROR_PREFIX = "Error: "


def tool_specs(tools: list[Tool] | None) -> tuple[ToolSpec, ...]:
    specs: list[ToolSpec] = []
    for index, tool in enumerate(tools or ()):
        if tool.type not in CUSTOM_TOOL_TYPES:
            raise InvalidRequestError(
                f"tools.{index}: tool type {tool.type!r} is not supported by this server; "
                "only custom tools (name, description, input_schema) are",
                param=f"tools.{index}.type",
            )
        if tool.input_schema is None:
            raise InvalidRequestError(f"tools.{index}.input_schema: Field required",
                                      param=f"tools.{index}.input_schema")
        if any(spec.name == tool.name for spec in specs):
            raise InvalidRequestError(f"tools: tool names must be unique; {tool.name!r} repeats",
                                      param=f"tools.{index}.name")
        specs.append(ToolSpec(tool.name, tool.description, json.dumps(tool.input_schema),
                              bool(tool.strict)))
    return tuple(specs)


def tool_choice(choice: ToolChoiceIn | None, specs: tuple[ToolSpec, ...]) -> ToolChoice:
    if choice is None:
        return ToolChoice()
    if not isinstance(choice, (ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool)):
        return ToolChoice("none")
    parallel = not choice.disable_parallel_tool_use
    if isinstance(choice, ToolChoiceAuto):
        return ToolChoice("auto", parallel=parallel)
    if not specs:
        raise InvalidRequestError(
            f"tool_choice: type {choice.type!r} requires tools; none were given",
            param="tool_choice")
    if isinstance(choice, ToolChoiceAny):
        return ToolChoice("required", parallel=parallel)
    if all(spec.name != choice.name for spec in specs):
        raise InvalidRequestError(
            f"tool_choice.name: {choice.name!r} is not the name of a tool in tools",
            param="tool_choice.name")
    return ToolChoice("required", choice.name, parallel)


def tool_call(block: ToolUseBlock) -> ToolCall:
    """A call from history; its id goes back to the model unchanged."""
    return ToolCall(block.id, block.name, json.dumps(block.input))


def tool_result(block: ToolResultBlock, at: str, called: dict[str, str],
                media: MediaParts) -> ChatMessage:
    """The result as a `tool` message; `called` maps earlier tool_use ids to tool names.
    An image or document in it is an image or a placeholder, as `media` decides."""
    if block.tool_use_id not in called:
        raise InvalidRequestError(
            f"{at}: tool_result block(s) provided with tool_use_id {block.tool_use_id!r}, "
            "which matches no tool_use block in an earlier assistant message")
    contents = []
    for position, part in enumerate(block.content):
        where = f"{at}.content.{position}"
        content = Content(part.text) if isinstance(part, TextBlock) else media.replace(
            part.type, where, part.image_source())
        if content is None:
            raise InvalidRequestError(
                f"{where}: content blocks of type {part.type!r} are not supported in "
                "tool_result by this server; only text, image and document are")
        contents.append(content)
    result = Content.join(contents)
    if block.is_error:
        result = Content.join([ERROR_PREFIX, result]) if result else Content(
            ERROR_PREFIX.rstrip(": "))
    return ChatMessage("tool", result.text, images=result.images,
                       tool_call_id=block.tool_use_id, name=called[block.tool_use_id])
