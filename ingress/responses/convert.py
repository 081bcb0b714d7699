"""Responses API request -> GenerationRequest, plus what the response echoes back.

Every rule pydantic cannot express is checked here and fails as an `InvalidRequestError`
(a 400 in OpenAI's shape) naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from pydantic import TypeAdapter

from ingress.client import ModelCard
from ingress.effort import effort_reasoning
from ingress.media import Content, MediaParts
from ingress.responses.models import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputItem,
    MessageItem,
    NamedToolChoice,
    OtherPart,
    ReasoningItem,
    ResponsesRequest,
    TextPart,
)
from replicas.contract import (
    ChatMessage,
    ChatPrompt,
    GenerationRequest,
    GuidedSpec,
    SamplingParams,
    ToolCall,
    ToolChoice,
    ToolSpec,
)
from replicas.errors import InvalidRequestError

_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])


@dataclass(frozen=True)
class Plan:
    """One request, converted: what to generate and what the response must carry."""

    generation: GenerationRequest
    items: tuple[dict[str, Any], ...]  # the whole input as wire items, history first
    echo: Mapping[str, Any]  # request fields the response object repeats
    warnings: tuple[str, ...]
    reasoning_summary: bool  # reasoning goes to the item's `summary` (else its `content`)


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def to_plan(body: ResponsesRequest, card: ModelCard, history: Sequence[dict[str, Any]] = (),
            media: MediaParts | None = None) -> Plan:
    """The plan, its media parts as `media` decides (none given: placeholders); where
    `media` reads images, await `media.resolve` on its generation before it goes anywhere."""
    if body.background:
        raise InvalidRequestError("background responses are not supported", param="background")
    current = list(body.input)
    if not current and not history:
        raise InvalidRequestError("'input' is required", param="input")
    earlier = _ITEMS.validate_python(list(history))
    media = MediaParts() if media is None else media
    messages = to_messages(body.instructions, [*earlier, *current], media,
                           offset=len(earlier))
    functions = [tool for tool in body.tools if isinstance(tool, FunctionTool)]
    if len({tool.name for tool in functions}) < len(functions):
        raise InvalidRequestError("function tool names must be unique", param="tools")
    hosted = sorted({tool.type for tool in body.tools if not isinstance(tool, FunctionTool)})
    hosted_warnings = (f"hosted tools are not available on this server and were left out: "
                       f"{', '.join(hosted)}",) if hosted else ()
    warnings = hosted_warnings + media.warnings()
    generation = GenerationRequest(
        request_id=new_response_id(),
        model=card.id,
        prompt=ChatPrompt(tuple(messages)),
        sampling=SamplingParams(
            max_tokens=body.max_output_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            logprobs=_logprobs(body),
        ),
        reasoning=effort_reasoning(body.reasoning.effort if body.reasoning else None),
        guided=_guided(body),
        tools=tuple(_tool_spec(tool) for tool in functions),
        tool_choice=_tool_choice(body, functions),
        session_key=body.prompt_cache_key,
    )
    items = (*history, *(_dump(item) for item in current))
    summary = body.reasoning is not None and body.reasoning.summary is not None
    return Plan(generation, items, _echo(body, functions), warnings, summary)


def to_messages(instructions: str | None, items: Sequence[Any], media: MediaParts,
                offset: int = 0) -> list[ChatMessage]:
    """Chat messages for the input items; `offset` items are history (not the client's).
    Image and file parts are images or placeholders, as `media` decides."""
    messages: list[ChatMessage] = []
    if instructions:
        messages.append(ChatMessage("system", instructions))
    names: dict[str, str] = {}  # call_id -> function name, for the tool results
    reasoning: list[str] = []  # waits for the assistant turn it belongs to
    extendable = False  # the last message is an assistant turn a call may join
    for index, item in enumerate(items):
        where = f"input.{index - offset}" if index >= offset else "previous_response_id"
        if isinstance(item, ReasoningItem):
            reasoning.extend(part.text for part in [*item.summary, *(item.content or ())])
            extendable = False
        elif isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            content = _content(item.content, f"{where}.content", media)
            extendable = role == "assistant"
            thought = ("".join(reasoning) or None) if extendable else None
            messages.append(ChatMessage(role, content.text, images=content.images,
                                        reasoning=thought))
            reasoning = [] if extendable else reasoning
        elif isinstance(item, FunctionCallItem):
            _check_arguments(item.arguments, f"{where}.arguments")
            call = ToolCall(item.call_id, item.name, item.arguments)
            names[item.call_id] = item.name
            if extendable:
                last = messages[-1]
                messages[-1] = dataclasses.replace(last, tool_calls=(*last.tool_calls, call))
            else:
                messages.append(ChatMessage("assistant", "", reasoning="".join(reasoning) or None,
                                            tool_calls=(call,)))
                reasoning, extendable = [], True
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in names:
                raise InvalidRequestError(
                    f"no function_call with call_id '{item.call_id}' precedes this output",
                    param=f"{where}.call_id")
            output = _content(item.output, f"{where}.output", media)
            messages.append(ChatMessage("tool", output.text, images=output.images,
                                        tool_call_id=item.call_id, name=names[item.call_id]))
            extendable = False
        else:
            raise InvalidRequestError(
                f"input items of type '{item.type}' are not supported by this server; "
                "use message, function_call, function_call_output or reasoning",
                param=f"{where}.type")
    return messages


def _check_arguments(arguments: str, where: str) -> None:
    try:
        valid = isinstance(json.loads(arguments), dict)
    except ValueError:
        valid = False
    if not valid:
        raise InvalidRequestError("function_call arguments must be the JSON text of an object",
                                  param=where)


def _content(parts: Sequence[TextPart | OtherPart], where: str, media: MediaParts) -> Content:
    contents = []
    for position, part in enumerate(parts):
        content = Content(part.text) if isinstance(part, TextPart) else media.replace(
            part.type, f"{where}.{position}", part.source())
        if content is None:  # a refusal, or a type this server does not know
            raise InvalidRequestError(
                f"content parts of type '{part.type}' are not supported by this server; "
                "only text, input_image and input_file are", param=f"{where}.{position}.type")
        contents.append(content)
    return Content.join(contents)


def _guided(body: ResponsesRequest) -> GuidedSpec | None:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GuidedSpec("json_object")
    if fmt.schema_ is None:
        raise InvalidRequestError("text.format.schema is required for json_schema",
                                  param="text.format.schema")
    return GuidedSpec("json_schema", json.dumps(fmt.schema_), bool(fmt.strict))


def _tool_spec(tool: FunctionTool) -> ToolSpec:
    # Only an explicit `strict: true` must meet strict mode's rules. Omitted, OpenAI uses
    # strict mode where the schema allows and best-effort calling otherwise: the grammar
    # enforces every schema it can either way (a schema that meets strict's rules is
    # enforced whole non-strict too), so omitted is non-strict here.
    return ToolSpec(
        name=tool.name,
        description=tool.description,
        parameters=json.dumps(tool.parameters or {"type": "object", "properties": {}}),
        strict=bool(tool.strict),
    )


def _tool_choice(body: ResponsesRequest, functions: list[FunctionTool]) -> ToolChoice:
    choice = body.tool_choice
    parallel = body.parallel_tool_calls
    if isinstance(choice, str):
        if choice == "required" and not functions:
            raise InvalidRequestError("tool_choice 'required' needs at least one function tool",
                                      param="tool_choice")
        return ToolChoice(choice, parallel=parallel)
    if choice.type != "function":
        raise InvalidRequestError(
            f"tool_choice of type '{choice.type}' is not supported by this server; use auto, "
            "none, required or a function", param="tool_choice")
    if choice.name not in {tool.name for tool in functions}:
        raise InvalidRequestError(f"tool_choice names '{choice.name}', which is not one of "
                                  "the function tools", param="tool_choice.name")
    return ToolChoice("required", name=choice.name, parallel=parallel)


def _dump(item: Any) -> dict[str, Any]:
    dumped: dict[str, Any] = item.model_dump(by_alias=True, exclude_none=True)
    return dumped


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _logprobs(body: ResponsesRequest) -> int | None:
    """Top alternatives per answer token when the request asks for logprobs, else None."""
    if LOGPROBS_INCLUDE in (body.include or ()) or body.top_logprobs is not None:
        return body.top_logprobs or 0
    return None


def _echo(body: ResponsesRequest, functions: list[FunctionTool]) -> dict[str, Any]:
    fmt = body.text.format if body.text else None
    choice = body.tool_choice
    return {
        "instructions": body.instructions,
        # Only the tools the model was offered: hosted ones were left out.
        "tools": [{"type": "function", "name": tool.name, "description": tool.description,
                   "parameters": tool.parameters, "strict": _tool_spec(tool).strict}
                  for tool in functions],
        "tool_choice": choice if not isinstance(choice, NamedToolChoice)
        else choice.model_dump(exclude_none=True),
        "parallel_tool_calls": body.parallel_tool_calls,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_logprobs": body.top_logprobs or 0,
        "max_output_tokens": body.max_output_tokens,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                 else {"type": "text"}},
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                      "summary": body.reasoning.summary if body.reasoning else None},
        "store": body.store,
        "previous_response_id": body.previous_response_id,
        "metadata": body.metadata or {},
        "user": body.user,
        "prompt_cache_key": body.prompt_cache_key,
        "truncation": "disabled",
        "background": False,
    }
