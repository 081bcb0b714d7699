"""Tools the grammar tests of Kimi K2, GLM, MiniMax-M2 and LFM2 offer: `LOOSE`, three
optional arguments of three types; `OPEN`, any object."""

from __future__ import annotations

from tests.unit.test_guided_tools import tool

LOOSE = tool("f", {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}}})
OPEN = tool("g", {"type": "object"})
