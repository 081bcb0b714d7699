"""Incremental detokenization that only ever emits complete UTF-8 text.

Decoding token by token breaks multi-byte characters (a byte-level BPE may split one emoji
over four tokens) and word-boundary spacing (SentencePiece). We decode a short sliding
window instead: text is released once the window decodes without a trailing U+FFFD, and the
window then slides forward, so each step costs O(window), not O(output).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

REPLACEMENT = "\ufffd"

Decode = Callable[[Sequence[int]], str]


def make_decode(hf_tokenizer: Any) -> Decode:
    """Decode keeping special tokens (channel markers are special in some formats).

    The raw `tokenizers` backend skips transformers' Python wrapper, several times cheaper
    per call, which matters as this runs once or twice per token per request.
    """
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(list(ids), skip_special_tokens=False)
    return lambda ids: hf_tokenizer.decode(list(ids), skip_special_tokens=False)


class Detokenizer:
    """`feed(token_id) -> new text`, `finish() -> remaining text`."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._tokens: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # tokens before this are already emitted

    def feed(self, token_id: int) -> str:
        self._tokens.append(token_id)
        window = self._tokens[self._prefix_offset :]
        prefix_len = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window[:prefix_len]) if prefix_len else ""
        full_text = self._decode(window)
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT):
            return ""  # an incomplete character (or nothing new yet): wait for more bytes
        # The emitted tokens become the next window's left context (word-boundary rules).
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self._compact()
        return full_text[len(prefix_text) :]

    def finish(self) -> str:
        """Whatever is still unread, even if it ends in an incomplete character."""
        window = self._tokens[self._prefix_offset :]
        prefix_len = self._read_offset - self._prefix_offset
        prefix_text = self._decode(window[:prefix_len]) if prefix_len else ""
        full_text = self._decode(window)
        self._read_offset = len(self._tokens)
        return full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""

    def _compact(self) -> None:
        # Drop tokens the window will never look at again, so memory stays O(window).
        drop = self._prefix_offset
        if drop > 64:
            del self._tokens[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
