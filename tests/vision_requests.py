"""Requests with images for the in-process vision tests (`tests/integration/test_vision*.py`):
a plain-coloured picture, one user turn asking about pictures, what a stream gave, and the
preemption check every family runs."""

from __future__ import annotations

import asyncio
import dataclasses
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
from replicas.engine.config import EngineConfig
from replicas.engine.kv.layout import CACHE_STEP
from replicas.replica import ModelReplica, ReplicaOptions
from tests.streams import collect

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


def answers(rep: ModelReplica, rows: list[GenerationRequest]) -> list[list[int]]:
    """All rows at once, in one batch: each one's token ids."""
    async def together() -> list[list[OutputEvent]]:
        return list(await asyncio.gather(*(collect(rep.stream(r)) for r in rows)))

    return [tokens(events) for events in asyncio.run(together())]


def assert_preempted_rows_continue_exactly(source: str, model_id: str,
                                           requests: list[GenerationRequest]) -> None:
    """Under a KV budget of four cache steps, `requests` twice over, never ending: rows
    that grow past a step are preempted and resume by prefill (the image prefix again),
    and each answer is what an ample budget gives."""
    never_end: dict[int, float] = {}
    per_token: list[int] = []

    def run(budget: int | None) -> tuple[list[list[int]], int]:
        rep = ModelReplica(ReplicaOptions(model_id=model_id, source=source, max_model_len=320,
                                          engine=EngineConfig(kv_budget_bytes=budget)))
        rep.start()
        try:
            never_end.update({t: -100.0 for t in rep.model.eos_token_ids})
            per_token.append(rep._engine.kv_budget.layout.per_token)  # noqa: SLF001
            rows = []
            for i, request in enumerate(requests * 2):
                sampling = dataclasses.replace(request.sampling, max_tokens=None,
                                               logit_bias=dict(never_end))
                rows.append(dataclasses.replace(request, request_id=f"{request.request_id}-{i}",
                                                sampling=sampling))
            got = answers(rep, rows)
            memory = rep.stats().memory
            assert memory is not None
            return got, memory.preempted
        finally:
            rep.shutdown()

    ample, _ = run(None)
    squeezed, preempted = run(4 * CACHE_STEP * per_token[0])
    assert preempted > 0  # the budget did force rows out
    assert squeezed == ample
    assert all(len(a) > CACHE_STEP - 64 for a in ample)  # each ran past its first step


def two_turns(model: str, max_tokens: int = 10) -> GenerationRequest:
    """Images in two user turns with text between them: a red one, then a blue one."""
    history = (ChatMessage("user", "Look:", images=(ImageAt(5, image("red")),)),
               ChatMessage("assistant", "I see it."),
               ChatMessage("user", "And now?", images=(ImageAt(8, image("blue", (64, 32))),)))
    return GenerationRequest("turns", model, ChatPrompt(history),
                             SamplingParams(max_tokens=max_tokens, temperature=0.0),
                             report_tokens=True)


def mlx_vlms_two_turns(source: str, max_tokens: int = 10) -> list[int]:
    """mlx-vlm's own greedy tokens for `two_turns`, its template and processor."""
    from mlx_vlm import load, stream_generate

    from replicas.sources import resolve_source

    model, processor = load(str(resolve_source(source)))
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                             {"type": "image"}]},
                {"role": "assistant", "content": "I see it."},
                {"role": "user", "content": [{"type": "text", "text": "And now?"},
                                             {"type": "image"}]}]
    prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=True)
    pictures = [Image.open(io.BytesIO(p.data)) for p in (image("red"), image("blue", (64, 32)))]
    return [r.token for r in stream_generate(model, processor, prompt, image=pictures,
                                             max_tokens=max_tokens, temperature=0.0)][:max_tokens]
