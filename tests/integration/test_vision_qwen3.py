"""Qwen3-VL's two differences from Qwen2.5-VL matter in `builtin:vision-qwen3`'s answers,
which test_vision_qwen.py checks against mlx-vlm's generation (alone, batched beside text
rows, chunked, paged, from the prefix cache, resumed, preempted): without DeepStack's
additions the answer is mlx-vlm's without them, not its own; with Qwen2-VL's sections
(one contiguous block of frequencies per axis) in place of interleaved ones, it differs.
"""

from __future__ import annotations

import io
from typing import Any, Iterator

import pytest
from PIL import Image

from replicas.engine.model.mrope import MRope
from replicas.replica import ModelReplica, ReplicaOptions
from replicas.sources import resolve_source
from tests.vision_requests import QUESTION, ask, image, tokens
from tests.streams import stream_events

SOURCE = "builtin:vision-qwen3"


@pytest.fixture(scope="module")
def mlx_vlm_model() -> tuple[Any, Any]:
    from mlx_vlm import load

    return load(str(resolve_source(SOURCE)))  # type: ignore[no-any-return]


def theirs(model: Any, processor: Any, color: str, size: tuple[int, int]) -> list[int]:
    """mlx-vlm's greedy answer to `ask`'s question about one picture."""
    from mlx_vlm import stream_generate

    content = [{"type": "text", "text": QUESTION}, {"type": "image"}]
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    picture = Image.open(io.BytesIO(image(color, size).data))
    return [r.token for r in stream_generate(model, processor, prompt, image=[picture],
                                             max_tokens=10, temperature=0.0)][:10]


@pytest.fixture
def replica() -> Iterator[ModelReplica]:
    """A replica of its own: the changes below would otherwise reach other tests (and the
    prefix cache would answer from KV made before them)."""
    rep = ModelReplica(ReplicaOptions(model_id="vq3", source=SOURCE))
    rep.start()
    yield rep
    rep.shutdown()


def test_deepstack_is_what_makes_the_answer_mlx_vlms(replica: ModelReplica,
                                                     mlx_vlm_model: tuple[Any, Any]) -> None:
    model, processor = mlx_vlm_model
    vision = replica._vision  # noqa: SLF001
    assert vision is not None
    expected = theirs(model, processor, "olive", (64, 48))
    assert tokens(stream_events(replica, ask("with", image("olive", (64, 48))))) == expected
    vision._deepstack = False  # noqa: SLF001 - prompts made from now on carry no additions
    without = tokens(stream_events(replica, ask("without", image("navy", (64, 48)))))
    text = model.language_model.model
    text._deepstack_process = lambda hidden, mask, embeds: hidden  # mlx-vlm's, without
    try:
        assert without == theirs(model, processor, "navy", (64, 48))
    finally:
        del text._deepstack_process
    assert without != theirs(model, processor, "navy", (64, 48))


def test_interleaved_sections_matter(replica: ModelReplica,
                                     mlx_vlm_model: tuple[Any, Any]) -> None:
    from mlx_vlm.models.rope_utils import MRoPERotaryEmbedding

    model, processor = mlx_vlm_model
    layers = replica.model.model.layers
    ropes = [layer.self_attn.rope for layer in layers]
    assert all(isinstance(r, MRope) for r in ropes)
    interleaved = ropes[0]._rotary  # noqa: SLF001
    assert interleaved.style == "interleaved"
    chunked = MRoPERotaryEmbedding(interleaved.dim, base=interleaved.base,
                                   mrope_section=interleaved.mrope_section, style="chunked")
    for rope in ropes:
        rope._rotary = chunked  # noqa: SLF001
    answer = tokens(stream_events(replica, ask("chunked", image("teal", (48, 64)))))
    assert len(answer) == 10  # an answer, not a failed stream
    assert answer != theirs(model, processor, "teal", (48, 64))
