"""Gemma's tool-call formats, one entry each (registered in `tool_formats.TOOL_FORMATS`):
Gemma 4 and FunctionGemma. mlx-lm 0.32's `gemma4` and `function_gemma` parsers are the
reference for the markup; `tool_gemma.py` reads it. Gemma 4 reasons in its `gemma4`
channel format (`<|channel>thought` ... `<channel|>`); FunctionGemma does not reason.
"""

from __future__ import annotations

from replicas.pipeline.tool_syntax import CallGrammar, GemmaTags, ParamLayout, Syntax, ToolFormat

__all__ = ["FUNCTION_GEMMA", "GEMMA4"]


def _gemma_format(name: str, call: tuple[str, str], quote: str, signature: tuple[str, ...],
                  results: tuple[str, str]) -> ToolFormat:
    """A Gemma family: `CALL call:NAME{key:VALUE,...}CALL_END`, one marker pair per call (so
    parallel calls follow each other), strings between `quote`s. `results` is the
    tool-result wrapper the template writes for a tool message, reserved too."""
    return ToolFormat(
        name=name,
        syntax=Syntax.GEMMA,
        call_open=call[0],
        call_close=call[1],
        gemma=GemmaTags(quote),
        signature=signature,
        grammar=CallGrammar(
            trigger=call[0],
            head=f"{call[0]}call:{{name}}{{",
            tail=f"}}{call[1]}",
            sep="",
            markers=(*call, quote),
            params=ParamLayout(open="{key}:", close="", sep=",", quote=quote),
        ),
        reserved=(*call, *results),
    )


_GEMMA4_CALL = ("<|tool_call>", "<tool_call|>")
# Gemma 4: one marker pair per call, bare keys, strings between `<|"|>`s.
#   <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>
# The grammar writes a top-level string that way and any other value as JSON, which the
# reader takes inside a Gemma value too.
GEMMA4 = _gemma_format("gemma4", _GEMMA4_CALL, '<|"|>',
                       _GEMMA4_CALL,  # both in the template, as mlx-lm checks
                       ("<|tool_response>", "<tool_response|>"))

_FG_CALL = ("<start_function_call>", "<end_function_call>")
# FunctionGemma (Gemma 3 270M): the same shape, strings between `<escape>`s.
#   <start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3}<end_function_call>
# Its reference reads a flat argument list: a value other than a string ends at the next
# comma, so the grammar's JSON for an object or a list argument is this reader's only.
FUNCTION_GEMMA = _gemma_format("function_gemma", _FG_CALL, "<escape>", _FG_CALL[:1],
                               ("<start_function_response>", "<end_function_response>"))
