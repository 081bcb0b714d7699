"""How one request's tools are handled: parsed, constrained, or banned.

Pure decisions from the request and the model's tool format; the replica turns the plan
into its decoder and controller. Whatever differs by format is a field of the family's
`ToolFormat` (`replicas/families/`), never a check of its name here. Everything here runs before
the engine sees the request, so every bad combination is a 400 with no engine time spent.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

from replicas.contract import GenerationRequest
from replicas.errors import InvalidRequestError
from replicas.families.tool_format import ToolFormat
from replicas.pipeline.tool_calls.parser import ToolParsing

if TYPE_CHECKING:  # llguidance is imported on the first guided or tool request only
    from replicas.pipeline.guided import GuidedTokenizer


@dataclass(frozen=True)
class ToolPlan:
    parsing: ToolParsing | None = None  # None: tool-call markup stays plain text
    grammar: str | None = None  # the llguidance grammar over the answer (and its calls)
    # `tool_choice: none`: the reserved markers that are one token each are banned, and
    # the answer drops every reserved marker of `suppressed` (`without_calls`).
    banned_ids: tuple[int, ...] = ()
    suppressed: ToolFormat | None = None
    grammar_start: Literal["answer", "reasoning_end"] = "answer"
    forced_end: str | None = None  # what a spent thinking budget forces, if not the format's
    warnings: tuple[str, ...] = ()  # schema keywords the grammar leaves out, for the response
    # The grammar holds the request's answer grammar too (response_format with tools): no
    # free text is left, so the grammar, not a stop, ends the answer.
    owns_answer: bool = False


NO_TOOLS = ToolPlan()


def plan_tools(
    request: GenerationRequest,
    tool_format: ToolFormat,
    guided_tokenizer: Callable[[], GuidedTokenizer],
    encode: Callable[[str], Sequence[int]],
) -> ToolPlan:
    choice = request.tool_choice
    if not request.tools:
        if choice.mode == "required" or choice.name is not None:
            raise InvalidRequestError("tool_choice needs tools to choose from", param="tool_choice")
        return NO_TOOLS
    call_grammar = tool_format.grammar  # None exactly for the format without calls
    if choice.mode == "none" and choice.name is None:
        if call_grammar is None:
            return NO_TOOLS
        return ToolPlan(banned_ids=reserved_token_ids(tool_format, encode),
                        suppressed=tool_format)
    if call_grammar is None:
        raise InvalidRequestError(
            "this model has no tool-call format the server knows; set `tool_format` for it "
            "in the serve config", param="tools")
    from replicas.pipeline.guided import compile_guided, compile_tool_grammar

    # response_format with tools: a call, or an answer under it (OpenAI's rule). A forced
    # call (`required`, a named tool) leaves no answer, so the answer grammar drops out;
    # under `none` (above) it is the only grammar, as without tools.
    forced = choice.mode == "required" or choice.name is not None
    answer = None if forced else request.guided
    if forced and request.guided is not None:
        compile_guided(request.guided)  # unused, but a bad format is a 400 whatever the choice
    compiled = compile_tool_grammar(tool_format.name, request.tools, choice,
                                    tokenizer=guided_tokenizer(), answer=answer)
    return ToolPlan(
        parsing=ToolParsing.from_specs(
            tool_format if answer is None else marked_calls_only(tool_format), request.tools),
        grammar=compiled.grammar if compiled is not None else None,
        grammar_start=call_grammar.start,
        forced_end=call_grammar.forced_end,
        warnings=compiled.warnings if compiled is not None else (),
        owns_answer=answer is not None,
    )


@functools.cache
def marked_calls_only(tool_format: ToolFormat) -> ToolFormat:
    """The format read without its bare opener (Llama's `{"name"` at the answer's start):
    beside an answer grammar, the tool grammar opens every call with its marker, so a JSON
    answer whose first key is "name" is the answer, not a call. Renamed, since composed
    channel formats are cached by name."""
    if tool_format.bare_open is None:
        return tool_format
    return dataclasses.replace(tool_format, name=f"{tool_format.name}-marked", bare_open=None)


def reserved_token_ids(tool_format: ToolFormat, encode: Callable[[str], Sequence[int]],
                       ) -> tuple[int, ...]:
    """The ids of the format's reserved markers that are one token each, banned under
    `tool_choice: none`. A marker of several tokens is not banned (each of its tokens also
    writes plain text); the router drops it from the answer instead."""
    ids = (tuple(encode(marker)) for marker in tool_format.reserved)
    return tuple(dict.fromkeys(one[0] for one in ids if len(one) == 1))
