"""The data model of a tool format: how a family marks a call, how the text inside reads
(`Syntax` and its knobs), its detection signature, its `CallGrammar` and its `reserved`
markers. Each family module fills one in (`tool_layouts.py` builds the layouts several
families share); the pipeline reads them (parser, composition, grammar) and never tests a
format's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal

__all__ = ["CallGrammar", "GemmaTags", "KeyValueTags", "ParamLayout", "Syntax", "ToolFormat",
           "XmlTags"]


class Syntax(str, Enum):
    NONE = "none"  # no calls
    JSON = "json"  # call objects {"name": ..., "arguments": {...}}
    XML = "xml"  # tagged functions and parameters (`XmlTags`): Qwen3-Coder, MiniMax-M2
    # GLM-4.5/4.7: NAME<arg_key>K</arg_key><arg_value>V</arg_value>..., the name is bare text
    KEY_VALUE = "key_value"
    PYTHONIC = "pythonic"  # LFM2: [NAME(k=V, ...), ...], V a Python (or JSON) literal
    GEMMA = "gemma"  # Gemma 4, FunctionGemma: call:NAME{k:V,...}, strings in `GemmaTags.quote`
    XTML = "xtml"  # Kimi K3: <|open|>call tool="NAME"<|sep|> typed argument blocks
    RAW = "raw"  # Harmony: the message body is the arguments, the header names the call


@dataclass(frozen=True)
class XmlTags:
    """The tags of an XML call (`Syntax.XML`): `<function=NAME>` blocks of
    `<parameter=P>VALUE</parameter>` for Qwen3-Coder, `<invoke name="NAME">` for MiniMax."""

    function: str = "<function="  # a call's header runs from here to the next `>`
    function_end: str = "</function>"
    parameter: str = "<parameter="
    parameter_end: str = "</parameter>"
    # Names in the headers may be quoted (`name="city"`): the quotes are not the name.
    quoted: bool = False
    # Qwen3-Coder's templates put a value on its own lines (one newline each side is
    # layout); MiniMax's reference parser strips all surrounding whitespace.
    strip_values: bool = False
    # The header is attributes and the name is this one's quoted value
    # (`<atem:invoke name="f">`); None: the whole header is the name.
    name_attr: str | None = None
    # A value that parses as JSON is that value, a string included, whatever the schema
    # says (Muse Spark's reference); otherwise the stripped text.
    json_values: bool = False
    # A value wrapped in `<![CDATA[...]]>` is the text inside, unstripped (MiniCPM5).
    cdata: bool = False


@dataclass(frozen=True)
class KeyValueTags:
    """The tags of a key/value call (`Syntax.KEY_VALUE`): GLM's, or LongCat's own."""

    key: str = "<arg_key>"
    key_end: str = "</arg_key>"
    value: str = "<arg_value>"
    value_end: str = "</arg_value>"


@dataclass(frozen=True)
class GemmaTags:
    """A Gemma call (`Syntax.GEMMA`): `call:NAME{key:VALUE,...}`, a string VALUE written
    between two `quote`s (Gemma 4's `<|"|>`, FunctionGemma's `<escape>`)."""

    quote: str


@dataclass(frozen=True)
class ParamLayout:
    """How the grammar writes one argument of a tagged syntax (`guided/tool_params.py`):
    `open` with "{key}" replaced, the value (raw text for a plain string, JSON otherwise),
    `close`, then `after`; `sep` between two arguments (pythonic's ", ")."""

    open: str
    close: str
    after: str = ""
    sep: str = ""
    # False: every value is JSON, strings quoted (pythonic keyword arguments).
    raw_strings: bool = True
    # A raw string is written between two of these instead of ending at `close` (Gemma).
    quote: str = ""


@dataclass(frozen=True)
class CallGrammar:
    """How the tool grammar writes this family's calls. A section is
    `open call (sep call)* close`; a call is `head(NAME) ARGS tail`, ARGS as `params`
    lays them out when set, JSON otherwise. `trigger` starts the section: `auto` runs free
    text until it, `none` bans it (when it is one token). In `head`, "{name}" is the
    tool's name and "{index}" any decimal number (Kimi's call counter)."""

    trigger: str
    head: str
    tail: str
    open: str = ""
    sep: str | None = None  # None: one call per turn, whatever `parallel` says
    close: str = ""
    markers: tuple[str, ...] = ()  # texts that are special tokens in this family's vocab
    params: ParamLayout | None = None  # tagged arguments; None: a JSON object
    # Where free text must be announced by a header (harmony's final channel), `auto` is
    # a plain alternative between this header + text and a call; no trigger is needed.
    text_open: str | None = None
    # Marker texts that free text may still hold in `auto` (Kimi K3's response wrapper):
    # free text cannot hold a special token, so these are spelled out as alternatives.
    text_markers: tuple[str, ...] = ()
    # Other ways the same call head may be written ("{name}" as in `head`).
    alt_heads: tuple[str, ...] = ()
    # A message the model may write before any of the above (harmony's analysis): its
    # opening, its end, and what opens the next message. When the prompt itself opened
    # that message, the grammar starts after its end, at the next message's opening.
    preamble: tuple[str, str, str] | None = None
    # Where the controller starts the grammar: a grammar that covers the headers after a
    # reasoning message (harmony) starts when reasoning ends.
    start: Literal["answer", "reasoning_end"] = "answer"
    # What a spent thinking budget forces instead of the channel format's own end: the
    # grammar must still be free to choose what follows (harmony: only `<|end|>`).
    forced_end: str | None = None

    def __post_init__(self) -> None:
        if not (self.open or self.head).startswith(self.trigger):
            raise ValueError(f"tool syntax: {self.trigger!r} must open the call section")


@dataclass(frozen=True)
class ToolFormat:
    name: str
    syntax: Syntax
    # The literal text that opens a call (the grammar's trigger); None for Harmony, where
    # a header's recipient does.
    call_open: str | None = None
    call_close: str | None = None  # ends one call; without it a call runs to the end
    # Opens a call only where it starts the answer; the marker is also the call's first text.
    bare_open: str | None = None
    args_keys: tuple[str, ...] = ("arguments",)  # JSON: keys that hold the arguments
    separator: str | None = None  # JSON: between call objects after one marker
    lists: bool = False  # JSON: the calls may come as one list [{...}, {...}]
    named: str | None = None  # JSON: "NAME<named>{args}" is a call too (Mistral's [ARGS])
    # JSON with `named`: a regex the text before `named` must match in full, whose group
    # `name` is the tool's name (Kimi writes `functions.NAME:0`); None: the stripped text.
    name_pattern: str | None = None
    xml: XmlTags = XmlTags()  # Syntax.XML: the tags
    kv: KeyValueTags = KeyValueTags()  # Syntax.KEY_VALUE: the tags
    gemma: GemmaTags = GemmaTags('<|"|>')  # Syntax.GEMMA: the string quote
    # Markers that wrap a whole section of calls (Kimi's `<|tool_calls_section_begin|>`):
    # with tools composed, the answer drops them; the calls inside open and close as usual.
    section: tuple[str, ...] = ()
    # Texts that identify the format when all are in a chat template or a vocabulary.
    signature: tuple[str, ...] = ()
    # A channel format whose models always write this tool format, whatever the
    # signatures say (Harmony's calls are part of its channel format).
    channel_format: str | None = None
    grammar: CallGrammar | None = None  # None only for `none`: calls are never constrained
    # Every marker of the family's call and tool-result markup (open, close, result
    # wrappers), which plain text never needs: `tool_choice: none` bans each one that is a
    # single token and drops them all from the answer text (tool_plan.py), so none reaches
    # `content`. A call's body syntax (`{"name"`, `<function=`) is not a marker.
    reserved: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Every format with calls must be enforceable, or `tool_choice` would be a 500.
        if (self.syntax is Syntax.NONE) != (self.grammar is None):
            raise ValueError(f"tool format {self.name!r}: a grammar exactly when it has calls")
        # ... and suppressible under `tool_choice: none`: its own open and close at least.
        delimiters = {m for m in (self.call_open, self.call_close, *self.section)
                      if m is not None}
        suppressible = bool(self.reserved) and delimiters <= set(self.reserved)
        if (self.syntax is Syntax.NONE) == suppressible:
            raise ValueError(f"tool format {self.name!r}: `reserved` must hold its markers")
        # Tagged arguments are written by the grammar in the parser's own layout.
        if self.syntax in (Syntax.XML, Syntax.KEY_VALUE, Syntax.PYTHONIC, Syntax.GEMMA) and (
                self.grammar is None or self.grammar.params is None):
            raise ValueError(f"tool format {self.name!r}: tagged syntax needs `params`")
