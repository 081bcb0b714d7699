"""Requests with images for the in-process vision tests (`tests/integration/test_vision*.py`):
a plain-coloured picture, one user turn asking about pictures, and what a stream gave."""

from __future__ import annotations

import io
from typing import Any

from PIL import Image

from replicas.contract import (
    ChatMessage,
    ChatPrompt,
    Finished,
    GenerationRequest,
    ImageAt,
    ImageData,
    OutputEvent,
    SamplingParams,
    TokenIds,
)

QUESTION = "What is in this picture?"


def image(color: str, size: tuple[int, int] = (64, 64), kind: str = "PNG") -> ImageData:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, kind)
    return ImageData(buffer.getvalue(), f"image/{kind.lower()}")


def ask(rid: str, *pictures: ImageData, text: str = QUESTION, max_tokens: int = 10,
        model: str = "vision", **fields: Any) -> GenerationRequest:
    """One user turn: `text`, then the pictures after it; greedy, reporting token ids."""
    at = tuple(ImageAt(len(text), p) for p in pictures)
    return GenerationRequest(rid, model, ChatPrompt((ChatMessage("user", text, images=at),)),
                             SamplingParams(max_tokens=max_tokens, temperature=0.0),
                             report_tokens=True, **fields)


def tokens(events: list[OutputEvent]) -> list[int]:
    return [t for e in events if isinstance(e, TokenIds) for t in e.ids]


def finished(events: list[OutputEvent]) -> Finished:
    last = events[-1]
    assert isinstance(last, Finished), last
    return last
