"""Markup fragments of the families, mixed at random by each family's random-markup test
(`test_tool_calls.random_markup_test`): a family's reader must keep the contract whatever
its own markup, or another family's, or plain text around it looks like."""

from __future__ import annotations

Q = '<|"|>'  # Gemma 4's string quote
FRAGMENTS = list(dict.fromkeys([
    # Kimi K2, GLM, MiniMax-M2, LFM2's pythonic calls, `<think>` reasoning
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "functions.f:0", "<tool_call>",
    "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "<minimax:tool_call>", "</minimax:tool_call>", '<invoke name="f">', "</invoke>",
    '<parameter name="p">', "</parameter>", "<think>", "</think>", '{"a": [1, "}"]}', "{",
    "<|tool_call_start|>", "[", "]", "f(", "a=1", "b='x'", ", ", ")", "(",
    "}", '"', "\n", " ", "f", "x", "こ", "STOP",
    # Gemma 4, FunctionGemma, LongCat, MiniCPM5, Muse Spark, Kimi K3 and their reasoning
    "<|tool_call>", "<tool_call|>", "call:f{", "call:", Q, "<|", "<start_function_call>",
    "<end_function_call>", "<escape>", "a:", ",", "}", "{", "[", "]", "<longcat_tool_call>",
    "</longcat_tool_call>", "<longcat_arg_key>", "</longcat_arg_key>", "<longcat_arg_value>",
    "</longcat_arg_value>", "\\n", '<function name="f">', "<function name=", "</function>",
    '<param name="p">', "</param>", "<![CDATA[", "]]>", "<atem:function_calls>",
    "</atem:function_calls>", '<atem:invoke name="f">', "</atem:invoke>",
    '<atem:parameter name="p">', "</atem:parameter>", "<|open|>tools<|sep|>",
    "<|close|>tools<|sep|>", '<|open|>call tool="f"<|sep|>', "<|close|>call<|sep|>",
    '<|open|>argument key="k" type="integer"<|sep|>', "<|close|>argument<|sep|>",
    '<|open|>json type="object"<|sep|>', "<|close|>json<|sep|>", "<|open|>think<|sep|>",
    "<|close|>think<|sep|>", "<|channel>thought", "<channel|>", "<longcat_think>",
    "</longcat_think>", '"', "\n", " ", "1", "x", "こ", "STOP",
]))
# Examples per family: the pool is about twice each old group's, so each family's own
# markup comes up about as often as when the groups were tested apart.
EXAMPLES = 150
