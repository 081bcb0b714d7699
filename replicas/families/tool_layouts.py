"""Tool-format layouts several families share, each family filling in its own tags:
GLM's key/value calls (GLM, LongCat) and MiniMax-M2's XML section of `<invoke>` blocks
(MiniMax-M2, Muse Spark). A new family in one of these layouts is one call here.
"""

from __future__ import annotations

from replicas.families.tool_format import (
    CallGrammar,
    KeyValueTags,
    ParamLayout,
    Syntax,
    ToolFormat,
    XmlTags,
)

__all__ = ["key_value_format", "xml_section_format"]


def key_value_format(name: str, call: tuple[str, str], kv: KeyValueTags,
                     signature: tuple[str, ...]) -> ToolFormat:
    """A key/value family (`Syntax.KEY_VALUE`, GLM's layout): `CALL NAME`, then per argument
    `KEY k KEY_END VALUE v VALUE_END`, then `CALL_END`; parallel calls on lines of their own.
    The argument tags are the calls' own markup too (single tokens in the family's vocab)."""
    tags = (kv.key, kv.key_end, kv.value, kv.value_end)
    return ToolFormat(
        name=name,
        syntax=Syntax.KEY_VALUE,
        call_open=call[0],
        call_close=call[1],
        kv=kv,
        signature=signature,
        grammar=CallGrammar(
            trigger=call[0],
            head=f"{call[0]}{{name}}",
            tail=call[1],
            sep="\n",
            markers=(*call, *tags),
            params=ParamLayout(open=f"{kv.key}{{key}}{kv.key_end}{kv.value}", close=kv.value_end),
        ),
        reserved=(*call, *tags),
    )


def xml_section_format(name: str, section: tuple[str, str], xml: XmlTags, invoke: str,
                       parameter: str) -> ToolFormat:
    """An XML family with one section of calls (MiniMax-M2's layout), a line each:
    `SECTION` `<INVOKE name="f">` `<PARAMETER name="p">v</PARAMETER>`... `</INVOKE>` `SECTION_END`.
    The grammar writes every value as JSON where the reader takes values as JSON
    (`xml.json_values`), else strings raw."""
    return ToolFormat(
        name=name,
        syntax=Syntax.XML,
        call_open=section[0],
        call_close=section[1],
        xml=xml,
        signature=section[:1],
        grammar=CallGrammar(
            trigger=section[0],
            open=f"{section[0]}\n",
            head=f'<{invoke} name="{{name}}">\n',
            tail=f"</{invoke}>",
            sep="\n",  # parallel calls are more invoke blocks in the same section
            close=f"\n{section[1]}",
            markers=section,
            params=ParamLayout(open=f'<{parameter} name="{{key}}">', close=f"</{parameter}>",
                               after="\n", raw_strings=not xml.json_values),
        ),
        reserved=section,
    )
