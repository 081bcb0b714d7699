"""Tool calls through the whole output pipeline: every split equals the one-shot result.

Each sample is a realistic model output, run through `RequestDecoder` with tool parsing on
(one token per chunk, so chunk boundaries are token boundaries). For every split: markup
never reaches the answer, the deltas of a call add up to its End, the events come in the
contract's order, and streaming agrees with "feed all, then finish".
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.contract import (
    Channel,
    Finished,
    FinishReason,
    OutputEvent,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolSpec,
)
from replicas.families.registry import (
    CHANNEL_FORMATS,
    TOOL_FORMATS,
    detect_tool_format,
    get_channel_format,
    get_tool_format,
)
from replicas.families.tool_format import Syntax
from replicas.pipeline.channels import CallBoundary, ChannelRouter, initial_state
from replicas.pipeline.compose import with_tools
from replicas.pipeline.decoding import RequestDecoder
from replicas.pipeline.tool_calls.parser import READERS, ToolCallParser, ToolParsing, new_call_id
from replicas.pipeline.tool_calls.xml_reader import convert

R, A, T = Channel.REASONING, Channel.ANSWER, Channel.TOOL
EOS, LENGTH = FinishReason.EOS, FinishReason.LENGTH


@dataclass(frozen=True)
class Sample:
    channels: str  # channel format
    tools: str  # tool format
    text: str
    reasoning: str = ""
    answer: str = ""
    calls: tuple[tuple[str, str], ...] = ()  # (name, arguments text)
    reason: FinishReason = EOS  # how the stream ends
    stops: tuple[str, ...] = ()
    state: str = "answer"
    names: frozenset[str] | None = None
    schemas: dict[str, Any] = field(default_factory=dict)
    literal: bool = False  # the answer holds call markup on purpose (malformed, reasoning)
    stop: str | None = None  # the stop string that ends it


WEATHER = '{"city": "Paris"}'
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME_CALL = (
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET", "n": [1, {"x": "}"}]}}\n'
    "</tool_call>"
)
CODER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
HARMONY_ANALYSIS = "<|channel|>analysis<|message|>Need the weather.<|end|>"
HARMONY_CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Paris"}<|call|>'
)

SAMPLES: list[Sample] = [
    # hermes (Qwen3, the built-in model): think_tags and none
    Sample("think_tags", "hermes",
           "<think>\nThe user wants weather.\n</think>\n\nLet me check.\n" + HERMES_CALL,
           "The user wants weather.", "Let me check.\n", (("get_weather", WEATHER),)),
    Sample("think_tags", "hermes", "<think>\nTwo calls.\n</think>\n\n" + HERMES_CALL + "\n"
           + TIME_CALL, "Two calls.", "", (("get_weather", WEATHER),
           ("get_time", '{"tz": "CET", "n": [1, {"x": "}"}]}'))),
    Sample("none", "hermes", HERMES_CALL, calls=(("get_weather", WEATHER),)),
    Sample("think_tags", "hermes", "<think>\n\n</think>\n\n" + '<tool_call>\n{"name": "say", '
           '"arguments": {"text": "a STOP b \\" } STOP"}}\n</tool_call>', calls=(
           ("say", '{"text": "a STOP b \\" } STOP"}'),), stops=("STOP",)),
    Sample("think_tags", "hermes", "<think>\nMaybe " + HERMES_CALL + "? No.\n</think>\n\n"
           "No tool needed.", "Maybe " + HERMES_CALL + "? No.", "No tool needed.",
           literal=True),
    Sample("none", "hermes", "Oops <tool_call>\nnot json\n</tool_call>\n\nsorry",
           answer="Oops <tool_call>\nnot json\n</tool_call>sorry", literal=True),
    Sample("none", "hermes", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>',
           answer='<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', literal=True),
    Sample("none", "hermes", '<tool_call>\n{"arguments": {"a": [1, "]"]}, "name": "f"}\n'
           "</tool_call>", calls=(("f", '{"a": [1, "]"]}'),)),
    Sample("none", "hermes", '<tool_call>\n{"name": "f", "arguments": {"a": "unfini',
           calls=(("f", '{"a": "unfini'),), reason=LENGTH),
    Sample("none", "hermes", '<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>',
           answer='<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>',
           names=frozenset({"get_weather"}), literal=True),
    Sample("none", "hermes", "Hi! " + HERMES_CALL, answer="Hi", stops=("!",), stop="!"),
    # qwen3_coder
    Sample("none", "qwen3_coder", "Checking.\n" + CODER_CALL,
           answer="Checking.\n", calls=(("get_weather", '{"city": "Paris", "days": 3}'),)),
    Sample("think_tags", "qwen3_coder", "<think>\nok\n</think>\n\n" + CODER_CALL + "\n"
           + "<tool_call>\n<function=ping>\n</function>\n</tool_call>", "ok", "",
           (("get_weather", '{"city": "Paris", "days": 3}'), ("ping", "{}"))),
    Sample("none", "qwen3_coder", "<tool_call>\n<function=note>\n<parameter=text>\nEND "
           "here\nEND\n</parameter>\n<parameter=n>\n7\n</parameter>\n</function>\n"
           "</tool_call>", calls=(("note", '{"text": "END here\\nEND", "n": "7"}'),),
           stops=("END",), schemas={"note": {"properties": {"n": {"type": "string"}}}}),
    Sample("think_tags", "qwen3_coder", "<think>\n" + CODER_CALL + "\n</think>\n\nNo.",
           CODER_CALL, "No.", literal=True),
    Sample("none", "qwen3_coder", "<tool_call>\nhello\n</tool_call>",
           answer="<tool_call>\nhello\n</tool_call>", literal=True),
    Sample("none", "qwen3_coder", "<tool_call>\n<function=f>\n<parameter=q>\nhalf",
           calls=(("f", '{"q": "half"}'),), reason=LENGTH),
    # llama3_json
    Sample("none", "llama3_json", 'Sure.<|python_tag|>{"name": "get_weather", "parameters": '
           '{"city": "Paris"}}', answer="Sure.", calls=(("get_weather", WEATHER),)),
    Sample("none", "llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
           '{"name": "get_time", "arguments": {"tz": "STOP;"}}',
           calls=(("get_weather", WEATHER), ("get_time", '{"tz": "STOP;"}')),
           stops=("STOP",)),
    Sample("none", "llama3_json", 'Use {"name": "x"} as the key.',
           answer='Use {"name": "x"} as the key.', literal=True),
    Sample("think_tags", "llama3_json", '<think>\n{"name": "f", "parameters": {}}\n</think>'
           "\n\nDone.", '{"name": "f", "parameters": {}}', "Done.", literal=True),
    Sample("none", "llama3_json", "<|python_tag|>print('hi')",
           answer="<|python_tag|>print('hi')", literal=True),
    # mistral
    Sample("none", "mistral", 'Ok.[TOOL_CALLS][{"name": "get_weather", "arguments": '
           '{"city": "Paris"}}, {"name": "get_time", "arguments": {"tz": "STOP"}}]',
           answer="Ok.", calls=(("get_weather", WEATHER), ("get_time", '{"tz": "STOP"}')),
           stops=("STOP",)),
    Sample("none", "mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
           '[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}',
           calls=(("get_weather", WEATHER), ("get_time", '{"tz": "CET"}'))),
    Sample("think_tags", "mistral", "<think>\n[TOOL_CALLS]f[ARGS]{}\n</think>\n\nNo.",
           "[TOOL_CALLS]f[ARGS]{}", "No.", literal=True),
    Sample("none", "mistral", "[TOOL_CALLS]oops no args",
           answer="[TOOL_CALLS]oops no args", literal=True),
    Sample("none", "mistral", "[TOOL_CALLS]{bad}[ARGS]{}", answer="[TOOL_CALLS]{bad}[ARGS]{}",
           literal=True),
    # harmony (gpt-oss)
    Sample("harmony", "harmony", HARMONY_ANALYSIS + HARMONY_CALL, "Need the weather.",
           calls=(("get_weather", '{"city":"Paris"}'),)),
    Sample("harmony", "harmony", "<|start|>assistant to=functions.lookup<|channel|>commentary"
           ' json<|message|>{"q": "STOP"}<|call|>', calls=(("lookup", '{"q": "STOP"}'),),
           stops=("STOP",)),
    Sample("harmony", "harmony", "<|channel|>commentary<|message|>Checking to=functions.x "
           "now.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.",
           "Checking to=functions.x now.", "Sunny.", literal=True),
    Sample("harmony", "harmony", HARMONY_ANALYSIS + HARMONY_CALL.replace("<|call|>", "")
           + "<|start|>assistant<|channel|>commentary to=functions.get_time<|message|>{}"
           "<|call|>", "Need the weather.",
           calls=(("get_weather", '{"city":"Paris"}'), ("get_time", "{}"))),
    Sample("harmony", "harmony", HARMONY_CALL, answer='{"city":"Paris"}',
           names=frozenset({"other"}), literal=True),
    Sample("harmony", "harmony", HARMONY_CALL[:-12], calls=(("get_weather", '{"city":"Par'),),
           reason=LENGTH),
    # After the generation prompt `<|start|>assistant`, the recipient may open the completion.
    Sample("harmony", "harmony", HARMONY_CALL.removeprefix("<|start|>assistant").replace(
           "<|channel|>commentary to=functions.get_weather ",
           " to=functions.get_weather<|channel|>commentary "),
           calls=(("get_weather", '{"city":"Paris"}'),), state="opening"),
    Sample("harmony", "harmony", " to=functions.f<|channel|>commentary<|message|>{}<|call|>",
           names=frozenset({"other"}), answer="{}", state="opening", literal=True),
]
IDS = [f"{s.channels}+{s.tools}-{i}" for i, s in enumerate(SAMPLES)]


def decode(sample: Sample, chunks: Sequence[str], reason: FinishReason | None = None
           ) -> list[OutputEvent]:
    """The events for `sample.text` arriving as `chunks` (one token each)."""
    counter = itertools.count()
    parsing = ToolParsing(get_tool_format(sample.tools), sample.names, sample.schemas,
                          new_id=lambda: f"id{next(counter)}")
    decoder = RequestDecoder(
        lambda ids: "".join(chunks[i] for i in ids),
        with_tools(get_channel_format(sample.channels), parsing.format), A, sample.state,
        sample.stops, False, 5, tools=parsing,
    )
    events: list[OutputEvent] = []
    for token in range(len(chunks)):
        events += decoder.feed(token)
        if decoder.matched_stop is not None:
            break
    return events + decoder.finish(reason or sample.reason)


def check(sample: Sample, events: list[OutputEvent]) -> list[tuple[Any, ...]]:
    """Contract invariants on one run's events; returns the events in canonical form."""
    out: list[tuple[Any, ...]] = []
    open_call: int | None = None
    args: dict[int, str] = {}
    assert isinstance(events[-1], Finished)
    assert not any(isinstance(e, Finished) for e in events[:-1])
    for event in events[:-1]:
        if isinstance(event, TextDelta):
            assert event.channel in (R, A) and event.text
            assert not args, "text after a call"
            if out and out[-1][0] == event.channel:
                out[-1] = (event.channel, out[-1][1] + event.text)
            else:
                out.append((event.channel, event.text))
        elif isinstance(event, ToolCallStart):
            assert open_call is None and event.index == len(args)
            open_call, args[event.index] = event.index, ""
            out.append(("call", event.id, event.name))
        elif isinstance(event, ToolCallDelta):
            assert event.index == open_call and event.arguments
            args[event.index] += event.arguments
        else:
            assert isinstance(event, ToolCallEnd) and event.index == open_call
            assert event.arguments == args[event.index]  # the deltas add up to the End
            out.append(("end", event.arguments))
            open_call = None
    assert open_call is None
    finished = events[-1]
    out.append(("finished", finished.reason, finished.stop))
    return out


def expected(sample: Sample) -> list[tuple[Any, ...]]:
    want: list[tuple[Any, ...]] = []
    if sample.reasoning:
        want.append((R, sample.reasoning))
    if sample.answer:
        want.append((A, sample.answer))
    for i, (name, arguments) in enumerate(sample.calls):
        want += [("call", f"id{i}", name), ("end", arguments)]
    reason = sample.reason
    if sample.stop is not None:
        reason = FinishReason.STOP_SEQUENCE
    elif sample.calls and reason is EOS:
        reason = FinishReason.TOOL_CALLS
    want.append(("finished", reason, sample.stop))
    return want


def split(text: str, cuts: Iterable[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[lo:hi] for lo, hi in pairwise(bounds)]


def markup(sample: Sample) -> list[str]:
    fmt = with_tools(get_channel_format(sample.channels), get_tool_format(sample.tools))
    return [m for m in fmt.markers if m != '{"name"']


@pytest.mark.parametrize("sample", SAMPLES, ids=IDS)
def test_one_shot(sample: Sample) -> None:
    got = check(sample, decode(sample, [sample.text]))
    assert got == expected(sample)
    for name, arguments in sample.calls:
        if not arguments.endswith("unfini") and sample.reason is EOS:
            json.loads(arguments)  # the samples' complete calls are valid JSON
    if not sample.literal:
        answer = "".join(e[1] for e in got if e[0] in (A, R))
        assert not any(m in answer for m in markup(sample))


@pytest.mark.parametrize("sample", SAMPLES, ids=IDS)
def test_every_split_point(sample: Sample) -> None:
    want = expected(sample)
    for cut in range(1, len(sample.text)):
        assert check(sample, decode(sample, split(sample.text, [cut]))) == want, cut
    assert check(sample, decode(sample, list(sample.text))) == want


@settings(max_examples=300, deadline=None)
@given(sample=st.sampled_from(SAMPLES), data=st.data())
def test_random_multi_splits(sample: Sample, data: st.DataObject) -> None:
    cuts = data.draw(st.sets(st.integers(1, len(sample.text) - 1), max_size=20))
    assert check(sample, decode(sample, split(sample.text, cuts))) == expected(sample)


def test_arguments_stream_before_the_call_ends() -> None:
    sample = SAMPLES[0]
    events = decode(sample, list(sample.text))
    kinds = [type(e).__name__ for e in events]
    start = kinds.index("ToolCallStart")
    # Per character: the start comes right after the name, then one delta per character.
    assert kinds.count("ToolCallDelta") == len(WEATHER)
    assert kinds[start + 1 : start + 1 + len(WEATHER)] == ["ToolCallDelta"] * len(WEATHER)


def test_cancel_emits_no_end_and_no_tool_reason() -> None:
    sample = SAMPLES[8]  # a call cut off
    events = decode(sample, [sample.text], FinishReason.CANCELLED)
    assert not any(isinstance(e, ToolCallEnd) for e in events)
    assert isinstance(events[-1], Finished) and events[-1].reason is FinishReason.CANCELLED


def test_held_stop_prefix_is_flushed_before_the_call() -> None:
    sample = Sample("none", "hermes", "Checking\n" + HERMES_CALL, answer="Checking\n",
                    calls=(("get_weather", WEATHER),), stops=("\n\n",))
    assert check(sample, decode(sample, list(sample.text))) == expected(sample)


def test_without_tools_markup_stays_text() -> None:
    decoder = RequestDecoder(lambda ids: HERMES_CALL, get_channel_format("none"), A, None, (),
                             False, 1)
    events = decoder.feed(0) + decoder.finish(EOS)
    assert events[0] == TextDelta(A, HERMES_CALL)
    assert isinstance(events[1], Finished) and events[1].reason is EOS


def test_malformed_markup_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        decode(SAMPLES[5], [SAMPLES[5].text])
    assert "malformed tool call" in caplog.text


# The parser on its own.


def test_parser_ids_and_boundaries() -> None:
    parser = ToolCallParser(ToolParsing(get_tool_format("hermes")))
    events = parser.feed(CallBoundary(True, "<tool_call>"))
    events += parser.feed('{"name": "f", "argu')
    events += parser.feed('ments": {"a": 1}}')
    events += parser.feed(CallBoundary(False, "</tool_call>"))
    start = events[0]
    assert isinstance(start, ToolCallStart) and start.name == "f"
    assert len(start.id) == 24 and int(start.id, 16) >= 0
    assert events[1:] == [ToolCallDelta(0, '{"a": 1}'), ToolCallEnd(0, '{"a": 1}')]
    assert parser.finish() == [] and parser.calls == 1
    assert new_call_id() != new_call_id()


def test_parser_keeps_junk_after_arguments_out() -> None:
    parser = ToolCallParser(ToolParsing(get_tool_format("hermes")))
    events = parser.feed(CallBoundary(True, "<tool_call>"))
    events += parser.feed('{"name": "f", "arguments": {"a": 1}, "x": 2} trailing')
    events += parser.finish()
    assert events[1:] == [ToolCallDelta(0, '{"a": 1}'), ToolCallEnd(0, '{"a": 1}')]


def test_parser_ends_a_started_call_with_bad_arguments() -> None:
    parser = ToolCallParser(ToolParsing(get_tool_format("hermes")))
    events = parser.feed(CallBoundary(True, "<tool_call>"))
    events += parser.feed('{"name": "f", "arguments": {"a": nope}}')
    events += parser.feed(CallBoundary(False, "</tool_call>"))
    assert events[-1] == ToolCallEnd(0, '{"a": nope}')


def test_from_specs_reads_names_and_schemas() -> None:
    specs = (ToolSpec("f", parameters='{"type": "object", "properties": {"n": {"type": '
                      '"integer"}}}'), ToolSpec("g", parameters="not json"))
    parsing = ToolParsing.from_specs(get_tool_format("qwen3_coder"), specs)
    assert parsing.names == frozenset({"f", "g"}) and set(parsing.schemas) == {"f"}
    assert ToolParsing.from_specs(get_tool_format("hermes"), ()).names is None


@pytest.mark.parametrize(
    ("value", "kind", "want"),
    [
        ("3", None, 3), ("3.5", None, 3.5), ("true", None, True), ("null", None, None),
        ('{"a": 1}', None, {"a": 1}), ("[1]", None, [1]), ("Paris", None, "Paris"),
        ('"quoted"', None, '"quoted"'), ("3", "string", "3"), ("3", "integer", 3),
        ("3.0", "integer", 3), ("x", "integer", "x"), ("True", "boolean", True),
        ("[1, 2]", "array", [1, 2]), ("7", ["integer", "null"], 7),
    ],
)
def test_qwen3_coder_values(value: str, kind: object, want: object) -> None:
    assert convert(value, kind) == want


# Router and formats.


def test_router_reports_boundaries_and_harmony_names() -> None:
    fmt = with_tools(get_channel_format("harmony"), get_tool_format("harmony"))
    router = ChannelRouter(fmt)
    items = router.feed_with_calls(HARMONY_ANALYSIS + HARMONY_CALL) + router.finish_with_calls()
    assert items == [
        TextDelta(R, "Need the weather."),
        CallBoundary(True, "<|message|>", "get_weather"),
        TextDelta(T, '{"city":"Paris"}'),
        CallBoundary(False, "<|call|>"),
    ]
    router = ChannelRouter(with_tools(get_channel_format("none"), get_tool_format("hermes")))
    items = router.feed_with_calls(HERMES_CALL + HERMES_CALL)
    assert [i for i in items if isinstance(i, CallBoundary)] == [
        CallBoundary(True, "<tool_call>"), CallBoundary(False, "</tool_call>"),
        CallBoundary(True, "<tool_call>"), CallBoundary(False, "</tool_call>"),
    ]
    # feed() keeps its old shape: text pieces only.
    router = ChannelRouter(with_tools(get_channel_format("none"), get_tool_format("hermes")))
    assert router.feed("a" + HERMES_CALL) == [
        TextDelta(A, "a"), TextDelta(T, HERMES_CALL[11:-12])]
    assert router.channel is A


def test_composition_is_cached_and_checked() -> None:
    think, hermes = get_channel_format("think_tags"), get_tool_format("hermes")
    composed = with_tools(think, hermes)
    assert with_tools(think, hermes) is composed and with_tools(composed, hermes) is composed
    assert with_tools(think, get_tool_format("none")) is think
    assert composed.states["reasoning"] == think.states["reasoning"]  # no calls in reasoning
    with pytest.raises(ValueError, match="headers"):
        with_tools(think, get_tool_format("harmony"))


@settings(max_examples=200, deadline=None)
@given(
    base=st.sampled_from(list(CHANNEL_FORMATS.values())),
    tools=st.sampled_from(["hermes", "qwen3_coder", "llama3_json", "mistral"]),
    parts=st.lists(st.sampled_from(["<think>", "</think>", "\n", "a b", "<|channel|>",
                                    "final", "<|message|>", "<|end|>", "{", "こ"]),
                   max_size=12),
)
def test_composed_format_routes_like_its_base_without_calls(
    base: Any, tools: str, parts: list[str]
) -> None:
    text = "".join(parts)
    composed = with_tools(base, get_tool_format(tools))
    for state in (n for n, s in base.states.items() if s.channel is not None):
        plain, extended = ChannelRouter(base, state=state), ChannelRouter(composed, state=state)
        want = joined(plain.feed(text) + plain.finish())
        assert joined(extended.feed(text) + extended.finish()) == want


def joined(pieces: list[TextDelta]) -> list[tuple[Channel, str]]:
    out: list[tuple[Channel, str]] = []
    for piece in pieces:
        if out and out[-1][0] is piece.channel:
            out[-1] = (piece.channel, out[-1][1] + piece.text)
        else:
            out.append((piece.channel, piece.text))
    return out


def test_harmony_calls_agree_with_the_real_encoding(harmony_encoding: Any) -> None:
    """Completions rendered by openai-harmony's encoder, one token per chunk, parse into the
    same reasoning, answer and function calls as its own parsers read in them."""
    from tests.unit.test_channels import harmony_turns, parsed_by_harmony

    for prompt, completion in harmony_turns(harmony_encoding):
        messages = parsed_by_harmony(harmony_encoding, completion)
        calls = tuple((m.recipient.removeprefix("functions."), m.content[0].text)
                      for m in messages if (m.recipient or "").startswith("functions."))
        texts = [(m.channel, m.content[0].text) for m in messages
                 if not (m.recipient or "").startswith("functions.")]
        sample = Sample(
            "harmony", "harmony", harmony_encoding.decode(completion),
            reasoning="".join(t for c, t in texts if c != "final"),
            answer="".join(t for c, t in texts if c == "final"),
            calls=calls, state=initial_state(get_channel_format("harmony"), prompt),
        )
        chunks = [harmony_encoding.decode([t]) for t in completion]
        assert check(sample, decode(sample, chunks)) == expected(sample), chunks
        assert check(sample, decode(sample, [sample.text])) == expected(sample)


def test_every_syntax_with_calls_has_a_reader() -> None:
    assert set(READERS) == set(Syntax) - {Syntax.NONE}
    assert {fmt.syntax for fmt in TOOL_FORMATS.values()} <= {*READERS, Syntax.NONE}


def test_call_open_markers() -> None:
    opens = {name: fmt.call_open for name, fmt in TOOL_FORMATS.items()}
    assert opens == {"harmony": None, "qwen3_coder": "<tool_call>", "hermes": "<tool_call>",
                     "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]", "none": None,
                     "kimi_k2": "<|tool_call_begin|>", "glm47": "<tool_call>",
                     "minimax_m2": "<minimax:tool_call>", "pythonic": "<|tool_call_start|>",
                     "kimi_k3": "<|open|>call", "gemma4": "<|tool_call>",
                     "function_gemma": "<start_function_call>",
                     "longcat": "<longcat_tool_call>", "minicpm5": "<function name=",
                     "muse_spark": "<atem:function_calls>",
                     "deepseek_v31": "<｜tool▁call▁begin｜>"}


@pytest.mark.parametrize(
    ("template", "vocab", "want"),
    [
        ("{% if tools %}<tool_call>{{ t }}</tool_call>{% endif %}", [], "hermes"),
        (None, {"<tool_call>", "</tool_call>"}, "hermes"),
        ("<tool_call>\n<function=x>\n<parameter=y>", {"<tool_call>"}, "qwen3_coder"),
        ("{{ '<|python_tag|>' }}", [], "llama3_json"),
        (None, {"[TOOL_CALLS]", "[ARGS]"}, "mistral"),
        (None, {"<|channel|>", "<|message|>"}, "harmony"),
        ("<|channel|>commentary to=functions.x", [], "harmony"),
        ("<|im_start|>{{ m.content }}<|im_end|>", {"<think>"}, "none"),
        (None, [], "none"),
    ],
)
def test_detect_tool_format(template: str | None, vocab: Sequence[str], want: str) -> None:
    assert detect_tool_format(template, vocab) == want


def test_unknown_tool_format_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="deepseek_v31, function_gemma, gemma4, glm47, "
                                         "harmony, hermes, kimi_k2, kimi_k3, llama3_json, "
                                         "longcat, minicpm5, minimax_m2, mistral, muse_spark, "
                                         "none, pythonic"):
        get_tool_format("xml")


PAIRS = [("none", "hermes"), ("think_tags", "hermes"), ("none", "qwen3_coder"),
         ("none", "llama3_json"), ("none", "mistral"), ("harmony", "harmony")]
FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "<think>", "</think>", "<|python_tag|>",
    "[TOOL_CALLS]", "[ARGS]", "<function=f>", "<parameter=p>", "</parameter>", "</function>",
    "<|start|>assistant", "<|channel|>", "commentary", " to=functions.f ", "analysis",
    "final", "<|message|>", "<|call|>", "<|end|>", '{"name"', '{"name": "f"', ', ', ": ",
    '"arguments": ', '"parameters": ', '{"a": [1, "}"]}', "{", "}", "[", "]", '"', "\\",
    ";", "\n", " ", "x", "こ", "STOP",
]


def random_markup_test(pairs: Sequence[tuple[str, str]], fragments: Sequence[str],
                       examples: int) -> Callable[[], None]:
    """A test that random markup of `fragments`, read by each (channels, tools) pair of
    `pairs`, gives the same events whole and cut at random points (`split_agrees`)."""
    @settings(max_examples=examples, deadline=None)
    @given(pair=st.sampled_from(pairs), parts=st.lists(st.sampled_from(fragments), max_size=16),
           data=st.data())
    def test(pair: tuple[str, str], parts: list[str], data: st.DataObject) -> None:
        split_agrees(pair, parts, data)
    return test


test_random_markup_never_breaks_the_contract = random_markup_test(PAIRS, FRAGMENTS, 500)


def split_agrees(pair: tuple[str, str], parts: list[str], data: st.DataObject) -> None:
    """Random markup fed whole and cut at random points gives the same events."""
    text = "".join(parts) or "x"
    sample = Sample(*pair, text, stops=("STOP",))
    whole = check(sample, decode(sample, [text]))
    cuts = data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=12))
    assert check(sample, decode(sample, split(text, cuts))) == whole


def one_shot_and_every_split_agree(sample: Sample) -> None:
    """The sample in one shot, cut at every point and one character per chunk: the same
    events, and unless the sample is literal no markup in its answer or reasoning."""
    want = expected(sample)
    got = check(sample, decode(sample, [sample.text]))
    assert got == want
    if not sample.literal:
        answer = "".join(e[1] for e in got if e[0] in (A, R))
        assert not any(m in answer for m in markup(sample))
    for cut in range(1, len(sample.text)):
        assert check(sample, decode(sample, split(sample.text, [cut]))) == want, cut
    assert check(sample, decode(sample, list(sample.text))) == want
