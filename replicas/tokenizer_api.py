"""The model's tokenizer for clients that tokenize on their own (vLLM's `/tokenize`,
`/detokenize` and `/tokenizer_info`, which evaluation harnesses use): plain encoding,
decoding checked against the vocabulary, and what the tokenizer is."""

from __future__ import annotations

from typing import Any, Sequence

from replicas.contract import TokenizerInfo
from replicas.errors import InvalidRequestError
from replicas.engine.model.loading import LoadedModel
from replicas.pipeline.prompt import encodable


def encode_plain(hf_tokenizer: Any, text: str) -> tuple[int, ...]:
    """`text` as ids without the tokenizer's own additions (a BOS)."""
    return tuple(hf_tokenizer.encode(encodable(text, "prompt"), add_special_tokens=False))


def decode_ids(hf_tokenizer: Any, vocab_size: int, token_ids: Sequence[int]) -> str:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", param="tokens")
    return str(hf_tokenizer.decode(list(token_ids), skip_special_tokens=False))


def describe_tokenizer(model: LoadedModel, context_length: int) -> TokenizerInfo:
    hf = model.hf_tokenizer

    def token(name: str) -> str | None:
        value = getattr(hf, name, None)
        return value if isinstance(value, str) else None

    return TokenizerInfo(
        tokenizer_class=type(hf).__name__,
        eos_token=token("eos_token"),
        bos_token=token("bos_token"),
        pad_token=token("pad_token"),
        chat_template=model.chat_template,
        model_max_length=context_length,
        vocab_size=model.vocab_size,
    )
