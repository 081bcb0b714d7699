"""DeepSeek's tool-call format, one entry (registered in `tool_formats.TOOL_FORMATS`):
DeepSeek V3.1 and V3.2-Exp. mlx-lm 0.32 has no parser for it; the reference is the
chat template's own markup and vLLM's `deepseek_v31` parser (a call is the name, then
`<｜tool▁sep｜>`, then its JSON arguments). `tool_calls._JsonSegment` reads it by the
`named` knob, as it reads Kimi K2's. Reasoning is `<think>` ... `</think>`: `think_tags`.

The bars in the markers are U+FF5C (fullwidth vertical line) and the spaces U+2581 (lower
one eighth block); each marker is one added token of DeepSeek's vocabulary.
"""

from __future__ import annotations

from replicas.pipeline.tool_syntax import CallGrammar, Syntax, ToolFormat

__all__ = ["DEEPSEEK_V31", "DEEPSEEK_V31_CALL", "DEEPSEEK_V31_RESULTS", "DEEPSEEK_V31_SECTION",
           "DEEPSEEK_V31_SEP"]

DEEPSEEK_V31_SECTION = ("<\uff5ctool\u2581calls\u2581begin\uff5c>",
                        "<\uff5ctool\u2581calls\u2581end\uff5c>")
DEEPSEEK_V31_CALL = ("<\uff5ctool\u2581call\u2581begin\uff5c>",
                     "<\uff5ctool\u2581call\u2581end\uff5c>")
DEEPSEEK_V31_SEP = "<\uff5ctool\u2581sep\uff5c>"
# V3.1's template wraps each result in output begin/end; the plural pair is V3's wrapper
# around all of them, still in the vocabulary, so a model may write either.
DEEPSEEK_V31_RESULTS = ("<\uff5ctool\u2581output\u2581begin\uff5c>",
                        "<\uff5ctool\u2581output\u2581end\uff5c>",
                        "<\uff5ctool\u2581outputs\u2581begin\uff5c>",
                        "<\uff5ctool\u2581outputs\u2581end\uff5c>")

# DeepSeek V3.1: one section of calls, each its name then its JSON arguments.
#   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
#   <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
# Each call is cut out by its own begin/end (as vLLM's parser finds them); the section
# markers around them are dropped from the answer.
DEEPSEEK_V31 = ToolFormat(
    name="deepseek_v31",
    syntax=Syntax.JSON,
    call_open=DEEPSEEK_V31_CALL[0],
    call_close=DEEPSEEK_V31_CALL[1],
    named=DEEPSEEK_V31_SEP,  # the stripped text before it is the name
    section=DEEPSEEK_V31_SECTION,
    signature=DEEPSEEK_V31_SECTION[:1],
    grammar=CallGrammar(
        trigger=DEEPSEEK_V31_SECTION[0],
        open=DEEPSEEK_V31_SECTION[0],
        head=f"{DEEPSEEK_V31_CALL[0]}{{name}}{DEEPSEEK_V31_SEP}",
        tail=DEEPSEEK_V31_CALL[1],
        sep="",  # "chain them directly without separators", as the model card says
        close=DEEPSEEK_V31_SECTION[1],
        markers=(*DEEPSEEK_V31_SECTION, *DEEPSEEK_V31_CALL, DEEPSEEK_V31_SEP),
    ),
    reserved=(*DEEPSEEK_V31_SECTION, *DEEPSEEK_V31_CALL, DEEPSEEK_V31_SEP,
              *DEEPSEEK_V31_RESULTS),
)
