"""The agent model's tokenizer: the built-in tokenizer's layout, with merges across words.

Training time on two CPU cores grows with sequence length, and the clients' prompts repeat
whole sentences between turns (and between the variants of one turn). A byte-level BPE
whose merges may cross word boundaries makes them several times shorter than Qwen's split
regex does (about 100 tokens instead of 500-1200). Only digits are kept apart, one per
token, so a number that changes between runs (Codex's wall time) never changes the tokens
around it. The special and added tokens (ChatML markers, `<think>`, `<tool_call>`, ...) are
the built-in tokenizer's, so the replica detects the same channel and tool formats.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

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

from replicas.builtin.tokenizer_files import PLAIN_ADDED_TOKENS, SPECIAL_TOKENS, write_json


def train_agent_tokenizer(texts: Sequence[str], max_vocab: int) -> Tokenizer:
    """Learn merges on `texts` (cut around the added tokens first, see `corpus_pieces`)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max_vocab - len(SPECIAL_TOKENS) - len(PLAIN_ADDED_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_special_tokens([_added(t, special=True) for t in SPECIAL_TOKENS])
    tokenizer.add_tokens([_added(t, special=False) for t in PLAIN_ADDED_TOKENS])
    return tokenizer


def corpus_pieces(text: str) -> list[str]:
    """`text` cut around the special and added tokens, which never go through BPE."""
    pieces = [text]
    for marker in SPECIAL_TOKENS + PLAIN_ADDED_TOKENS:
        pieces = [p for piece in pieces for p in piece.split(marker)]
    return [p for p in pieces if p]


def keep_own_pre_tokenizer(model_dir: Path) -> None:
    """Make transformers load tokenizer.json as it is.

    `write_tokenizer_files` names `Qwen2Tokenizer`, and that class swaps in Qwen's split
    regex whatever tokenizer.json says; the generic fast class keeps ours.
    """
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    write_json(path, config)


def _added(content: str, special: bool) -> AddedToken:
    return AddedToken(
        content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special
    )
