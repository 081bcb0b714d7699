"""Tool-call grammars: each format accepts the model's own call text and nothing invalid.

Every check runs on two tokenizers, because llguidance matches a marker differently when
it is one special token than when it is text: the built-in model's tokenizer with every
format's markers added as tokens (as Qwen3, Llama and gpt-oss vocabularies have them),
and test_guided's byte-level BPE, where every marker is several plain tokens. Nothing is
downloaded and no model is built.
"""

from __future__ import annotations

import functools
import json
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from replicas.builtin import load_scripts
from replicas.builtin.recipe import TINY
from replicas.builtin.tokenizer_files import (
    EOS_TOKEN,
    PAD_TOKEN,
    train_tokenizer,
    training_texts,
    write_tokenizer_files,
)
from replicas.contract import Channel, ToolChoice, ToolSpec
from replicas.pipeline.control import RequestController
from replicas.pipeline.detokenizer import make_decode
from replicas.errors import InvalidRequestError
from replicas.pipeline.guided import GuidedMatcher, GuidedTokenizer
from replicas.pipeline.guided.tools import compile_tool_grammar
from replicas.families.channel_format import ChannelFormat, Rule, State
from replicas.families.registry import TOOL_FORMATS, get_channel_format
from replicas.families.tool_format import CallGrammar
from replicas.pipeline.tool_plan import reserved_token_ids
from tests.unit.test_guided import build_hf_tokenizer, guided_tokenizer

# Non-special in Qwen3 (they survive skip_special_tokens); special in the other families.
PLAIN_MARKERS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                 "</arg_value>", "<minimax:tool_call>", "</minimax:tool_call>",
                 "<longcat_tool_call>", "</longcat_tool_call>", "<longcat_arg_key>",
                 "</longcat_arg_key>", "<longcat_arg_value>", "</longcat_arg_value>",
                 "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                 "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
SPECIAL_MARKERS = ("<|python_tag|>", "[TOOL_CALLS]", "<|start|>", "<|channel|>",
                   "<|constrain|>", "<|message|>", "<|call|>", "<|end|>",
                   "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                   "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
                   "<|tool_call_start|>", "<|tool_call>", "<tool_call|>", '<|"|>',
                   "<start_function_call>", "<end_function_call>", "<escape>", "<|open|>",
                   "<|close|>", "<|sep|>")


@functools.cache
def builtin_hf_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in models' tokenizer (trained from the scripts, no model built), with every
    format's markers as added tokens."""
    out = Path(tempfile.mkdtemp(prefix="orchard-tools-tok-"))
    write_tokenizer_files(
        train_tokenizer(training_texts(load_scripts()), TINY.max_vocab, TINY.min_frequency),
        out, 4096,
    )
    hf = AutoTokenizer.from_pretrained(str(out))
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_MARKERS])
    hf.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_MARKERS],
                  special_tokens=True)
    assert isinstance(hf, PreTrainedTokenizerFast)
    return hf


@functools.cache
def builtin_guided_tokenizer() -> GuidedTokenizer:
    hf = builtin_hf_tokenizer()
    stops = [hf.get_vocab()[EOS_TOKEN], hf.get_vocab()[PAD_TOKEN]]
    return GuidedTokenizer.from_hf(hf, vocab_size=len(hf) + 3, eos_token_ids=stops)


@functools.cache
def variant(name: str) -> tuple[PreTrainedTokenizerFast, GuidedTokenizer]:
    if name == "tokens":
        return builtin_hf_tokenizer(), builtin_guided_tokenizer()
    return build_hf_tokenizer(), guided_tokenizer()


VARIANTS = ("tokens", "text")


def tool(name: str, schema: dict[str, Any], strict: bool = False) -> ToolSpec:
    return ToolSpec(name=name, parameters=json.dumps(schema), strict=strict)


WEATHER = tool("get_weather", {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20},
                   "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
    "additionalProperties": False,
})
SEARCH = tool("search", {
    "type": "object",
    "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1}},
    "required": ["query", "limit"],
    "additionalProperties": False,
})
TOOLS = (WEATHER, SEARCH)


def grammar(fmt: str, choice: ToolChoice, name: str = "tokens",
            tools: tuple[ToolSpec, ...] = TOOLS) -> str:
    result = compile_tool_grammar(fmt, tools, choice, tokenizer=variant(name)[1])
    assert result is not None
    return result.grammar


def accepts(grammar_text: str, text: str, name: str = "tokens", *, end: bool = True) -> bool:
    """The model's tokens for `text` (then an EOS when `end`) are all allowed in turn."""
    hf, tok = variant(name)
    matcher = GuidedMatcher(tok, grammar_text)
    ids = list(hf.encode(text, add_special_tokens=False))
    if end:
        ids.append(tok.eos_token_ids[0])
    for token in ids:
        if token not in allowed(matcher, tok):
            return False
        matcher.consume(token)
        assert matcher.error is None, matcher.error
    return matcher.is_complete if end else True


def allowed(matcher: GuidedMatcher, tok: GuidedTokenizer) -> set[int]:
    masked = np.array(matcher.mask(mx.zeros((1, tok.vocab_size))))[0]
    return set(np.flatnonzero(np.isfinite(masked)).tolist())


def raw(value: Any) -> str:
    """A tagged argument's value as the model writes it: strings raw, the rest JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def call_text(fmt: str, name: str, args: dict[str, Any]) -> str:
    """One call as the model writes it (`args` as the model's JSON, or tagged arguments)."""
    if fmt == "qwen3_coder":
        params = "".join(f"<parameter={k}>\n{raw(v)}\n</parameter>\n" for k, v in args.items())
        return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"
    if fmt in KEY_VALUE_PREFIX:
        pre = KEY_VALUE_PREFIX[fmt]
        pairs = "".join(f"<{pre}arg_key>{k}</{pre}arg_key><{pre}arg_value>{raw(v)}"
                        f"</{pre}arg_value>" for k, v in args.items())
        return f"<{pre}tool_call>{name}{pairs}</{pre}tool_call>"
    if fmt == "minimax_m2":
        params = "".join(f'<parameter name="{k}">{raw(v)}</parameter>\n'
                         for k, v in args.items())
        return f'<invoke name="{name}">\n{params}</invoke>'
    if fmt == "pythonic":
        return f"{name}(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in args.items()) + ")"
    if fmt in GEMMA_CALLS:
        (open_, close), quote = GEMMA_CALLS[fmt]
        pairs = ",".join(f"{k}:{quote}{v}{quote}" if isinstance(v, str) else f"{k}:{raw(v)}"
                         for k, v in args.items())
        return f"{open_}call:{name}{{{pairs}}}{close}"
    if fmt == "minicpm5":
        params = "".join(f'<param name="{k}">{raw(v)}</param>' for k, v in args.items())
        return f'<function name="{name}">{params}</function>'
    if fmt == "muse_spark":
        params = "".join(f'<atem:parameter name="{k}">{json.dumps(v)}</atem:parameter>\n'
                         for k, v in args.items())
        return f'<atem:invoke name="{name}">\n{params}</atem:invoke>'
    body = json.dumps(args)
    return {
        "kimi_k2": f"<|tool_call_begin|>functions.{name}:0<|tool_call_argument_begin|>{body}"
                   "<|tool_call_end|>",
        "kimi_k3": f'<|open|>call tool="{name}" index="1"<|sep|><|open|>json type="object"'
                   f"<|sep|>{body}<|close|>json<|sep|><|close|>call<|sep|>",
        "deepseek_v31": f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{body}<｜tool▁call▁end｜>",
        "hermes": f'<tool_call>\n{{"name": "{name}", "arguments": {body}}}\n</tool_call>',
        "llama3_json": f'{{"name": "{name}", "parameters": {body}}}',
        "mistral": f'{{"name": "{name}", "arguments": {body}}}',
        # What follows the prompt's `<|start|>assistant`.
        "harmony": f"<|channel|>commentary to=functions.{name} "
                   f"<|constrain|>json<|message|>{body}<|call|>",
    }[fmt]


def section(fmt: str, *calls: str) -> str:
    """Calls joined as the model joins them."""
    return {
        "hermes": "\n".join(calls),
        "qwen3_coder": "\n".join(calls),
        "llama3_json": "<|python_tag|>" + "; ".join(calls),
        "mistral": "[TOOL_CALLS][" + ", ".join(calls) + "]",
        "harmony": "".join(calls),
        "kimi_k2": "<|tool_calls_section_begin|>" + "".join(calls)
                   + "<|tool_calls_section_end|>",
        "glm47": "\n".join(calls),
        "minimax_m2": "<minimax:tool_call>\n" + "\n".join(calls) + "\n</minimax:tool_call>",
        "pythonic": "<|tool_call_start|>[" + ", ".join(calls) + "]<|tool_call_end|>",
        "gemma4": "".join(calls),
        "function_gemma": "".join(calls),
        "longcat": "\n".join(calls),
        "minicpm5": "\n".join(calls),
        "muse_spark": "<atem:function_calls>\n" + "\n".join(calls) + "\n</atem:function_calls>",
        "kimi_k3": "<|open|>tools<|sep|>" + "".join(calls) + "<|close|>tools<|sep|>",
        "deepseek_v31": "<｜tool▁calls▁begin｜>" + "".join(calls) + "<｜tool▁calls▁end｜>",
    }[fmt]


# GLM's key/value layout: the tag prefix of each format that writes it.
KEY_VALUE_PREFIX = {"glm47": "", "longcat": "longcat_"}
# Gemma's formats: (call markers, string quote).
GEMMA_CALLS = {"gemma4": (("<|tool_call>", "<tool_call|>"), '<|"|>'),
               "function_gemma": (("<start_function_call>", "<end_function_call>"), "<escape>")}


PARIS = {"city": "Paris"}
# A tool `f` with optional arguments of every kind, and arguments for it that a grammar must
# write so that the parser reads them back.
LOOSE = tool("f", {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"},
    "d": {"type": "array", "items": {"type": "string"}}}})
ROUND_TRIP: list[dict[str, Any]] = [{}, {"b": "x, y: {z} \"q\""}, {"a": 1, "c": True},
                                    {"a": -2, "b": "New\nYork", "c": False, "d": ["p,q", "}"]}]


def refuses_malformed(fmt: str, tok: str, loose: ToolSpec, texts: Iterable[str]) -> None:
    """The grammar for the tool `loose` (named `f`, an integer `a`) takes a call of it but
    none of `texts`."""
    g = grammar(fmt, ToolChoice("required"), tok, tools=(loose,))
    assert accepts(g, section(fmt, call_text(fmt, "f", {"a": 1})), tok)
    for text in texts:
        assert not accepts(g, text, tok), text


def named_auto_choice_forces_that_tool(fmt: str, tok: str = "tokens") -> None:
    """`tool_choice` naming `search`: its call at once, no text first, no other tool."""
    g = grammar(fmt, ToolChoice("auto", name="search"), tok)
    search = section(fmt, call_text(fmt, "search", {"query": "q", "limit": 2}))
    assert accepts(g, search, tok)
    assert not accepts(g, "Sure. " + search, tok)
    assert not accepts(g, section(fmt, call_text(fmt, "get_weather", PARIS)), tok)
# Every format with calls has a grammar (its entry's `grammar`).
GRAMMARS: dict[str, CallGrammar] = {n: f.grammar for n, f in TOOL_FORMATS.items() if f.grammar}
FORMATS = tuple(GRAMMARS)
PARALLEL = tuple(f for f in FORMATS if GRAMMARS[f].sep is not None)
CASES = [(f, v) for f in FORMATS for v in VARIANTS]


@pytest.mark.parametrize(("fmt", "tok"), CASES)
def test_required_accepts_one_call_to_any_tool_and_only_eos_after(fmt: str, tok: str) -> None:
    for choice in (ToolChoice("required"), ToolChoice("required", parallel=False)):
        g = grammar(fmt, choice, tok)
        assert accepts(g, section(fmt, call_text(fmt, "get_weather", {"city": "Paris", "unit": "c"})), tok)
        assert accepts(g, section(fmt, call_text(fmt, "search", {"query": "q", "limit": 3})), tok)
    # With one call at most, the grammar is complete right after it: only EOS remains.
    hf, guided = variant(tok)
    matcher = GuidedMatcher(guided, grammar(fmt, ToolChoice("required", parallel=False), tok))
    for token in hf.encode(section(fmt, call_text(fmt, "get_weather", PARIS)),
                           add_special_tokens=False):
        matcher.consume(token)
    assert matcher.error is None
    assert matcher.is_complete and allowed(matcher, guided) == set(guided.eos_token_ids)


@pytest.mark.parametrize(("fmt", "tok"), [(f, v) for f in PARALLEL for v in VARIANTS])
def test_parallel_calls_only_when_allowed(fmt: str, tok: str) -> None:
    two = section(fmt, call_text(fmt, "get_weather", PARIS),
                  call_text(fmt, "search", {"query": "q", "limit": 1}))
    assert accepts(grammar(fmt, ToolChoice("required"), tok), two, tok)
    assert accepts(grammar(fmt, ToolChoice("auto"), tok), "Checking both.\n" * (fmt != "harmony") + two, tok)
    assert not accepts(grammar(fmt, ToolChoice("required", parallel=False), tok), two, tok)
    assert not accepts(grammar(fmt, ToolChoice("auto", parallel=False), tok), two, tok)


def test_harmony_makes_one_call_per_turn() -> None:
    call = call_text("harmony", "get_weather", PARIS)
    assert not accepts(grammar("harmony", ToolChoice("required")), call + call)


@pytest.mark.parametrize(("fmt", "tok"), CASES)
def test_named_choice_allows_only_that_tool(fmt: str, tok: str) -> None:
    g = grammar(fmt, ToolChoice("required", name="search"), tok)
    assert accepts(g, section(fmt, call_text(fmt, "search", {"query": "q", "limit": 2})), tok)
    assert not accepts(g, section(fmt, call_text(fmt, "get_weather", PARIS)), tok)


@pytest.mark.parametrize(("fmt", "tok"), CASES)
@pytest.mark.parametrize("bad", [
    ("get_wether", PARIS),  # no such tool
    ("get_weather", {"city": "Paris" * 5}),  # maxLength
    ("get_weather", {"unit": "c"}),  # required property missing
    ("get_weather", {"city": "Paris", "unit": "k"}),  # not in the enum
    ("get_weather", {"city": "Paris", "country": "FR"}),  # additionalProperties: false
    ("search", {"query": "q", "limit": 0}),  # minimum
    ("search", {"query": "q", "limit": "many"}),  # type
], ids=["name", "maxLength", "required", "enum", "extra", "minimum", "type"])
def test_calls_that_break_the_schema_are_rejected(fmt: str, tok: str,
                                                  bad: tuple[str, dict[str, Any]]) -> None:
    text = section(fmt, call_text(fmt, *bad))
    assert not accepts(grammar(fmt, ToolChoice("required"), tok), text, tok)
    prose = "" if fmt == "harmony" else "Let me look.\n"
    assert not accepts(grammar(fmt, ToolChoice("auto"), tok), prose + text, tok)


@pytest.mark.parametrize(("fmt", "tok"), CASES)
def test_required_rejects_text(fmt: str, tok: str) -> None:
    g = grammar(fmt, ToolChoice("required"), tok)
    assert not accepts(g, "Sure. " + section(fmt, call_text(fmt, "get_weather", PARIS)), tok)
    assert not accepts(g, "The weather is fine.", tok)


@pytest.mark.parametrize(("fmt", "tok"), CASES)
def test_auto_allows_text_alone_or_text_then_calls(fmt: str, tok: str) -> None:
    g = grammar(fmt, ToolChoice("auto"), tok)
    call = section(fmt, call_text(fmt, "get_weather", PARIS))
    if fmt == "harmony":  # text is the final channel's message, a call is instead of it
        assert accepts(g, "<|channel|>final<|message|>It is sunny.", tok)
        assert accepts(g, call, tok)
        assert not accepts(g, "It is sunny.", tok)
        # An analysis message first, as gpt-oss writes it, and the recipient after the role
        # (` to=functions.x<|channel|>commentary ...`), as the encoder writes a call.
        analysis = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
        assert accepts(g, analysis + call, tok)
        assert accepts(g, analysis + "<|channel|>final<|message|>It is sunny.", tok)
        role_form = (' to=functions.get_weather<|channel|>commentary <|constrain|>json'
                     '<|message|>{"city": "Paris"}<|call|>')
        assert accepts(g, role_form, tok) and accepts(g, analysis + role_form, tok)
        assert not accepts(g, role_form.replace("get_weather", "nope"), tok)
        return
    assert accepts(g, "It is sunny, {\"json\": 1} and <b>tags</b>.\n\nBye", tok)
    assert accepts(g, "", tok)
    assert accepts(g, call, tok)
    assert accepts(g, "I will check the weather.\n\n" + call, tok)
    assert not accepts(g, "Done: " + call + " And more text.", tok)


def test_reserved_ids_are_the_markers_that_are_single_tokens() -> None:
    hf, _ = variant("tokens")
    ids = hf.convert_tokens_to_ids
    # The built-in vocab has <tool_response> and </tool_response> as added tokens too.
    assert reserved_token_ids(TOOL_FORMATS["hermes"], hf.encode) == tuple(
        ids(m) for m in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"))
    assert reserved_token_ids(TOOL_FORMATS["llama3_json"], hf.encode) == (ids("<|python_tag|>"),)
    assert reserved_token_ids(TOOL_FORMATS["harmony"], hf.encode) == (ids("<|call|>"),)
    assert reserved_token_ids(TOOL_FORMATS["hermes"], variant("text")[0].encode) == ()


def test_none_and_no_tools_constrain_nothing() -> None:
    tok = builtin_guided_tokenizer()
    assert compile_tool_grammar("hermes", TOOLS, ToolChoice("none"), tokenizer=tok) is None
    assert compile_tool_grammar("hermes", (), ToolChoice("auto"), tokenizer=tok) is None


def test_non_strict_tools_tolerate_unknown_keywords_and_are_still_enforced() -> None:
    loose = tool("f", {"type": "object", "properties": {"n": {"type": "integer",
                                                               "nullable": True}},
                       "required": ["n"]})
    g = grammar("hermes", ToolChoice("required"), tools=(loose,))
    assert accepts(g, call_text("hermes", "f", {"n": 1}))
    assert not accepts(g, call_text("hermes", "f", {"n": "one"}))


def test_strict_tools_that_follow_openai_rules_compile() -> None:
    ok = tool("f", {"type": "object", "properties": {"a": {"type": ["string", "null"]}},
                    "required": ["a"], "additionalProperties": False}, strict=True)
    assert accepts(grammar("hermes", ToolChoice("required"), tools=(ok,)),
                   call_text("hermes", "f", {"a": None}))


@pytest.mark.parametrize(("tools", "choice", "param", "expected"), [
    (TOOLS, ToolChoice("required", name="nope"), "tool_choice", "'nope'"),
    ((), ToolChoice("required"), "tool_choice", "at least one tool"),
    ((WEATHER, WEATHER), ToolChoice("auto"), "tools", "duplicate tool name 'get_weather'"),
    ((tool("", {}),), ToolChoice("auto"), "tools", "invalid tool name"),
    ((tool("a b", {}),), ToolChoice("auto"), "tools", "invalid tool name"),
    ((tool("x" * 65, {}),), ToolChoice("auto"), "tools", "invalid tool name"),
    ((tool("café", {}),), ToolChoice("none"), "tools", "invalid tool name"),
    ((tool("u", {"type": "array", "uniqueItems": True}),), ToolChoice("auto"), "tools",
     "tool 'u'"),
    # Only an explicit strict refuses what the grammar cannot enforce (else: a warning).
    ((tool("u", {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}},
                 "required": ["t"], "additionalProperties": False}, strict=True),),
     ToolChoice("auto"), "tools", "tool 'u': invalid parameters schema"),
    ((ToolSpec("j", parameters="{nope"),), ToolChoice("auto"), "tools", "tool 'j': JSON schema"),
    ((tool("s", {"type": "string"}),), ToolChoice("auto"), "tools", "must be an object schema"),
    ((tool("s", {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
           strict=True),), ToolChoice("auto"), "tools", "additionalProperties: false"),
    ((tool("s", {"type": "object", "properties": {"a": {"type": "string"}},
                 "additionalProperties": False}, strict=True),),
     ToolChoice("auto"), "tools", "must list a in required"),
    ((tool("s", {"type": "object", "properties": {"a": {"type": "string", "maxLenght": 3}},
                 "required": ["a"], "additionalProperties": False}, strict=True),),
     ToolChoice("auto"), "tools", "#/properties/a/maxLenght"),
])
def test_bad_tools_and_choices_are_invalid_requests(
    tools: tuple[ToolSpec, ...], choice: ToolChoice, param: str, expected: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        compile_tool_grammar("hermes", tools, choice, tokenizer=builtin_guided_tokenizer())
    assert info.value.param == param
    assert expected in info.value.message


def test_qwen3_coder_leaves_out_string_constraints_raw_text_cannot_carry() -> None:
    patterned = tool("p", {"type": "object", "properties": {"d": {"type": "string",
                                                                  "pattern": "^[0-9]+$"}}})
    compiled = compile_tool_grammar("qwen3_coder", (patterned,), ToolChoice("auto"),
                                    tokenizer=builtin_guided_tokenizer())
    assert compiled is not None
    assert [w for w in compiled.warnings if "'d': pattern" in w]
    strict = tool("p", {**json.loads(patterned.parameters), "required": ["d"],
                        "additionalProperties": False}, strict=True)
    with pytest.raises(InvalidRequestError, match="cannot enforce parameter 'd': pattern") as info:
        compile_tool_grammar("qwen3_coder", (strict,), ToolChoice("auto"),
                             tokenizer=builtin_guided_tokenizer())
    assert info.value.param == "tools"
    # The JSON formats carry it.
    assert grammar("hermes", ToolChoice("auto"), tools=(patterned,))


def test_qwen3_coder_values_are_raw_strings_and_json_otherwise() -> None:
    g = grammar("qwen3_coder", ToolChoice("required"))
    raw = call_text("qwen3_coder", "get_weather", {"city": "New\nYork </para"})
    assert accepts(g, raw)
    typed = call_text("qwen3_coder", "search", {"query": "mlx", "limit": 5})
    assert accepts(g, typed)
    assert not accepts(g, typed.replace("5", "five"))


def test_unknown_format_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown tool format"):
        compile_tool_grammar("nope", TOOLS, ToolChoice("auto"), tokenizer=guided_tokenizer())


# --- RequestController with a tool grammar ---------------------------------------------

# Think tags plus a tool channel, as the channel router routes Qwen3 calls.
THINK_AND_TOOLS = ChannelFormat(
    name="think_and_tools",
    states={
        "answer": State(Channel.ANSWER, (Rule("<think>", "reasoning"),
                                         Rule("<tool_call>", "tool"))),
        "reasoning": State(Channel.REASONING, (Rule("</think>", "answer"),)),
        "tool": State(Channel.TOOL, (Rule("</tool_call>", "answer"),)),
    },
    answer_state="answer",
    reasoning_state="reasoning",
    reasoning_end="</think>",
)


def drive(controller: RequestController, text: str) -> list[int]:
    """Feed `text`'s tokens, then an EOS, as mlx-lm would; each must be allowed when
    sampled. Returns the ids the controller forbade at the last step."""
    hf, tok = variant("tokens")
    history = [0]  # the prompt
    masked = None
    for token in [*hf.encode(text, add_special_tokens=False), tok.eos_token_ids[0]]:
        masked = np.array(controller(mx.array(history), mx.zeros((1, tok.vocab_size))))[0]
        assert controller.error is None, controller.error
        assert np.isfinite(masked[token]), f"{hf.decode([token])!r} was forbidden"
        history.append(token)
    controller(mx.array(history), mx.zeros((1, tok.vocab_size)))
    assert controller.error is None, controller.error
    assert masked is not None
    return np.flatnonzero(~np.isfinite(masked)).tolist()


def controller_for(fmt: ChannelFormat, initial: Channel, g: str | None, **kwargs: Any
                   ) -> RequestController:
    hf, tok = variant("tokens")
    return RequestController(
        make_decode(hf), fmt, initial, None, budget=None, forced_end_ids=(),
        grammar=GuidedMatcher(tok, g) if g is not None else None,
        eos_ids=frozenset(tok.eos_token_ids), **kwargs,
    )


def test_controller_runs_the_tool_grammar_after_reasoning_through_the_tool_channel() -> None:
    g = grammar("hermes", ToolChoice("required", parallel=False))
    controller = controller_for(THINK_AND_TOOLS, Channel.REASONING, g)
    reasoning = "I should call get_weather with any text { here"
    drive(controller, f"{reasoning}</think>" + call_text("hermes", "get_weather", PARIS))
    assert controller.grammar_complete(1 << 30)
    # Reasoning text plus the token that closed it; none of the call's tokens.
    assert controller.reasoning_tokens == len(variant("tokens")[0].encode(reasoning)) + 1


def test_controller_rejects_an_invalid_call_in_the_tool_channel() -> None:
    hf, tok = variant("tokens")
    controller = controller_for(THINK_AND_TOOLS, Channel.ANSWER,
                                grammar("hermes", ToolChoice("auto")))
    history = [0]
    controller(mx.array(history), mx.zeros((1, tok.vocab_size)))
    for token in hf.encode(call_text("hermes", "nope", PARIS), add_special_tokens=False):
        history.append(token)
        controller(mx.array(history), mx.zeros((1, tok.vocab_size)))
    assert controller.error is not None


def test_banned_ids_are_forbidden_at_every_step() -> None:
    hf, _ = variant("tokens")
    banned = reserved_token_ids(TOOL_FORMATS["hermes"], hf.encode)
    controller = controller_for(THINK_AND_TOOLS, Channel.REASONING, None, banned_ids=banned)
    forbidden = drive(controller, "thinking</think>Plain answer.")
    assert forbidden == sorted(banned)
    with_grammar = controller_for(THINK_AND_TOOLS, Channel.ANSWER,
                                  grammar("hermes", ToolChoice("auto")), banned_ids=banned)
    assert banned[0] in drive(with_grammar, "Sure.")


def test_harmony_grammar_starts_when_the_analysis_message_ends() -> None:
    g = grammar("harmony", ToolChoice("required"))
    controller = controller_for(get_channel_format("harmony"), Channel.REASONING, g,
                                grammar_start="reasoning_end")
    analysis = "The user wants weather"
    drive(controller, f"{analysis}<|end|>" + call_text("harmony", "get_weather", PARIS))
    assert controller.grammar_complete(1 << 30)
    assert controller.reasoning_tokens == len(variant("tokens")[0].encode(analysis))
