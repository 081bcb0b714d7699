"""The built-in models' tokenizer: a byte-level BPE trained offline on the scripts.

The pipeline (NFC, Qwen2 split regex, byte-level alphabet) and the token layout
(ChatML markers as special tokens; the think and tool-call markers as plain added
tokens) copy Qwen3, so every code path that handles a real Qwen3 tokenizer handles this one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

from .chat_template import CHAT_TEMPLATE, TOOLS_FOOTER, TOOLS_HEADER
from .scripts import Rendering, Script, own_rendering

# The split regex of Qwen2/Qwen3 (transformers' Qwen2Tokenizer uses the same one).
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, EOS_TOKEN)
# Not special, as in Qwen3: they must survive decode(skip_special_tokens=True).
PLAIN_ADDED_TOKENS = (
    THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END
)
_ADDED_TOKEN_RE = re.compile("|".join(re.escape(t) for t in PLAIN_ADDED_TOKENS))


class ChatTokenizer(Protocol):
    """What prompt rendering needs: a HF tokenizer or mlx_lm's TokenizerWrapper."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...


def training_texts(scripts: Sequence[Script]) -> list[str]:
    """The corpus the BPE merges are learned from: the scripts as the model sees them.

    Chat turns carry their role line and generated text its think scaffolding, so
    strings like "assistant" and "\\n\\n" get merged tokens; the added tokens are cut
    out because they never go through BPE. Scripts with tools add the tool block of
    the system turn and the calls in their history, close to how the template writes them.
    Each script counts once, in the rendering it names: its other rendering (README.md,
    "Every rendering") repeats its answer, and counting answers twice would let
    `min_frequency` merge what should stay split.
    """
    texts: list[str] = []
    for s in scripts:
        if s.prompt is not None:
            texts.append(s.prompt)
        if s.tools:
            tool_lines = "".join(f"\n{json.dumps(t, ensure_ascii=False)}" for t in s.tool_dicts)
            block = f"system\n{TOOLS_HEADER}{tool_lines}{TOOLS_FOOTER}"
            texts.extend(t for t in _ADDED_TOKEN_RE.split(block) if t)
        for m in s.messages:
            role = "user" if m.role == "tool" else m.role  # results go in a user turn
            turn = f"{role}\n{m.content}" + "".join(
                f'\n{{"name": "{c.name}", "arguments": {c.arguments}}}\n' for c in m.tool_calls
            )
            texts.append(turn)
        generated = s.expected_text
        if s.enable_thinking is False:
            generated = f"{THINK_START}\n\n{THINK_END}\n\n{generated}"
        if s.kind == "chat":
            generated = f"assistant\n{generated}"
        texts.extend(t for t in _ADDED_TOKEN_RE.split(generated) if t)
    return texts


def train_tokenizer(texts: Sequence[str], max_vocab: int, min_frequency: int, *,
                    special: Sequence[str] = SPECIAL_TOKENS,
                    plain: Sequence[str] = PLAIN_ADDED_TOKENS) -> Tokenizer:
    """Learn merges on `texts` (Qwen2's pre-tokenizer, byte-level), then append the added
    tokens after the BPE vocab: `special` ones, then `plain` ones (not special, as Qwen3's
    `<think>`); `max_vocab` counts them all. The tool-format models and the tests' Harmony
    model build theirs here too.

    `min_frequency` stops merging pairs seen only once, so rare strings (CJK, emoji)
    stay split into byte tokens while common words become single tokens.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max_vocab - len(special) - len(plain),
        min_frequency=min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_special_tokens([_added(t, special=True) for t in special])
    tokenizer.add_tokens([_added(t, special=False) for t in plain])
    return tokenizer


def _added(content: str, special: bool) -> AddedToken:
    return AddedToken(
        content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special
    )


def token_id(tokenizer: Tokenizer, token: str) -> int:
    """The id of a token the vocabulary must have (our special and added tokens)."""
    found = tokenizer.token_to_id(token)
    if found is None:
        raise KeyError(f"token {token!r} is not in the tokenizer's vocabulary")
    return found


def write_tokenizer_files(tokenizer: Tokenizer, out_dir: Path, max_length: int) -> int:
    """Write tokenizer.json and tokenizer_config.json; returns the eos token id."""
    tokenizer.save(str(out_dir / "tokenizer.json"))
    ids = {token: token_id(tokenizer, token) for token in SPECIAL_TOKENS + PLAIN_ADDED_TOKENS}
    added_tokens_decoder = {
        str(token_id): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in SPECIAL_TOKENS,
        }
        for token, token_id in ids.items()
    }
    config: dict[str, Any] = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": max_length,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    write_json(out_dir / "tokenizer_config.json", config)
    return ids[EOS_TOKEN]


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def render_chat_prompt_ids(
    tokenizer: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    enable_thinking: bool | None,
    tools: Sequence[Mapping[str, Any]] = (),
) -> list[int]:
    """Prompt ids the way production renders a chat: template to text, then encode.

    `enable_thinking=None` passes no kwarg, so the template default applies; `tools`
    are passed only when there are some, as the serving path does.
    """
    kwargs: dict[str, Any] = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    if tools:
        kwargs["tools"] = list(tools)
    text = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=False, **kwargs
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompt_ids(tokenizer: ChatTokenizer, script: Script | Rendering) -> list[int]:
    """The prompt of a rendering; of a script, the rendering it names."""
    rendering = script if isinstance(script, Rendering) else own_rendering(script)
    s = rendering.script
    if s.kind == "chat":
        return render_chat_prompt_ids(
            tokenizer, s.template_messages, rendering.enable_thinking, s.tool_dicts
        )
    assert s.prompt is not None
    return list(tokenizer.encode(s.prompt, add_special_tokens=False))


def completion_ids(tokenizer: ChatTokenizer, script: Script | Rendering, eos_id: int) -> list[int]:
    """The exact token sequence the model must generate: the expected text, then eos
    (a script's `expected_text`, or a rendering's `text`)."""
    text = script.text if isinstance(script, Rendering) else script.expected_text
    return [*tokenizer.encode(text, add_special_tokens=False), eos_id]
