"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and their MoEs (`builtin:vision-qwen`,
`builtin:vision-qwen25`, `builtin:vision-qwen3`, `builtin:vision-qwen3-moe`,
`builtin:vision-qwen35`, `builtin:vision-qwen35-moe`; Qwen3.5 hybrid: linear-attention
layers beside attention) in a replica in-process: multimodal rotary positions (M-RoPE) with the language model driven by the
ordinary batch. Their answers are mlx-vlm's own, token for token, with 0, 1 and 2
images, alone and batched beside text rows, prefilled in chunks and from the prefix cache;
a resumed stream and preempted rows continue exactly.

The images are large enough (up to 16 tokens each) that a row's position delta matters:
dropping it, or prefilling the image with 1-D positions, changes these answers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
from typing import Any, Callable, Iterator, Literal

import pytest
from PIL import Image

from replicas.contract import (
    ChatPrompt,
    GenerationRequest,
    OutputEvent,
)
from replicas.engine.config import EngineConfig
from replicas.engine.failures import EngineDead
from replicas.replica import ModelReplica, ReplicaOptions
from replicas.sources import resolve_source
from tests.streams import collect, stream_events
from tests.vision_requests import (
    ask,
    assert_preempted_rows_continue_exactly,
    finished,
    image,
    mlx_vlms_two_turns,
    tokens,
    two_turns,
)

SOURCES = ["builtin:vision-qwen", "builtin:vision-qwen25", "builtin:vision-qwen3",
           "builtin:vision-qwen3-moe", "builtin:vision-qwen35", "builtin:vision-qwen35-moe"]
# Linear-attention layers beside attention: paged KV pages attention only.
HYBRID = {"builtin:vision-qwen35", "builtin:vision-qwen35-moe"}
# A MoE variant differs from its dense model only in the MLP, which holds nothing that a
# preemption drops or a prefill rebuilds: the (slow) preemption check runs on the dense ones.
MOE = {"builtin:vision-qwen3-moe", "builtin:vision-qwen35-moe"}


@pytest.fixture(scope="module", params=SOURCES)
def source(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def replica(source: str) -> Iterator[ModelReplica]:
    rep = ModelReplica(ReplicaOptions(model_id="vq", source=source))
    rep.start()
    assert rep.sees
    yield rep
    rep.shutdown()


@pytest.fixture(scope="module")
def reference(source: str) -> Callable[[GenerationRequest], list[int]]:
    """mlx-vlm's own greedy generation for a request made by `ask`: the reference."""
    from mlx_vlm import load, stream_generate

    model, processor = load(str(resolve_source(source)))

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


def test_answers_are_mlx_vlms_alone(replica: ModelReplica,
                                    reference: Callable[[GenerationRequest], list[int]]
                                    ) -> None:
    answers = {r.request_id: tokens(stream_events(replica, r)) for r in requests()}
    assert answers == {r.request_id: reference(r) for r in requests()}
    assert len({tuple(t) for t in answers.values()}) == len(answers)  # images matter


def test_images_batch_with_text_rows(replica: ModelReplica,
                                     reference: Callable[[GenerationRequest], list[int]]
                                     ) -> None:
    """All at once: rows with position deltas decode in one batch with rows without."""
    async def together() -> list[list[OutputEvent]]:
        return list(await asyncio.gather(*(collect(replica.stream(r)) for r in requests())))

    batched = [tokens(events) for events in asyncio.run(together())]
    assert batched == [reference(r) for r in requests()]


def test_the_prefix_cache_keys_on_the_image(replica: ModelReplica,
                                           reference: Callable[[GenerationRequest], list[int]]
                                           ) -> None:
    """A second request with the same image reuses the first's KV (the image's and the
    text's after it, whose positions carry the delta) and answers as mlx-vlm does."""
    first = stream_events(replica, ask("c1", image("orange")))
    again = stream_events(replica, ask("c2", image("orange")))
    other = stream_events(replica, ask("c3", image("teal")))
    assert tokens(again) == tokens(first) == reference(ask("c", image("orange")))
    prompt = finished(again).usage.prompt_tokens
    assert finished(again).usage.cached_tokens == prompt - 1
    assert finished(other).usage.cached_tokens == 0
    assert tokens(other) != tokens(first)


def test_images_in_several_turns_are_mlx_vlms(replica: ModelReplica, source: str) -> None:
    """Images in two user turns with text between them: the positions of the text between
    the images are 3-D too (mlx-vlm's `get_rope_index` over the whole prefix)."""
    assert tokens(stream_events(replica, two_turns("vq"))) == mlx_vlms_two_turns(source)


def test_tokenize_counts_an_images_real_tokens(replica: ModelReplica) -> None:
    """`/tokenize` and `count_tokens` see the image's grid of tokens, not one placeholder."""
    request = ask("count", image("red"), image("blue", (64, 32)))
    ids = asyncio.run(replica.tokenize(request))
    assert isinstance(ids, tuple)
    vision = replica._vision  # noqa: SLF001
    assert vision is not None
    # 64x64 pixels: 8x8 patches merged 2x2, 16 tokens; 64x32: 8.
    assert ids.count(vision.image_token_id) == 16 + 8
    assert len(ids) == finished(stream_events(replica, request)).usage.prompt_tokens


@pytest.mark.parametrize("paged", ["off", "on"])
def test_chunked_prefill_is_mlx_vlms(source: str, paged: Literal["off", "on"],
                                     reference: Callable[[GenerationRequest], list[int]]
                                     ) -> None:
    """With a 3-token prefill step the image prefix's 3-D positions and the text after it
    go in many chunks; and with no prefix cache every prompt is prefilled whole. Also
    with paged KV (`memory.paged_kv`): the deltas ride mlx-lm's per-row offsets there too.
    Qwen3.5's linear-attention layers keep the padded batch: paged KV on is refused."""
    rep = ModelReplica(ReplicaOptions(model_id="vq", source=source, engine=EngineConfig(
        prefill_step_size=3, prompt_cache_bytes=0, paged_kv=paged)))
    if paged == "on" and source in HYBRID:
        with pytest.raises(EngineDead, match="not all plain attention"):
            rep.start()
        rep.shutdown()
        return
    rep.start()
    try:
        async def together() -> list[list[OutputEvent]]:
            return list(await asyncio.gather(*(collect(rep.stream(r)) for r in requests())))

        batched = [tokens(events) for events in asyncio.run(together())]
    finally:
        rep.shutdown()
    assert batched == [reference(r) for r in requests()]


def test_a_resumed_stream_goes_on_exactly(replica: ModelReplica) -> None:
    """A stream about an image cut after some tokens and resumed with the ids sent so far
    (`GenerationRequest.resume`): the rest is the uninterrupted stream's (the resumed
    prompt's tokens after the image carry the row's delta)."""
    request = ask("whole", image("maroon", (64, 48)), max_tokens=16)
    whole = tokens(stream_events(replica, request))
    for cut in (1, 7, 15):
        resumed = dataclasses.replace(request, request_id=f"resumed-{cut}",
                                      resume=tuple(whole[:cut]))
        assert whole[:cut] + tokens(stream_events(replica, resumed)) == whole, cut


@pytest.mark.parametrize("dense", [s for s in SOURCES if s not in MOE])
def test_preempted_image_rows_continue_exactly(dense: str) -> None:
    """Preempted rows about images resume by prefill (their prompt grown by what they
    generated, the image prefix again from the prefix cache or the tower) and answer as on
    an ample budget."""
    assert_preempted_rows_continue_exactly(dense, "vq", requests())