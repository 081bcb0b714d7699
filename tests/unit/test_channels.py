"""Channel router: every split equals the one-shot split, which equals a naive reference."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.contract import Channel
from replicas.families import harmony
from replicas.families.channel_format import ByHeader, ChannelFormat, Rule, State
from replicas.families.registry import (
    CHANNEL_FORMATS,
    detect_channel_format,
    get_channel_format,
)
from replicas.pipeline.channels import ChannelRouter, initial_channel, initial_state
from tests.harmony_vocab import render_completion

R, A = Channel.REASONING, Channel.ANSWER
Pieces = list[tuple[Channel, str]]
THINK = get_channel_format("think_tags")
HARMONY = get_channel_format("harmony")
NONE = get_channel_format("none")


def merged(pieces: Iterable[tuple[Channel, str]]) -> Pieces:
    out: Pieces = []
    for channel, text in pieces:
        if out and out[-1][0] is channel:
            out[-1] = (channel, out[-1][1] + text)
        elif text:
            out.append((channel, text))
    return out


def route(fmt: ChannelFormat, state: str, chunks: Sequence[str]) -> Pieces:
    router = ChannelRouter(fmt, state=state)
    pieces: Pieces = []
    for chunk in chunks:
        deltas = router.feed(chunk)
        # Within one feed: no empty pieces, neighbours merged.
        assert all(d.text for d in deltas)
        assert all(a.channel is not b.channel for a, b in pairwise(deltas))
        pieces += [(d.channel, d.text) for d in deltas]
    pieces += [(d.channel, d.text) for d in router.finish()]
    return merged(pieces)


def split(text: str, cuts: Iterable[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[lo:hi] for lo, hi in pairwise(bounds)]


def reference(fmt: ChannelFormat, state: str, text: str) -> Pieces:
    """The format's semantics, written plainly: the earliest-ending marker of the current
    state fires (longest on a tie); content between markers goes to the state's channel.
    A start-only marker fires only while the state's content before it is whitespace."""
    out: Pieces = []
    pos = 0
    while True:
        spec = fmt.states[state]
        hit: tuple[int, Rule] | None = None
        for end in range(pos + 1, len(text) + 1):
            rules = [
                r for r in spec.rules
                if text.endswith(r.marker, pos, end)
                and not (r.at_start and text[pos : end - len(r.marker)].strip())
            ]
            if rules:
                hit = (end, max(rules, key=lambda r: len(r.marker)))
                break
        stop = hit[0] - len(hit[1].marker) if hit else len(text)
        content = text[pos:stop]
        if spec.strip_leading_newlines:
            content = content.lstrip("\n")
        if spec.channel is not None:
            out.append((spec.channel, content))
        if hit is None:
            return merged(out)
        target = hit[1].to
        if isinstance(target, ByHeader):
            word = re.match(r"[^\s<]*", content[:64].lstrip())
            assert word is not None
            target = target.routes.get(word.group(), target.default)
        pos, state = hit[0], target


# (format, start state, output, expected pieces, may the content contain marker text)
SAMPLES: list[tuple[ChannelFormat, str, str, Pieces, bool]] = [
    (
        THINK,
        "answer",
        "<think>\nLet me think.\nOK.\n</think>\n\nThe answer is 4.",
        [(R, "Let me think.\nOK."), (A, "The answer is 4.")],
        False,
    ),
    (
        THINK,
        "reasoning",
        "Okay, so\n\n2+2.\n</think>\n\nHi!\n\nBye.\n",
        [(R, "Okay, so\n\n2+2."), (A, "Hi!\n\nBye.\n")],
        False,
    ),
    (THINK, "answer", "<think>\n\n</think>\n\nHello", [(A, "Hello")], False),
    (THINK, "answer_after", "Plain <think> talk", [(A, "Plain <think> talk")], True),
    (
        THINK,
        "answer",
        "<think>\nhm\n</think>\n\nUse <think> tags.",
        [(R, "hm"), (A, "Use <think> tags.")],
        True,
    ),
    (THINK, "answer", "<think>\nstill thinking when cut", [(R, "still thinking when cut")], False),
    (THINK, "answer", "\n\nraw completion", [(A, "\n\nraw completion")], False),
    (
        THINK,
        "reasoning",
        "a long thought" + THINK.reasoning_end + "Forced answer",
        [(R, "a long thought"), (A, "Forced answer")],
        False,
    ),
    (
        NONE,
        "answer",
        "<think>x</think>\n\n<|channel|>",
        [(A, "<think>x</think>\n\n<|channel|>")],
        True,
    ),
    (
        HARMONY,
        "answer",
        "<|channel|>analysis<|message|>User asks 2+2.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is 4.",
        [(R, "User asks 2+2."), (A, "It is 4.")],
        False,
    ),
    (
        HARMONY,
        "answer",
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city":"Paris"}<|call|>',
        [(R, 'Need weather.{"city":"Paris"}')],
        False,
    ),
    (
        HARMONY,
        "answer",
        "<|start|>assistant to=functions.x<|channel|>commentary json<|message|>{}<|call|>",
        [(R, "{}")],
        False,
    ),
    (
        HARMONY,
        "analysis",
        "more thought" + HARMONY.reasoning_end + "Answer.",
        [(R, "more thought"), (A, "Answer.")],
        False,
    ),
    (HARMONY, "answer", "No protocol at all", [(A, "No protocol at all")], False),
    (
        HARMONY,
        "final",
        "こんにちは<|end|>",
        [(A, "こんにちは")],
        False,
    ),
]
IDS = [f"{fmt.name}-{i}" for i, (fmt, *_rest) in enumerate(SAMPLES)]


@pytest.mark.parametrize(("fmt", "state", "text", "want", "literal"), SAMPLES, ids=IDS)
def test_sample_one_shot(
    fmt: ChannelFormat, state: str, text: str, want: Pieces, literal: bool
) -> None:
    assert route(fmt, state, [text]) == want
    assert reference(fmt, state, text) == want
    if not literal:
        assert not any(m in piece for _, piece in want for m in fmt.markers)


@pytest.mark.parametrize(("fmt", "state", "text", "want", "literal"), SAMPLES, ids=IDS)
def test_sample_every_split_point(
    fmt: ChannelFormat, state: str, text: str, want: Pieces, literal: bool
) -> None:
    for cut in range(1, len(text)):
        assert route(fmt, state, split(text, [cut])) == want, cut
    assert route(fmt, state, list(text)) == want


@settings(max_examples=200, deadline=None)
@given(sample=st.sampled_from(SAMPLES), data=st.data())
def test_sample_random_multi_splits(
    sample: tuple[ChannelFormat, str, str, Pieces, bool], data: st.DataObject
) -> None:
    fmt, state, text, want, _ = sample
    cuts = data.draw(st.sets(st.integers(1, len(text) - 1), max_size=12))
    assert route(fmt, state, split(text, cuts)) == want


def fragments(fmt: ChannelFormat) -> st.SearchStrategy[str]:
    """Markers, their prefixes and suffixes, newlines and filler: the tricky neighbourhoods."""
    parts = {"\n", "\n\n", "a", "b c", "<", "|", "こんにちは", fmt.reasoning_end or "z"}
    for marker in fmt.markers:
        parts |= {marker, marker[: len(marker) // 2], marker[len(marker) // 2 :]}
    parts |= {"analysis", "final", "commentary", "assistant", " to=functions.f "}
    return st.sampled_from(sorted(parts))


@st.composite
def streams(draw: st.DrawFn) -> tuple[ChannelFormat, str, str, list[int]]:
    fmt = draw(st.sampled_from(list(CHANNEL_FORMATS.values())))
    state = draw(st.sampled_from([n for n, s in fmt.states.items() if s.channel is not None]))
    text = "".join(draw(st.lists(fragments(fmt), max_size=14)))
    cuts = draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=10)) if text else set()
    return fmt, state, text, sorted(cuts)


@settings(max_examples=500, deadline=None)
@given(streams())
def test_random_streams_match_reference(case: tuple[ChannelFormat, str, str, list[int]]) -> None:
    fmt, state, text, cuts = case
    want = reference(fmt, state, text)
    assert route(fmt, state, [text]) == want
    assert route(fmt, state, split(text, cuts)) == want


def test_holds_back_only_a_possible_marker() -> None:
    router = ChannelRouter(THINK, state="reasoning")
    assert [d.text for d in router.feed("abc</th")] == ["abc"]
    assert [d.text for d in router.feed("x")] == ["</thx"]
    assert [d.text for d in router.feed("y\n")] == ["y"]  # "\n" may start "\n</think>"
    assert router.finish()[0].text == "\n"


def test_length_cut_flushes_reasoning_and_partial_marker() -> None:
    router = ChannelRouter(THINK, initial=Channel.REASONING)
    router.feed("thinking\n</thi")
    assert router.channel is R and not router.reasoning_ended
    assert [(d.channel, d.text) for d in router.finish()] == [(R, "\n</thi")]


def test_channel_and_reasoning_ended_follow_the_stream() -> None:
    router = ChannelRouter(HARMONY)
    assert router.channel is A
    router.feed("<|channel|>analysis<|message|>x")
    assert router.channel is R and not router.reasoning_ended
    router.feed("<|end|><|start|>assistant<|chan")
    assert router.channel is R and router.reasoning_ended  # inside the header, still R
    router.feed("nel|>final<|message|>")
    assert router.channel is A


def test_header_text_is_bounded_and_never_emitted() -> None:
    router = ChannelRouter(HARMONY, state="analysis")
    pieces = router.feed("<|channel|>" + "final" + "x" * 10_000 + "<|message|>ok")
    assert [(d.channel, d.text) for d in pieces] == [(R, "ok")]  # unknown channel: reasoning


def test_initial_state_from_prompt() -> None:
    assert initial_channel(THINK, "<|im_start|>assistant\n<think>\n") is R  # DeepSeek-R1
    assert initial_channel(THINK, "<|im_start|>assistant\n<think>\n\n</think>\n\n") is A
    assert initial_state(THINK, "assistant\n<think>\n\n</think>\n\n") == "answer_after"
    assert initial_state(THINK, "<|im_start|>assistant\n") == "answer"
    assert initial_channel(HARMONY, "<|start|>assistant") is A
    assert initial_channel(HARMONY, "<|start|>assistant<|channel|>analysis<|message|>") is R
    assert initial_channel(NONE, "<think>\n") is A


def test_router_start_validation() -> None:
    with pytest.raises(ValueError, match="no reasoning channel"):
        ChannelRouter(NONE, initial=Channel.REASONING)
    with pytest.raises(ValueError, match="not a content state"):
        ChannelRouter(HARMONY, state="header")
    router = ChannelRouter(NONE)
    router.finish()
    with pytest.raises(RuntimeError):
        router.feed("x")


def test_unknown_format_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="gemma4, harmony, longcat_think, none, think_colon, think_tags, xtml"):
        get_channel_format("deepseek")


def test_format_data_is_checked() -> None:
    with pytest.raises(ValueError, match="unknown state"):
        ChannelFormat(
            name="broken",
            states={"answer": State(A, (Rule("<x>", "nowhere"),))},
            answer_state="answer",
            reasoning_state=None,
            reasoning_end="",
        )
    with pytest.raises(ValueError, match="not a reasoning state"):
        ChannelFormat(
            name="broken",
            states={"answer": State(A)},
            answer_state="answer",
            reasoning_state="answer",
            reasoning_end="",
        )


def test_tool_state_data_is_checked() -> None:
    header = ByHeader({"x": "answer"}, "answer", calls="answer")
    with pytest.raises(ValueError, match="not a tool state"):
        ChannelFormat(
            name="broken",
            states={"answer": State(A, (Rule("<m>", header),))},
            answer_state="answer",
            reasoning_state=None,
            reasoning_end="",
        )


START_ONLY = ChannelFormat(
    name="start_only",
    states={
        "answer": State(A, (Rule("{!", "call", at_start=True),)),
        "call": State(Channel.TOOL, (Rule("!}", "between"),)),
        "between": State(A, (Rule("{!", "call", at_start=True),),
                         strip_leading_whitespace=True),
    },
    answer_state="answer",
    reasoning_state=None,
    reasoning_end="",
)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (" \n{!a!}\n {!b!} c", [(A, " \n"), (Channel.TOOL, "ab"), (A, "c")]),
        ("x {!a!}", [(A, "x {!a!}")]),  # after content a start-only marker is text
        ("{!a!}x{!b", [(Channel.TOOL, "a"), (A, "x{!b")]),
    ],
)
def test_start_only_rules_and_whitespace_stripping(text: str, want: Pieces) -> None:
    for cut in range(1, len(text)):
        assert route(START_ONLY, "answer", split(text, [cut])) == want, cut
    assert route(START_ONLY, "answer", list(text)) == want


@pytest.mark.parametrize(
    ("template", "vocab", "want"),
    [
        ("{{ '<|start|>assistant<|channel|>final<|message|>' }}", [], "harmony"),
        (None, {"<|channel|>", "<|message|>", "<|end|>"}, "harmony"),
        ("{% if enable_thinking %}<think>\n{% endif %}</think>", [], "think_tags"),
        (None, {"<think>", "</think>", "hello"}, "think_tags"),
        ("<|im_start|>{{ m.content }}<|im_end|>", {"<think>"}, "none"),
        (None, [], "none"),
    ],
)
def test_detect_channel_format(template: str | None, vocab: Sequence[str], want: str) -> None:
    assert detect_channel_format(template, vocab) == want


# `harmony_encoding` (tests/unit/conftest.py) is the real encoding, loaded offline.


def test_markers_are_harmony_special_tokens(harmony_encoding: Any) -> None:
    from openai_harmony import Message, Role  # type: ignore[import-untyped]

    for marker in HARMONY.markers:
        if marker == harmony.ROLE_RECIPIENT:
            continue  # plain text, checked against the encoder's own rendering below
        tokens = harmony_encoding.encode(marker, allowed_special="all")
        assert len(tokens) == 1 and harmony_encoding.is_special_token(tokens[0]), marker
        assert harmony_encoding.decode(tokens) == marker
    assert harmony.CHANNEL in harmony_encoding.special_tokens_set
    call = (Message.from_role_and_content(Role.ASSISTANT, "{}").with_channel("commentary")
            .with_recipient("functions.f"))
    assert harmony_encoding.decode(harmony_encoding.render(call)).startswith(
        f"{harmony.START}assistant{harmony.ROLE_RECIPIENT}functions.f{harmony.CHANNEL}")


def harmony_turns(harmony_encoding: Any) -> list[tuple[str, list[Any]]]:
    """(rendered prompt, completion token ids) pairs written by the real encoder."""
    from openai_harmony import Conversation, Message, Role

    def msg(channel: str, text: str, recipient: str | None = None) -> Any:
        m = Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)
        return m.with_recipient(recipient).with_content_type("<|constrain|>json") \
            if recipient else m

    user = Message.from_role_and_content(Role.USER, "What is the weather in Paris?")
    replies = [
        [msg("analysis", "The user greets me."), msg("final", "Hello! How can I help?")],
        [msg("final", "Sunny, 18 degrees.")],
        [msg("commentary", "Let me look."), msg("final", "It is sunny.")],
        [msg("analysis", "Need the weather."),
         msg("commentary", '{"city":"Paris"}', "functions.get_weather")],
        [msg("commentary", '{"city":"Paris"}', "functions.get_weather")],
        [msg("analysis", "Search first."), msg("analysis", '{"q":"x"}', "browser.search")],
    ]
    prompt = harmony_encoding.render_conversation_for_completion(
        Conversation.from_messages([user]), Role.ASSISTANT)
    return [(harmony_encoding.decode(prompt), harmony_encoding.encode(
        render_completion(harmony_encoding, reply), allowed_special="all")) for reply in replies]


def parsed_by_harmony(harmony_encoding: Any, completion: list[int]) -> list[Any]:
    """The completion's messages, by the package's one-shot and streaming parsers (equal)."""
    from openai_harmony import Role, StreamableParser

    messages = harmony_encoding.parse_messages_from_completion_tokens(completion, Role.ASSISTANT)
    parser = StreamableParser(harmony_encoding, Role.ASSISTANT)
    for token in completion:
        parser.process(token)
    parser.process_eos()
    assert [m.to_dict() for m in parser.messages] == [m.to_dict() for m in messages]
    return list(messages)


def test_router_agrees_with_harmony_parser(harmony_encoding: Any) -> None:
    for prompt, completion in harmony_turns(harmony_encoding):
        messages = parsed_by_harmony(harmony_encoding, completion)
        want = merged(
            (A if m.channel == "final" else R, "".join(c.text for c in m.content))
            for m in messages
        )
        per_token = [harmony_encoding.decode([t]) for t in completion]
        state = initial_state(HARMONY, prompt)
        assert state == "opening"
        assert route(HARMONY, state, per_token) == want, per_token
        assert route(HARMONY, state, ["".join(per_token)]) == want
