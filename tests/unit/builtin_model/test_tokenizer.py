"""The built-in models' tokenizer files: chat template, special and added tokens, vocabulary,
deterministic training (the tokenizer fixtures are in conftest.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

from replicas.builtin import load_scripts, script
from replicas.builtin.recipe import TINY
from replicas.builtin.tokenizer_files import (
    prompt_ids,
    render_chat_prompt_ids,
    train_tokenizer,
    training_texts,
    write_tokenizer_files,
)


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
