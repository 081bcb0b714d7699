"""Tagged tool-call formats of LongCat, MiniCPM5, Muse Spark and Kimi K3, one entry each
(registered in `tool_formats.TOOL_FORMATS`). mlx-lm 0.32's `tool_parsers` (`longcat`,
`minicpm5`, `muse_spark`, `kimi_k3`) are the reference for each markup; their readers are
`tool_glm.py`, `tool_xml.py` and `tool_xtml.py`.
"""

from __future__ import annotations

from replicas.pipeline.tool_families import key_value_format, xml_section_format
from replicas.pipeline.tool_syntax import (
    CallGrammar,
    KeyValueTags,
    ParamLayout,
    Syntax,
    ToolFormat,
    XmlTags,
)

__all__ = ["KIMI_K3", "LONGCAT", "MINICPM5", "MUSE_SPARK"]

# Meituan LongCat: GLM's key/value layout with its own tags (reasoning: `longcat_think`).
#   <longcat_tool_call>NAME<longcat_arg_key>K</longcat_arg_key>
#   <longcat_arg_value>V</longcat_arg_value></longcat_tool_call>
LONGCAT = key_value_format(
    "longcat", ("<longcat_tool_call>", "</longcat_tool_call>"),
    KeyValueTags("<longcat_arg_key>", "</longcat_arg_key>", "<longcat_arg_value>",
                 "</longcat_arg_value>"),
    ("<longcat_tool_call>",))

# OpenBMB MiniCPM5: no wrapper, each call one `<function>` block; the router cuts at
# `<function name=` so the reader starts at the name (`XmlTags.function` is empty).
#   <function name="f"><param name="p">value</param></function>
# A value holding `<`, `&` or a newline comes as `<![CDATA[...]]>`.
MINICPM5 = ToolFormat(
    name="minicpm5",
    syntax=Syntax.XML,
    call_open="<function name=",
    call_close="</function>",
    xml=XmlTags(function="", function_end="</function>", parameter="<param name=",
                parameter_end="</param>", quoted=True, strip_values=True, cdata=True),
    signature=('<function name="', '<param name="'),  # both in the template, as mlx-lm checks
    grammar=CallGrammar(
        trigger="<function name=",
        head='<function name="{name}">',
        tail="</function>",
        sep="\n",
        params=ParamLayout(open='<param name="{key}">', close="</param>"),
    ),
    reserved=("<function name=", "</function>"),
)

# Muse Spark (XML_ATEM): MiniMax-M2's layout with `atem:` tags. A value that parses as JSON
# is that value (a quoted string too), so the grammar writes every value as JSON.
#   <atem:function_calls>
#   <atem:invoke name="f">
#   <atem:parameter name="p">"Paris"</atem:parameter>
#   </atem:invoke>
#   </atem:function_calls>
MUSE_SPARK = xml_section_format(
    "muse_spark", ("<atem:function_calls>", "</atem:function_calls>"),
    XmlTags(function="<atem:invoke", function_end="</atem:invoke>", parameter="<atem:parameter",
            parameter_end="</atem:parameter>", name_attr="name", json_values=True),
    "atem:invoke", "atem:parameter")

_K3_SECTION = ("<|open|>tools<|sep|>", "<|close|>tools<|sep|>")
_K3_CALL = ("<|open|>call", "<|close|>call<|sep|>")
_K3_JSON = ('<|open|>json type="object"<|sep|>', "<|close|>json<|sep|>")
# Kimi K3 (XTML): a tools section of calls, each typed argument blocks or one JSON block.
#   <|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>
#   <|open|>argument key="city" type="string"<|sep|>Tokyo<|close|>argument<|sep|>
#   <|close|>call<|sep|><|close|>tools<|sep|>
# The grammar writes the JSON block form, which carries any schema. The family is tied to
# its `xtml` channel format, as mlx-lm tells it by the XTML vocabulary alone.
KIMI_K3 = ToolFormat(
    name="kimi_k3",
    syntax=Syntax.XTML,
    call_open=_K3_CALL[0],
    call_close=_K3_CALL[1],
    section=_K3_SECTION,
    channel_format="xtml",
    grammar=CallGrammar(
        trigger=_K3_SECTION[0],
        open=_K3_SECTION[0],
        head=f'{_K3_CALL[0]} tool="{{name}}" index="{{index}}"<|sep|>{_K3_JSON[0]}',
        tail=f"{_K3_JSON[1]}{_K3_CALL[1]}",
        sep="",
        close=_K3_SECTION[1],
        markers=("<|open|>", "<|close|>", "<|sep|>"),
        text_markers=("<|open|>response<|sep|>", "<|close|>response<|sep|>"),
    ),
    # Each of these is several tokens (`<|open|>` also opens plain messages): none is banned,
    # all are dropped from the answer under `tool_choice: none`.
    reserved=(*_K3_SECTION, *_K3_CALL, "<|open|>argument", "<|close|>argument<|sep|>",
              "<|open|>json", _K3_JSON[1]),
)
