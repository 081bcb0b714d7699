"""LFM2-VL with images (`builtin:vision-lfm2`) in a replica in-process: a language model
of short convolutions beside attention (mlx-lm's `lfm2-vl` over LFM2), its image prefix
plain 1-D positions, driven by the ordinary batch. Its answers are mlx-vlm's own, token
for token, with 0, 1 and 2 images, alone, batched beside text rows, prefilled in chunks
(the convolution's state carried across them) and from the prefix cache, with images in
several turns; a resumed stream continues exactly.

The convolution state is an `ArraysCache`, the kind Qwen3.5's linear attention keeps, so
the slow preemption check stays with test_vision_qwen.py's hybrid source.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
from typing import Any, Callable, Iterator

import pytest
from PIL import Image

from replicas.contract import (
    ChatPrompt,
    GenerationRequest,
)
from replicas.engine.config import EngineConfig
from replicas.replica import ModelReplica, ReplicaOptions
from replicas.sources import resolve_source
from tests.streams import stream_events
from tests.vision_requests import (
    answers,
    ask,
    finished,
    image,
    mlx_vlms_two_turns,
    tokens,
    two_turns,
)

SOURCE = "builtin:vision-lfm2"
Reference = Callable[[GenerationRequest], list[int]]


@pytest.fixture(scope="module")
def replica() -> Iterator[ModelReplica]:
    rep = ModelReplica(ReplicaOptions(model_id="vl", source=SOURCE))
    rep.start()
    assert rep.sees
    yield rep
    rep.shutdown()


@pytest.fixture(scope="module")
def reference() -> Reference:
    """mlx-vlm's own greedy generation for a request made by `ask`: the reference."""
    from mlx_vlm import load, stream_generate

    model, processor = load(str(resolve_source(SOURCE)))

    def generate(request: GenerationRequest) -> list[int]:
        assert isinstance(request.prompt, ChatPrompt)
        message = request.prompt.messages[0]
        content: list[dict[str, Any]] = [{"type": "text", "text": message.content}]
        content += [{"type": "image"} for _ in message.images]
        prompt = processor.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
        pictures = [Image.open(io.BytesIO(at.image.data)) for at in message.images]
        n = request.sampling.max_tokens
        assert n is not None
        extra = {"image": pictures} if pictures else {}
        # Its last response repeats the last token with the totals: only the first N count.
        return [r.token for r in stream_generate(model, processor, prompt, max_tokens=n,
                                                 temperature=0.0, **extra)][:n]

    return generate


def requests() -> list[GenerationRequest]:
    """Text rows, and rows with 0, 1 and 2 images of different shapes."""
    return [ask("text", text="Hello there"), ask("red", image("red")),
            ask("blue", image("blue", (64, 48))),
            ask("two", image("green", (48, 40)), image("purple", (64, 32))),
            ask("words", text="Tell me a story", max_tokens=12)]


def test_answers_are_mlx_vlms_alone(replica: ModelReplica, reference: Reference) -> None:
    got = {r.request_id: tokens(stream_events(replica, r)) for r in requests()}
    assert got == {r.request_id: reference(r) for r in requests()}
    assert len({tuple(t) for t in got.values()}) == len(got)  # images matter


def test_images_batch_with_text_rows(replica: ModelReplica, reference: Reference) -> None:
    assert answers(replica, requests()) == [reference(r) for r in requests()]


def test_the_prefix_cache_keys_on_the_image(replica: ModelReplica,
                                           reference: Reference) -> None:
    """A second request with the same image reuses the first's KV and convolution state;
    another image reuses nothing."""
    first = stream_events(replica, ask("c1", image("orange")))
    again = stream_events(replica, ask("c2", image("orange")))
    other = stream_events(replica, ask("c3", image("teal")))
    assert tokens(again) == tokens(first) == reference(ask("c", image("orange")))
    prompt = finished(again).usage.prompt_tokens
    assert finished(again).usage.cached_tokens == prompt - 1
    assert finished(other).usage.cached_tokens == 0
    assert tokens(other) != tokens(first)


def test_images_in_several_turns_are_mlx_vlms(replica: ModelReplica) -> None:
    """Images in two user turns with text between them, each closed by `<|image_end|>`
    (what tells one image's tokens from the next's in the prefix cache's key)."""
    assert tokens(stream_events(replica, two_turns("vl"))) == mlx_vlms_two_turns(SOURCE)


def test_tokenize_counts_an_images_real_tokens(replica: ModelReplica) -> None:
    """`/tokenize` and `count_tokens` see the image's tokens, not one placeholder."""
    request = ask("count", image("red"), image("blue", (64, 32)))
    ids = asyncio.run(replica.tokenize(request))
    assert isinstance(ids, tuple)
    vision = replica._vision  # noqa: SLF001
    assert vision is not None
    # 64x64 pixels: 8x8 patches of 8, unshuffled 2x2, 16 tokens; 64x32: 8.
    assert ids.count(vision.image_token_id) == 16 + 8
    assert len(ids) == finished(stream_events(replica, request)).usage.prompt_tokens


def test_chunked_prefill_is_mlx_vlms(reference: Reference) -> None:
    """With a 3-token prefill step the image prefix and the text after it go in many
    chunks, the convolution's state carried from each to the next; with no prefix cache
    every prompt is prefilled whole."""
    rep = ModelReplica(ReplicaOptions(model_id="vl", source=SOURCE, engine=EngineConfig(
        prefill_step_size=3, prompt_cache_bytes=0)))
    rep.start()
    try:
        batched = answers(rep, requests())
    finally:
        rep.shutdown()
    assert batched == [reference(r) for r in requests()]


def test_a_resumed_stream_goes_on_exactly(replica: ModelReplica) -> None:
    """A stream about an image cut after some tokens and resumed with the ids sent so
    far: the rest is the uninterrupted stream's."""
    request = ask("whole", image("maroon", (64, 48)), max_tokens=16)
    whole = tokens(stream_events(replica, request))
    for cut in (1, 7, 15):
        resumed = dataclasses.replace(request, request_id=f"resumed-{cut}",
                                      resume=tuple(whole[:cut]))
        assert whole[:cut] + tokens(stream_events(replica, resumed)) == whole, cut
