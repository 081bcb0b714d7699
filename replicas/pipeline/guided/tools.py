"""Tool calls valid by construction: one llguidance grammar per request that offers tools.

The grammar constrains the answer channel in the model's own call syntax: the `grammar`
(a `CallGrammar`) of the model family's tool format (`replicas/families/`), where its
parsing knobs live too, so a new family needs no edit here. Each tool is its own
alternative, so a call's name and its arguments' schema are tied. `auto` lets free text run
until the call section's trigger, then constrains from there (llguidance's lazy lexeme, or
a special-token reference when the trigger is one special token of the model: the two
forms `llguidance.StructTag` compiles to). With the request's own answer grammar
(`response_format`), `auto` is instead a choice between a call section and an answer
under that grammar, never free text: OpenAI's "call a tool or answer in the schema".

A keyword the grammar cannot enforce never refuses a request that is not `strict`: it is
left out of the grammar and named in the result's warnings, which the response carries
(`orchard_warnings`); the model still sees the whole schema in its prompt.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from replicas.contract import GuidedSpec, ToolChoice, ToolSpec
from replicas.errors import InvalidRequestError
from replicas.families.registry import TOOL_FORMATS
from replicas.families.tool_format import CallGrammar, ToolFormat
from replicas.pipeline.guided.compiler import (
    checked_json_schema,
    grammar_warnings,
    named_grammars,
)
from replicas.pipeline.guided.schema_keywords import openai_strict_violations
from replicas.pipeline.guided.tokenizer import GuidedTokenizer
from replicas.pipeline.guided.tool_params import unenforced_string_keywords, xml_parameters


TOOL_NAME: Final = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TEXT_RULE: Final = "TEXT: /(?s:.+)/"  # free text: any characters, never special tokens
ANSWER: Final = "answer"  # the answer grammar's name in the grammar list, `@answer` in Lark


@dataclass(frozen=True)
class ToolGrammar:
    grammar: str  # llguidance's grammar for the answer channel
    warnings: tuple[str, ...] = ()  # what the grammar leaves out of the tools' schemas


@functools.lru_cache(maxsize=64)  # agents send the same tools on every turn
def compile_tool_grammar(
    tool_format: str,
    tools: tuple[ToolSpec, ...],
    choice: ToolChoice,
    *,
    tokenizer: GuidedTokenizer,
    answer: GuidedSpec | None = None,
) -> ToolGrammar | None:
    """The llguidance grammar for the answer channel of a request that offers `tools`.

    None when nothing is constrained: `tool_choice: none` (`tool_plan.py` bans the
    format's reserved markers instead) or `auto` with no tools. `tokenizer` decides how the format's markers are
    matched: as the model's special token where it has one, as text otherwise. `answer`
    (`auto` only: a forced call has no answer) replaces the free text by an answer under
    that grammar. Raises InvalidRequestError (param `tools` or `tool_choice`) for bad
    input, and as `compile_guided` does for a bad `answer`.
    """
    fmt, syntax = _format(tool_format)
    _check_names(tools, choice)
    arguments: dict[str, ArgumentRules] = {}
    dropped: list[str] = []
    for tool in tools:
        arguments[tool.name], unenforced = _arguments(fmt, tool)
        dropped.extend(unenforced)
    if choice.mode == "none" or not tools:
        return None
    if answer is not None and (choice.mode == "required" or choice.name is not None):
        raise ValueError("an answer grammar needs tool_choice auto: a forced call has no answer")
    # Compiled alone first, so a bad schema fails with response_format's own message.
    answer_grammars = named_grammars(answer, ANSWER) if answer is not None else []
    offered = [t.name for t in tools if choice.name is None or t.name == choice.name]
    marks = _Markers(syntax.markers, tokenizer)
    lark = _lark(syntax, marks, offered, arguments, choice, answer=bool(answer_grammars))
    if answer_grammars:  # the answer is a grammar of its own that the Lark names `@answer`
        lark = json.dumps({"grammars": [{"lark_grammar": lark}, *answer_grammars]})
    try:
        grammar, lenient = grammar_warnings(lark, "invalid tool grammar", tokenizer.ll)
    except InvalidRequestError as exc:
        # Validating each tool alone costs milliseconds apiece: only to name the culprit.
        for spec in tools:
            _check_alone(spec, arguments[spec.name])
        raise InvalidRequestError(exc.message, param="tools") from None
    if lenient:  # rare: only then is each tool validated alone, to name it in the warning
        dropped.extend(w for spec in tools for w in _check_alone(spec, arguments[spec.name]))
    return ToolGrammar(grammar, tuple(dict.fromkeys(dropped)))


def _format(name: str) -> tuple[ToolFormat, CallGrammar]:
    fmt = TOOL_FORMATS.get(name)
    if fmt is None or fmt.grammar is None:
        known = ", ".join(n for n, f in TOOL_FORMATS.items() if f.grammar is not None)
        raise ValueError(f"unknown tool format {name!r}; known: {known}")
    return fmt, fmt.grammar


def _check_names(tools: tuple[ToolSpec, ...], choice: ToolChoice) -> None:
    seen: set[str] = set()
    for tool in tools:
        if not isinstance(tool.name, str) or not TOOL_NAME.fullmatch(tool.name):
            raise InvalidRequestError(
                f"invalid tool name {tool.name!r}: names must match ^[a-zA-Z0-9_-]{{1,64}}$",
                param="tools",
            )
        if tool.name in seen:
            raise InvalidRequestError(f"duplicate tool name {tool.name!r}", param="tools")
        seen.add(tool.name)
    if choice.mode == "required" and not tools:
        raise InvalidRequestError("tool_choice 'required' needs at least one tool",
                                  param="tool_choice")
    if choice.name is not None and choice.name not in seen:
        raise InvalidRequestError(f"tool_choice names {choice.name!r}, which is not among "
                                  "the tools offered", param="tool_choice")


# (a rule name, the markers that are special tokens -> their Lark) -> the rules defining it;
# tagged arguments reference their tags as tokens where the model has them as such.
ArgumentRules = Callable[[str, Mapping[str, str]], list[str]]


def _arguments(fmt: ToolFormat, tool: ToolSpec) -> tuple[ArgumentRules, list[str]]:
    """How to write one tool's arguments in Lark, and the warnings for what the raw-text
    strings of the XML syntax leave out; every problem names the tool.

    Only an explicit `strict` must be enforced exactly: otherwise a keyword the grammar
    cannot enforce is left out of it (llguidance's `lenient`), and warned about.
    """
    where = f"tool {tool.name!r}"
    try:
        schema = checked_json_schema(tool.parameters, strict=tool.strict,
                                     lenient=not tool.strict)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{where}: {exc.message}", param="tools") from None
    kind = schema.get("type", "object")
    if kind != "object":
        raise InvalidRequestError(f"{where}: parameters must be an object schema, "
                                  f"got type {kind!r}", param="tools")
    schema["type"] = "object"
    if tool.strict:
        violations = openai_strict_violations(schema)
        if violations:
            raise InvalidRequestError(f"{where}: strict mode: " + "; ".join(violations),
                                      param="tools")
    layout = fmt.grammar.params if fmt.grammar is not None else None
    if layout is not None:  # tagged arguments (Qwen3-Coder, GLM, MiniMax)
        try:
            xml_parameters(schema, "probe", layout, {})  # fail now, with the tool's name
        except ValueError as exc:
            raise InvalidRequestError(f"{where}: {exc}", param="tools") from None
        # Only raw-text strings lose keywords; quoted ones are JSON, checked in full.
        unenforced = unenforced_string_keywords(schema) if layout.raw_strings else []
        if unenforced and tool.strict:
            raise InvalidRequestError(
                f"{where}: strict mode: {fmt.name} writes strings as raw text and cannot "
                f"enforce {'; '.join(unenforced)}", param="tools")
        warnings = [_left_out(where, f"{u} ({fmt.name} writes strings as raw text)")
                    for u in unenforced]
        return (lambda rule, special: xml_parameters(schema, rule, layout, special)), warnings
    return (lambda rule, _special: [f"{rule}: %json {json.dumps(schema)}"]), []


def _check_alone(tool: ToolSpec, arguments: ArgumentRules) -> list[str]:
    """Warnings for what the grammar leaves out of this tool's schema; InvalidRequestError
    naming the tool if its schema cannot be compiled."""
    where = f"tool {tool.name!r}"
    try:
        _, lenient = grammar_warnings("%llguidance {}\nstart: args\n"
                                      + "\n".join(arguments("args", {})),
                                      f"{where}: invalid parameters schema")
    except InvalidRequestError as exc:
        raise InvalidRequestError(exc.message, param="tools") from None
    return [_left_out(where, w) for w in lenient]


def _left_out(where: str, what: str) -> str:
    return f"{where}: not enforced by the grammar: {what}; the model still sees the whole schema"


INDEX = "{index}"  # in a call head: any decimal number (`CallGrammar`)


class _Markers:
    """Lark for literal text: a marker that is one special token of the model becomes a
    token reference (llguidance never matches special tokens as text); `INDEX` becomes a
    number; the rest is text."""

    def __init__(self, markers: tuple[str, ...], tokenizer: GuidedTokenizer) -> None:
        # By id (`<[42]>`): names such as `[TOOL_CALLS]` are not `<name>`-shaped.
        self.special: dict[str, str] = {}
        for marker in markers:
            ids = tokenizer.ll.tokenize_str(marker)
            if len(ids) == 1 and tokenizer.ll.is_special_token(ids[0]):
                self.special[marker] = f"<[{ids[0]}]>"
        self.special[INDEX] = "/[0-9]+/"
        self._split = re.compile("(" + "|".join(map(re.escape, (*markers, INDEX))) + ")")

    def opens_special(self, text: str) -> bool:
        """Whether `text` starts with a marker that is one special token of the model."""
        return any(text.startswith(m) for m in self.special if m != INDEX)

    def lark(self, text: str) -> str:
        pieces = self._split.split(text)
        return " ".join(self.special.get(p) or json.dumps(p) for p in pieces if p)


def _lark(syntax: CallGrammar, marks: _Markers, names: list[str],
          arguments: dict[str, ArgumentRules], choice: ToolChoice, *, answer: bool) -> str:
    # A named choice forces a call to that tool, as OpenAI's does.
    required = choice.mode == "required" or choice.name is not None
    # With an answer grammar, nothing precedes a call: the section opens the completion.
    triggered = not required and not answer and syntax.text_open is None
    # In `auto` the trigger has been matched by the time the first call's rules start.
    skip = len(syntax.trigger) if triggered else 0
    rules = ["%llguidance {}"]
    for i, name in enumerate(names):
        heads = [h.replace("{name}", name) for h in (syntax.head, *syntax.alt_heads)]
        first = " | ".join(marks.lark((syntax.open + h)[skip:]) for h in heads)
        later = " | ".join(marks.lark(h) for h in heads)
        rules.append(f"first_{i}: ({first}) args_{i} {marks.lark(syntax.tail)}")
        rules.append(f"call_{i}: ({later}) args_{i} {marks.lark(syntax.tail)}")
        rules.extend(arguments[name](f"args_{i}", marks.special))
    rules.append("first: " + " | ".join(f"first_{i}" for i in range(len(names))))
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(names))))
    more = ""
    if choice.parallel and syntax.sep is not None:
        more = f"({marks.lark(syntax.sep)} call)*"
    rules.append(f"section: first {more} {marks.lark(syntax.close)}")
    pre = ""
    if syntax.preamble is not None:
        opening, end, resume = syntax.preamble
        if end in marks.special:  # free text cannot hold a special token: it ends there
            body = f"TEXT? {marks.special[end]}"
        else:  # a text end marker: a lazy lexeme stops the free text at its first match
            rules.append(f"preamble_text[lazy]: FREE {json.dumps(end)}")
            rules.append("FREE: /(?s:.*)/")
            body = "preamble_text"
        rules.append(f"preamble: {marks.lark(opening)} {body} {marks.lark(resume)} "
                     f"| {marks.lark(resume)}")
        pre = "preamble? "
    if required:
        rules.append(f"start: {pre}section")
        if pre:
            rules.append(TEXT_RULE)
    elif answer:
        # The answer where free text would be: after the header that announces text
        # (harmony's final channel), between the wrappers free text may hold (Kimi K3's).
        head = marks.lark(syntax.text_open) + " " if syntax.text_open is not None else ""
        wrap = ""
        if syntax.text_markers:
            rules.append("text_marker: " + " | ".join(marks.lark(m) for m in syntax.text_markers))
            wrap = "text_marker?"
        rules.append(f"start: {pre}(section | {head}{wrap} @{ANSWER} {wrap})")
        if pre:
            rules.append(TEXT_RULE)
    elif syntax.text_open is not None:
        rules.append(f"start: {pre}({marks.lark(syntax.text_open)} TEXT? | section)")
        rules.append(TEXT_RULE)
    elif marks.opens_special(syntax.trigger):
        # A special token opens the call: free text cannot contain it, so the text simply
        # ends where the token comes (StructTag's `assume_special` form). Marker texts that
        # free text may hold, spelled with special tokens too, come between text runs.
        free = "TEXT?"
        if syntax.text_markers:
            rules.append("text_marker: " + " | ".join(marks.lark(m) for m in syntax.text_markers))
            free = "TEXT? (text_marker TEXT?)*"
        rules.append(f"start: {free} | {free} {marks.lark(syntax.trigger)} section")
        rules.append(TEXT_RULE)
    else:
        # A text trigger: a lazy lexeme ends the free text at the trigger's first
        # occurrence, and from there the call is constrained (StructTag's lazy form).
        rules.append(f"trigger[lazy]: FREE {json.dumps(syntax.trigger)}")
        rules.append("start: FREE | trigger section")
        rules.append("FREE: /(?s:.*)/")
    return "\n".join(rules) + "\n"

