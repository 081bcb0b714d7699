"""The family models (`builtin:fmt-<tool format>`, replicas/builtin/family_models.py): one per
tool format, built in seconds, and Orchard detects each one's format from its files alone;
the template writes the tools, an assistant's call and the tool result, and the call it
writes in history reads back through Orchard's own parser as the same call.

Over HTTP they are driven by tests/e2e/test_tool_format_models.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.utils import load_tokenizer

from replicas.builtin import BUILTIN_NAMES, ensure_builtin, family_model_name
from replicas.builtin.family_models import FAMILY_MODELS, SAMPLE_MESSAGES, SAMPLE_TOOLS
from replicas.contract import TextDelta, ToolCallEnd, ToolCallStart
from replicas.families.registry import (
    TOOL_FORMATS,
    detect_channel_format,
    detect_tool_format,
    get_channel_format,
)
from replicas.pipeline.channels import initial_state
from tests.unit.test_tool_calls import Sample, decode

FORMATS = [name for name in TOOL_FORMATS if name != "none"]


def family_of(fmt: str) -> Any:
    name = family_model_name(fmt)
    if name not in FAMILY_MODELS:
        pytest.fail(f"tool format {fmt!r} has no built-in model {name!r}")
    return FAMILY_MODELS[name][1]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("family-models")


def tokenizer(fmt: str, cache: Path) -> Any:
    family_of(fmt)
    return load_tokenizer(ensure_builtin(family_model_name(fmt), cache))._tokenizer


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_tool_format_has_a_model(fmt: str) -> None:
    assert family_of(fmt).tools.name == fmt
    assert family_model_name(fmt) in BUILTIN_NAMES


def test_every_model_is_of_a_known_format() -> None:
    for name, (recipe, family) in FAMILY_MODELS.items():
        assert name == recipe.name == family_model_name(family.tools.name)
        assert family.tools.name in FORMATS
    assert len({recipe.seed for recipe, _ in FAMILY_MODELS.values()}) == len(FAMILY_MODELS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_orchard_detects_the_format_from_the_files(fmt: str, cache: Path) -> None:
    hf = tokenizer(fmt, cache)
    vocab = hf.get_vocab().keys()
    assert detect_tool_format(hf.chat_template, vocab) == fmt
    channel = TOOL_FORMATS[fmt].channel_format  # Harmony's and Kimi K3's go with their own
    if channel is not None:
        assert detect_channel_format(hf.chat_template, vocab) == channel
    grammar = TOOL_FORMATS[fmt].grammar
    assert grammar is not None
    for marker in grammar.markers:  # added tokens in the family's vocabulary: here too
        ids = hf.encode(marker, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] in hf.added_tokens_decoder, marker
    info = json.loads((ensure_builtin(family_model_name(fmt), cache) / "build_info.json")
                      .read_text())
    assert info["tool_format"] == fmt and info["weights"]["source"] == "random"


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_template_writes_tools_calls_and_results(fmt: str, cache: Path) -> None:
    text = tokenizer(fmt, cache).apply_chat_template(
        list(SAMPLE_MESSAGES), tools=list(SAMPLE_TOOLS), add_generation_prompt=True,
        tokenize=False)
    for needed in ("set_mode", "dark", "high", "get_weather", "Paris", "sunny", "18",
                   SAMPLE_MESSAGES[-1]["content"]):
        assert needed in text, needed


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_call_in_history_reads_back_as_the_same_call(fmt: str, cache: Path) -> None:
    """What the template writes for an assistant's call is what the model would write:
    Orchard's parser, started where the prompt leaves the model, finds that call."""
    hf = tokenizer(fmt, cache)
    question, call = list(SAMPLE_MESSAGES[1:3])
    kwargs: dict[str, Any] = {"tools": list(SAMPLE_TOOLS), "tokenize": False}
    prompt = hf.apply_chat_template([question], add_generation_prompt=True, **kwargs)
    history = hf.apply_chat_template([question, call], add_generation_prompt=False, **kwargs)
    assert history.startswith(prompt)
    turn = history[len(prompt):]
    channels = detect_channel_format(hf.chat_template, hf.get_vocab().keys())
    state = initial_state(get_channel_format(channels), prompt)
    events = decode(Sample(channels, fmt, turn, state=state), [turn])
    assert [e.name for e in events if isinstance(e, ToolCallStart)] == ["get_weather"], turn
    assert [json.loads(e.arguments) for e in events if isinstance(e, ToolCallEnd)] == [
        {"city": "Paris"}]
    assert not "".join(e.text for e in events if isinstance(e, TextDelta)).strip()


@pytest.mark.parametrize("fmt", ["kimi_k2", "harmony", "hermes", "deepseek_v31"])
def test_the_head_favours_the_call_markers(fmt: str, cache: Path) -> None:
    # Wherever a marker may come, it beats any text: the free choices of a forced call end.
    path = ensure_builtin(family_model_name(fmt), cache)
    model, wrapper = mlx_lm.load(str(path))[:2]
    hf = wrapper._tokenizer
    favoured = {hf.convert_tokens_to_ids(t) for t in family_of(fmt).template.favoured}
    text = hf.apply_chat_template(list(SAMPLE_MESSAGES), tools=list(SAMPLE_TOOLS),
                                  add_generation_prompt=True, tokenize=False)
    logits = model(mx.array([hf.encode(text, add_special_tokens=False)]))[0]
    best = mx.argmax(logits, axis=-1).tolist()
    assert set(best) <= favoured
