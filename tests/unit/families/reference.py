"""mlx-lm 0.32's own parser of a tool format (`mlx_lm.tool_parsers.<module>`), the reference
reading of a family's calls: it must find the calls Orchard's parser finds."""

from __future__ import annotations

import importlib
import json
import re
from typing import Any

from tests.unit.test_tool_calls import Sample


def reference_calls(parser: str, text: str, schemas: dict[str, Any]
                    ) -> list[tuple[str, Any]]:
    """The calls mlx-lm's `parser` finds in `text`: each tool_call_start ... end span, parsed."""
    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
    tools = [{"function": {"name": n, "parameters": s}} for n, s in schemas.items()] or None
    spans = re.findall(re.escape(module.tool_call_start) + "(.*?)"
                       + re.escape(module.tool_call_end), text, flags=re.DOTALL)
    calls: list[tuple[str, Any]] = []
    for span in spans:
        parsed = module.parse_tool_call(span, tools)
        calls += [(c["name"], c["arguments"]) for c in
                  (parsed if isinstance(parsed, list) else [parsed])]
    return calls


def matches_the_reference(sample: Sample, parser: str) -> None:
    """mlx-lm's `parser` finds the sample's calls in its text."""
    ours = [(name, json.loads(arguments)) for name, arguments in sample.calls]
    assert reference_calls(parser, sample.text, sample.schemas) == ours
