"""The built-in models' scripts, tokenizer files and build cache (no training here)."""

from __future__ import annotations

import json
import logging
import multiprocessing
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
from mlx_lm.utils import load_tokenizer
from transformers import AutoTokenizer

from replicas.builtin import BUILTIN_NAMES, ensure_builtin, load_scripts, script
from replicas.builtin import build as build_module
from replicas.builtin.build import default_cache_root, ensure_recipe
from replicas.builtin.recipe import BENCH, TINY, Architecture, RandomInit, Recipe, cache_key
from replicas.builtin.scripts import Script, parse_scripts, scripts_text
from replicas.contract import (
    ChatMessage,
    ChatPrompt,
    ReasoningSpec,
    TextPrompt,
    ToolCall,
    ToolSpec,
)
from replicas.errors import InvalidRequestError
from replicas.prompt import render_chat_text, render_prompt
from replicas.builtin.tokenizer_files import (
    PLAIN_ADDED_TOKENS,
    prompt_ids,
    render_chat_prompt_ids,
    train_tokenizer,
    training_texts,
    write_tokenizer_files,
)

# A random-weights recipe small enough to build in about a second.
SMALL = Recipe(
    name="small-test",
    architecture=Architecture(
        hidden_size=32,
        num_hidden_layers=1,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
    ),
    weights=RandomInit(logit_std=5.0),
    seed=7,
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    tokenizer = train_tokenizer(training_texts(load_scripts()), TINY.max_vocab, TINY.min_frequency)
    write_tokenizer_files(tokenizer, out, 4096)
    return out


@pytest.fixture(scope="module")
def hf(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="module")
def wrapper(tokenizer_dir: Path) -> Any:
    return load_tokenizer(tokenizer_dir)


# --- scripts -----------------------------------------------------------------------


def test_scripts_cover_what_the_tests_need() -> None:
    scripts = load_scripts()
    assert 16 <= len(scripts) <= 30
    assert len({s.id for s in scripts}) == len(scripts)
    reasoning = [s for s in scripts if s.reasoning]
    assert len(reasoning) >= 3
    assert {s.kind for s in scripts} == {"chat", "completion"}
    riddle = script("riddle-think")
    assert riddle.reasoning is not None
    assert "Check:" in riddle.reasoning and "Check:" not in riddle.answer
    assert "Hmm," in riddle.reasoning and "Hmm," not in riddle.answer
    assert "piano" in riddle.reasoning and "piano" in riddle.answer
    # Every reasoning script whose prompt also appears with thinking off answers the same.
    # (The tool scripts are off so that Anthropic's path, which thinks only when asked,
    # reaches them; they have no reasoning twin.)
    pairs = [(off, twin) for off in scripts if off.enable_thinking is False
             for twin in reasoning if twin.messages == off.messages]
    assert {off.id for off, _ in pairs} >= {"riddle-nothink", "feathers-nothink"}
    for off, twin in pairs:
        assert twin.answer == off.answer
    assert "\n\n" in script("two-paragraphs").answer
    assert "\n" in script("haiku").answer and "\n\n" not in script("haiku").answer
    json.loads(script("json-record").answer)
    with pytest.raises(ValueError):
        json.loads(script("profile-prose").answer)


def test_expected_text_shapes() -> None:
    riddle = script("riddle-think")
    assert riddle.expected_text == f"<think>\n{riddle.reasoning}\n</think>\n\n{riddle.answer}"
    assert script("riddle-nothink").expected_text == riddle.answer
    count = script("count-completion")
    assert count.prompt == "Count from 1 to 10, one number per line:\n1\n2\n"
    assert count.expected_text == "3\n4\n5\n6\n7\n8\n9\n10"
    assert script("hello").template_kwargs == {}
    assert script("riddle-nothink").template_kwargs == {"enable_thinking": False}
    with pytest.raises(KeyError, match="no script"):
        script("no-such-script")


def _one_script_json(**fields: Any) -> str:
    entry = {
        "id": "x",
        "kind": "chat",
        "messages": [{"role": "user", "content": "Hi"}],
        "answer": "Hello.",
        **fields,
    }
    return json.dumps({"scripts": [entry]})


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"enable_thinking": False, "reasoning": "r"}, "no room for reasoning"),
        ({"kind": "completion"}, "has a prompt and no messages"),
        ({"kind": "other"}, "kind must be"),
        ({"answer": ""}, "answer must be"),
        ({"messages": [{"role": "assistant", "content": "Hi"}]}, "last message"),
        ({"messages": [{"role": "robot", "content": "Hi"}]}, "message roles"),
        ({"reasoning": ""}, "reasoning must be"),
        ({"enable_thinking": 1}, "enable_thinking must be"),
    ],
)
def test_invalid_scripts_are_rejected(fields: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_scripts(_one_script_json(**fields))


def test_duplicate_ids_are_rejected() -> None:
    entry = json.loads(_one_script_json())["scripts"][0]
    with pytest.raises(ValueError, match="duplicate"):
        parse_scripts(json.dumps({"scripts": [entry, entry]}))


# --- tokenizer -----------------------------------------------------------------------


MESSAGES = [{"role": "user", "content": "Hello!"}]


def test_empty_think_block_only_when_thinking_is_off(hf: Any) -> None:
    def render(**kwargs: Any) -> str:
        return hf.apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=False, **kwargs
        )

    base = "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    assert render(enable_thinking=False) == base + "<think>\n\n</think>\n\n"
    assert render() == base
    assert render(enable_thinking=True) == base


def test_special_and_added_tokens(hf: Any, wrapper: Any) -> None:
    assert hf.eos_token == "<|im_end|>"
    assert hf.pad_token == "<|endoftext|>"
    assert hf.bos_token is None
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    assert wrapper.eos_token_ids == {im_end}
    for marker in ("<think>", "</think>", "<|im_start|>", "<|im_end|>"):
        assert len(hf.encode(marker, add_special_tokens=False)) == 1
    # Like Qwen3, the think markers are not special: they survive skip_special_tokens.
    ids = hf.encode("<think>\nx\n</think>\n\nHi<|im_end|>", add_special_tokens=False)
    assert hf.decode(ids, skip_special_tokens=True) == "<think>\nx\n</think>\n\nHi"
    assert wrapper.has_thinking and wrapper.think_start == "<think>"
    assert wrapper.think_end_id == hf.convert_tokens_to_ids("</think>")
    assert isinstance(wrapper.detokenizer, BPEStreamingDetokenizer)


def test_vocabulary_granularity(hf: Any) -> None:
    assert 500 <= len(hf) <= 1000
    for word in (" the", " planets", " kilogram", "Hello"):
        assert len(hf.encode(word, add_special_tokens=False)) == 1, word
    for phrase in ("Mexico City", " Mexico City"):
        assert len(hf.encode(phrase, add_special_tokens=False)) >= 2, phrase
    # Rare multi-byte characters stay split into byte-level pieces.
    assert len(hf.encode("👋", add_special_tokens=False)) > 1
    assert len(hf.encode("こんにちは", add_special_tokens=False)) > len("こんにちは")


def test_long_reasoning_for_budget_tests(hf: Any) -> None:
    reasoning = script("feathers-think").reasoning or ""
    assert len(hf.encode(reasoning, add_special_tokens=False)) >= 80
    assert len(script("feathers-think").answer.split()) <= 20


def test_hf_and_mlx_wrapper_render_the_same_prompts(hf: Any, wrapper: Any) -> None:
    for s in load_scripts():
        assert prompt_ids(hf, s) == prompt_ids(wrapper, s), s.id
    ids = render_chat_prompt_ids(hf, MESSAGES, enable_thinking=False)
    assert hf.convert_ids_to_tokens(ids)[-4:] == ["<think>", "ĊĊ", "</think>", "ĊĊ"]


def test_tokenizer_training_is_deterministic(tmp_path: Path) -> None:
    texts = training_texts(load_scripts())
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        tokenizer = train_tokenizer(texts, TINY.max_vocab, TINY.min_frequency)
        write_tokenizer_files(tokenizer, tmp_path / sub, 4096)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


# --- tool calling: scripts, template, tokens, production rendering ----------------------

WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{TOOL_LINES}\n</tools>\n\nFor each function call, return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
WEATHER_LINE = (
    '{"type": "function", "function": {"name": "get_weather", "description": "Get the '
    'weather.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}'
)


def _call(cid: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


def _chat_prompt(s: Script) -> ChatPrompt:
    """A script's messages as the ingress adapters hand them to the replica."""
    return ChatPrompt(tuple(
        ChatMessage(m.role, m.content, tool_calls=m.tool_calls, tool_call_id=m.tool_call_id,
                    name=m.name)
        for m in s.messages
    ))


def test_tool_scripts() -> None:
    tools = {s.id: s for s in load_scripts() if s.tools}
    assert set(tools) == {"tool-one", "tool-parallel", "tool-result", "tool-after-reasoning",
                          "tool-text-then-call", "tool-parse"}
    parse = tools.pop("tool-parse")  # the SDK's pydantic tool: titles, one tool
    assert parse.expected_calls == (("get_weather", '{"city": "Berlin"}'),)
    assert json.loads(parse.tools[0].parameters)["title"] == "GetWeather"
    for s in tools.values():
        assert [t.name for t in s.tools] == ["get_weather", "get_time"]
        assert all(json.loads(t.parameters)["additionalProperties"] is False for t in s.tools)
    one = script("tool-one")
    assert one.answer == WEATHER_CALL and one.answer_text == ""
    assert one.expected_calls == (("get_weather", '{"city": "Paris"}'),)
    assert script("tool-parallel").answer == WEATHER_CALL + "\n" + WEATHER_CALL.replace(
        "Paris", "Tokyo")
    assert len(script("tool-parallel").expected_calls) == 2
    text_first = script("tool-text-then-call")
    assert text_first.answer_text == "Let me check."
    assert text_first.expected_calls == (("get_weather", '{"city": "Rome"}'),)
    after = script("tool-after-reasoning")
    assert after.enable_thinking is True and after.reasoning
    assert after.expected_text.startswith("<think>\n") and after.expected_text.endswith(
        '\n</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": '
        '"Asia/Tokyo"}}\n</tool_call>')
    # tool-result continues tool-one: its history holds tool-one's call and a result.
    result = script("tool-result")
    assert result.messages[0] == one.messages[0]
    paris_call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    assert result.messages[1].tool_calls == (paris_call,)
    assert result.messages[2].role == "tool" and result.messages[2].tool_call_id == "call_1"
    assert result.expected_calls == () and result.answer == "It is sunny in Paris, 18 degrees."
    # The same question without tools gets text: the tool block is what makes the call.
    none = script("tool-none-offered")
    assert none.messages == one.messages and none.tools == ()
    assert none.answer == "I cannot check the weather."


def test_script_wire_and_template_shapes() -> None:
    result = script("tool-result")
    assistant, tool = result.message_dicts[1:]
    assert assistant["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert tool == {"role": "tool", "content": '{"temperature": 18, "condition": "sunny"}',
                    "tool_call_id": "call_1", "name": "get_weather"}
    assert result.template_messages[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris"}
    assert result.tool_dicts[0]["function"]["parameters"]["required"] == ["city"]
    assert script("hello").message_dicts == [{"role": "user", "content": "Hello!"}]


_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"answer": WEATHER_CALL}, "does not offer"),
        ({"tools": _TOOLS, "answer": '<tool_call>\n{"name":"f","arguments":{}}\n</tool_call>'},
         "template form"),
        ({"tools": _TOOLS, "answer": '<tool_call>\n{"name": "f", "arguments": {}}\n'
                                     "</tool_call> and more"}, "end the answer"),
        ({"tools": _TOOLS, "answer": '<tool_call>\n{"name": "f", "arguments": {}\n</tool_call>'},
         "not valid JSON"),
        ({"tools": _TOOLS, "answer": 'Sure.<tool_call>\n{"name": "f", "arguments": {}}\n'
                                     "</tool_call>"}, "ends with a newline"),
        ({"tools": [{"type": "web", "function": {}}]}, "malformed"),
        ({"tools": _TOOLS, "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "tool", "content": "1", "tool_call_id": "nope", "name": "f"}]},
         "answers an earlier call"),
        ({"tools": _TOOLS, "messages": [
            {"role": "user", "content": "Hi", "tool_calls": [_call("a", "f", {})]}]},
         "only assistant"),
        ({"tools": _TOOLS, "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "", "tool_calls": [_call("a", "g", {})]},
            {"role": "user", "content": "Hi"}]}, "unknown tool"),
        ({"kind": "completion", "prompt": "x", "messages": [], "tools": _TOOLS}, "no tools"),
    ],
)
def test_invalid_tool_scripts_are_rejected(fields: dict[str, Any], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_scripts(_one_script_json(**fields))


def test_a_script_may_end_with_a_tool_result() -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [_call("a", "f", {"x": 1})]},
        {"role": "tool", "content": "1", "tool_call_id": "a", "name": "f"},
    ]
    (parsed,) = parse_scripts(_one_script_json(tools=_TOOLS, messages=messages))
    assert parsed.messages[-1].role == "tool"
    assert parsed.messages[1].tool_calls == (ToolCall("a", "f", '{"x": 1}'),)


def test_tool_markers_are_plain_added_tokens(hf: Any) -> None:
    markers = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
    assert set(markers) <= set(PLAIN_ADDED_TOKENS)
    added = {t.content: t for t in hf.added_tokens_decoder.values()}
    for marker in markers:
        assert len(hf.encode(marker, add_special_tokens=False)) == 1, marker
        assert added[marker].special is False
    ids = hf.encode(WEATHER_CALL + "<|im_end|>", add_special_tokens=False)
    assert hf.convert_ids_to_tokens(ids)[0] == "<tool_call>"
    assert hf.decode(ids, skip_special_tokens=True) == WEATHER_CALL


def _render(hf: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return str(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                      **kwargs))


def test_template_puts_tools_in_the_system_turn_like_qwen3(hf: Any) -> None:
    block = TOOLS_BLOCK.replace("{TOOL_LINES}", WEATHER_LINE)
    user = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert _render(hf, [{"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL]) == (
        f"<|im_start|>system\n{block}<|im_end|>\n{user}")
    with_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert _render(hf, with_system, tools=[WEATHER_TOOL]) == (
        f"<|im_start|>system\nBe brief.\n\n{block}<|im_end|>\n{user}")
    # One tojson line per tool; without tools there is no tool block at all.
    two = _render(hf, with_system, tools=[WEATHER_TOOL, WEATHER_TOOL])
    assert f"<tools>\n{WEATHER_LINE}\n{WEATHER_LINE}\n</tools>" in two
    assert _render(hf, with_system) == f"<|im_start|>system\nBe brief.<|im_end|>\n{user}"
    assert _render(hf, with_system, tools=[]) == _render(hf, with_system)


def test_template_renders_calls_and_grouped_results_like_qwen3(hf: Any) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            _call("a", "get_weather", {"city": "Paris"}), _call("b", "get_time", {})]},
        {"role": "tool", "content": "r1", "tool_call_id": "a", "name": "get_weather"},
        {"role": "tool", "content": "r2", "tool_call_id": "b", "name": "get_time"},
        {"role": "assistant", "content": "", "tool_calls": [
            _call("c", "get_weather", {"city": "Rome"})]},
        {"role": "tool", "content": "r3", "tool_call_id": "c", "name": "get_weather"},
    ]
    assert _render(hf, messages) == (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n" + WEATHER_CALL + "\n"
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n"
        "<tool_response>\nr2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n" + WEATHER_CALL.replace("Paris", "Rome") + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nr3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_scripted_calls_match_how_the_template_renders_them(hf: Any) -> None:
    # The model's output, sent back as history, renders to the very same text.
    one, result = script("tool-one"), script("tool-result")
    history = _render(hf, result.template_messages, tools=result.tool_dicts)
    assert f"<|im_start|>assistant\n{one.answer}<|im_end|>\n" in history
    prompt_one = _render(hf, one.template_messages, tools=one.tool_dicts)
    assert history.startswith(prompt_one)
    text_first = script("tool-text-then-call")
    replayed = [*text_first.template_messages, {
        "role": "assistant", "content": text_first.answer_text,
        "tool_calls": [_call("x", n, json.loads(a)) for n, a in text_first.expected_calls]}]
    assert f"<|im_start|>assistant\n{text_first.answer}<|im_end|>" in _render(hf, replayed)


def test_render_prompt_matches_the_scripts_for_every_script(hf: Any) -> None:
    # Production rendering (contract types -> template dicts) trains on what it serves.
    for s in load_scripts():
        if s.kind != "chat":
            continue
        rendered = render_prompt(hf, _chat_prompt(s), ReasoningSpec(enabled=s.enable_thinking),
                                 len(hf), tools=s.tools)
        assert list(rendered.token_ids) == prompt_ids(hf, s), s.id
    bare = render_chat_text(hf, _chat_prompt(script("tool-one")), ReasoningSpec())
    assert "# Tools" not in bare


def test_render_prompt_passes_tools_only_when_there_are_some() -> None:
    seen: list[dict[str, Any]] = []

    class Recorder:
        chat_template = "x"

        def apply_chat_template(self, messages: Any, **kwargs: Any) -> str:
            seen.append({"messages": messages, **kwargs})
            return "text"

        def encode(self, text: str, **kwargs: Any) -> list[int]:
            return [1]

    prompt = _chat_prompt(script("tool-result"))
    render_prompt(Recorder(), prompt, ReasoningSpec(), 10)
    assert "tools" not in seen[-1]
    tool = ToolSpec("get_weather", "Weather.", '{"type": "object"}')
    render_prompt(Recorder(), prompt, ReasoningSpec(), 10, tools=(tool,))
    assert seen[-1]["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather.", "parameters": {"type": "object"}}}]
    assert seen[-1]["messages"][1:] == script("tool-result").template_messages[1:]
    render_prompt(Recorder(), prompt, ReasoningSpec(), 10, tools=(ToolSpec("f"),))
    assert seen[-1]["tools"][0]["function"] == {"name": "f", "parameters": {"type": "object"}}
    # Completions never go through the template, tools or not.
    render_prompt(Recorder(), TextPrompt("Hi"), ReasoningSpec(), 10, tools=(tool,))
    assert len(seen) == 3


@pytest.mark.parametrize("arguments", ['{"city": ', "[1, 2]", '"Paris"', "null", ""])
def test_call_arguments_that_are_not_a_json_object_are_rejected(
    hf: Any, arguments: str
) -> None:
    messages = (
        ChatMessage("user", "Hi"),
        ChatMessage("assistant", "", tool_calls=(ToolCall("a", "get_weather", arguments),)),
        ChatMessage("tool", "ok", tool_call_id="a", name="get_weather"),
    )
    with pytest.raises(InvalidRequestError) as err:
        render_prompt(hf, ChatPrompt(messages), ReasoningSpec(), len(hf))
    assert err.value.param == "messages"


def test_tool_parameters_that_are_not_json_are_rejected(hf: Any) -> None:
    prompt = ChatPrompt((ChatMessage("user", "Hi"),))
    with pytest.raises(InvalidRequestError) as err:
        render_prompt(hf, prompt, ReasoningSpec(), len(hf), tools=(ToolSpec("f", None, "{"),))
    assert err.value.param == "tools"


# --- recipes and cache -----------------------------------------------------------------


def test_cache_key_follows_the_recipe_and_the_scripts() -> None:
    text = scripts_text()
    key = cache_key(TINY, text)
    assert key.startswith("tiny-") and key == cache_key(TINY, text)
    edited = text.replace("Mexico City", "Mexico  City", 1)
    assert edited != text and cache_key(TINY, edited) != key
    assert cache_key(replace(TINY, seed=TINY.seed + 1), text) != key
    assert cache_key(BENCH, text) != key


def test_builtin_names_and_unknown_name() -> None:
    assert {"tiny", "bench"} <= set(BUILTIN_NAMES)
    with pytest.raises(ValueError, match="tiny") as err:
        ensure_builtin("nope")
    assert "bench" in str(err.value)


def test_random_weights_need_an_untied_head() -> None:
    with pytest.raises(ValueError, match="untied"):
        replace(SMALL, architecture=replace(SMALL.architecture, tie_word_embeddings=True))


def test_unknown_weight_dtype_is_rejected() -> None:
    with pytest.raises(ValueError, match="dtype"):
        replace(SMALL, dtype="float8")


def test_weights_are_saved_in_the_recipe_dtype(tmp_path: Path) -> None:
    # bench ships in bfloat16, as released MLX checkpoints do; tiny stays in float32.
    assert (BENCH.dtype, TINY.dtype) == ("bfloat16", "float32")
    built = ensure_recipe(replace(SMALL, dtype="bfloat16"), tmp_path)
    weights = {k: v for f in built.glob("model-*.safetensors") for k, v in mx.load(str(f)).items()}
    assert weights and {w.dtype for w in weights.values()} == {mx.bfloat16}
    assert json.loads((built / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model, _ = mlx_lm.load(str(built))
    assert model.lm_head.weight.dtype == mx.bfloat16


def test_default_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ORCHARD_CACHE_DIR", str(tmp_path))
    assert default_cache_root() == tmp_path / "builtin"
    monkeypatch.delenv("ORCHARD_CACHE_DIR")
    assert default_cache_root() == Path.home() / ".cache" / "orchard" / "builtin"


def _ensure_small_in_step(cache_dir: str, barrier: Any, results: Any) -> None:
    """Child process: wait for the sibling, then race it; report the path and
    whether this process was the one that built."""
    messages: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    build_log = logging.getLogger(build_module.__name__)
    build_log.setLevel(logging.INFO)
    build_log.addHandler(Capture())
    barrier.wait()
    path = ensure_recipe(SMALL, Path(cache_dir))
    results.put((str(path), any(m.startswith("building") for m in messages)))


def test_concurrent_builds_make_one_directory(tmp_path: Path) -> None:
    # Separate processes, as with several Ray replicas on one machine.
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    workers = [
        ctx.Process(target=_ensure_small_in_step, args=(str(tmp_path), barrier, results))
        for _ in range(2)
    ]
    for w in workers:
        w.start()
    outcomes = [results.get(timeout=120) for _ in workers]
    for w in workers:
        w.join(timeout=30)
        assert w.exitcode == 0
    paths = {path for path, _ in outcomes}
    assert len(paths) == 1
    assert sorted(built for _, built in outcomes) == [False, True]
    built_dir = Path(paths.pop())
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == [built_dir.name]
    assert not list(tmp_path.glob(".*.tmp-*"))
    info = json.loads((built_dir / "build_info.json").read_text())
    assert info["name"] == "small-test" and info["cache_key"] == built_dir.name
    model, tokenizer = mlx_lm.load(str(built_dir))
    assert model.args.model_type == "qwen3"
    assert tokenizer.eos_token == "<|im_end|>"
    # A later call reuses the directory without rebuilding.
    mtime = (built_dir / "model.safetensors.index.json").stat().st_mtime_ns
    assert ensure_recipe(SMALL, tmp_path) == built_dir
    assert (built_dir / "model.safetensors.index.json").stat().st_mtime_ns == mtime


def test_weights_are_split_by_layer_with_an_index(tmp_path: Path) -> None:
    # As a sharded checkpoint: a pipeline stage reads only its own layers' files.
    built = ensure_recipe(replace(SMALL, name="small-qwen2", architecture=replace(
        SMALL.architecture, model_type="qwen2")), tmp_path)
    index = json.loads((built / "model.safetensors.index.json").read_text())["weight_map"]
    layers = SMALL.architecture.num_hidden_layers
    files = {f for f in index.values()}
    assert len(files) == layers + 1  # one per layer, one for embeddings, norm and head
    for name, filename in index.items():
        assert name in mx.load(str(built / filename))
        if ".layers." in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            assert all(filename == f for n, f in index.items() if f".layers.{layer}." in n)
    model, _ = mlx_lm.load(str(built))
    assert model.args.model_type == "qwen2"


def test_failed_build_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(recipe: Recipe, scripts: list[Script], out_dir: Path, key: str) -> None:
        (out_dir / "partial").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setattr(build_module, "build", broken)
    with pytest.raises(RuntimeError, match="boom"):
        ensure_recipe(SMALL, tmp_path)
    assert [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
