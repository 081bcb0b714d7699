"""The tests every family's file makes for itself, from its own data.

`markup_tests`: each sample runs through the whole output pipeline as `test_tool_calls.py`
runs its own (one shot, cut at every point, one character per chunk: the same events), and
complete calls are also read by the reference parser (mlx-lm 0.32's own, by the tool
format's name), which must find the same names and arguments. `grammar_tests`: the
family's grammar refuses near misses (its canonical calls are in `test_guided_tools.py`,
which iterates over every format), what it writes the parser reads back as the arguments
that were meant, and a `tool_choice` naming a tool forces that tool.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from replicas.contract import FinishReason, ToolChoice, ToolSpec
from tests.unit.families.reference import matches_the_reference
from tests.unit.test_guided_tools import (LOOSE, ROUND_TRIP, VARIANTS, accepts, call_text,
                                          grammar, named_auto_choice_forces_that_tool,
                                          refuses_malformed, section)
from tests.unit.test_tool_calls import Sample, check, decode, one_shot_and_every_split_agree

Test = Callable[..., None]


def markup_tests(samples: Sequence[Sample], reference: str | None = None) -> tuple[Test, Test]:
    """(every sample whole and split, its complete calls as the reference parser reads them);
    `reference` names mlx-lm's parser module, else each sample's tool format does."""
    @pytest.mark.parametrize("sample", samples,
                             ids=[f"{s.channels}+{s.tools}-{i}" for i, s in enumerate(samples)])
    def one_shot_and_every_split_point_agree(sample: Sample) -> None:
        one_shot_and_every_split_agree(sample)

    @pytest.mark.parametrize("sample", [s for s in samples
                                        if s.calls and s.reason is not FinishReason.LENGTH],
                             ids=lambda s: f"{s.tools}")
    def calls_match_mlx_lm_reference_parser(sample: Sample) -> None:
        matches_the_reference(sample, reference or sample.tools)

    return one_shot_and_every_split_point_agree, calls_match_mlx_lm_reference_parser


def grammar_tests(fmt: str, malformed: Sequence[str], channels: str,
                  keep: Callable[[dict[str, Any]], bool] = lambda args: True,
                  loose: ToolSpec = LOOSE) -> tuple[Test, Test, Test]:
    """(refuses `malformed`, writes what the parser reads back, a named choice forces its
    tool) for tool format `fmt`, routed with channel format `channels`; `keep` picks the
    `ROUND_TRIP` arguments the round trip covers."""
    @pytest.mark.parametrize("tok", VARIANTS)
    def grammar_refuses_malformed_markup(tok: str) -> None:
        refuses_malformed(fmt, tok, loose, malformed)

    @pytest.mark.parametrize("tok", VARIANTS)
    def what_the_grammar_writes_the_parser_reads(tok: str) -> None:
        g = grammar(fmt, ToolChoice("required"), tok, tools=(loose,))
        schemas = {"f": json.loads(loose.parameters)}
        for args in filter(keep, ROUND_TRIP):
            text = section(fmt, call_text(fmt, "f", args))
            assert accepts(g, text, tok), text
            sample = Sample(channels, fmt, text, schemas=schemas,
                            calls=(("f", json.dumps(args) if args else "{}"),))
            got = check(sample, decode(sample, [text]))
            assert [json.loads(e[1]) for e in got if e[0] == "end"] == [args], text

    def named_choice_forces_that_tool() -> None:
        named_auto_choice_forces_that_tool(fmt)

    return (grammar_refuses_malformed_markup, what_the_grammar_writes_the_parser_reads,
            named_choice_forces_that_tool)
