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
from replicas.builtin.tokenizer_files import (
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
    assert 16 <= len(scripts) <= 24
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
    for off in (s for s in scripts if s.enable_thinking is False):
        twin = next(s for s in reasoning if s.messages == off.messages)
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
    weights = mx.load(str(built / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {mx.bfloat16}
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
    mtime = (built_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_recipe(SMALL, tmp_path) == built_dir
    assert (built_dir / "model.safetensors").stat().st_mtime_ns == mtime


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
