"""Qwen3.5's 3-D positions matter in `builtin:vision-qwen35`'s answers, though they rotate a
quarter of each head in half its layers (the others are linear attention, with no
positions): test_vision_qwen.py checks its answers against mlx-vlm's generation (alone,
batched beside text rows, chunked, from the prefix cache, resumed, preempted); here an image
prefix under 1-D positions, or the text after it without the row's delta, answers otherwise.
"""

from __future__ import annotations

import io
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, Sequence

import pytest
from PIL import Image

from replicas.engine.model.mrope import RowPositions, row_positions
from replicas.replica import ModelReplica, ReplicaOptions
from replicas.sources import resolve_source
from tests.streams import stream_events
from tests.vision_requests import QUESTION, ask, image, tokens

SOURCE = "builtin:vision-qwen35"


@pytest.fixture(scope="module")
def mlx_vlm_model() -> tuple[Any, Any]:
    from mlx_vlm import load

    return load(str(resolve_source(SOURCE)))  # type: ignore[no-any-return]


def theirs(model: Any, processor: Any, color: str) -> list[int]:
    """mlx-vlm's greedy answer to `ask`'s question about one 64x48 picture."""
    from mlx_vlm import stream_generate

    content = [{"type": "text", "text": QUESTION}, {"type": "image"}]
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    picture = Image.open(io.BytesIO(image(color, (64, 48)).data))
    return [r.token for r in stream_generate(model, processor, prompt, image=[picture],
                                             max_tokens=10, temperature=0.0)][:10]


@pytest.fixture
def replica() -> Iterator[ModelReplica]:
    """A replica of its own: the changes below would otherwise reach other tests."""
    rep = ModelReplica(ReplicaOptions(model_id="vq35", source=SOURCE))
    rep.start()
    yield rep
    rep.shutdown()


def _rows(replica: ModelReplica) -> RowPositions:
    rows = row_positions(replica.model.model)
    assert rows is not None
    return rows


def _answer(replica: ModelReplica, color: str) -> list[int]:
    answer = tokens(stream_events(replica, ask(color, image(color, (64, 48)))))
    assert len(answer) == 10  # an answer, not a failed stream
    return answer


def test_the_image_prefixs_3d_positions_matter(replica: ModelReplica,
                                              mlx_vlm_model: tuple[Any, Any],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    model, processor = mlx_vlm_model
    assert _answer(replica, "olive") == theirs(model, processor, "olive")
    monkeypatch.setattr(_rows(replica), "explicit", lambda positions: nullcontext())
    assert _answer(replica, "navy") != theirs(model, processor, "navy")


def test_the_rows_delta_matters(replica: ModelReplica, mlx_vlm_model: tuple[Any, Any],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    @contextmanager
    def no_deltas(uids: Sequence[int]) -> Iterator[None]:
        yield

    model, processor = mlx_vlm_model
    monkeypatch.setattr(_rows(replica), "of", no_deltas)
    assert _answer(replica, "maroon") != theirs(model, processor, "maroon")
