"""Gemma 3 and Gemma 4 with images (`builtin:vision-gemma3`, `builtin:vision-gemma4`) in a
replica in-process: each image's tokens attend to each other both ways inside the causal
mask, with the language model (mlx-lm's) driven by the ordinary batch. Every test runs for
both (`family`).

Gemma 3's reference is mlx-vlm's own model: its vision tower and merge
(`get_input_embeddings`) and its Gemma 3 language model, prefilled under Gemma 3's mask as
transformers builds it (causal, OR query and key in the same image), then decoded greedily.
mlx-vlm's own `generate` leaves that mask out for Gemma 3 (it computes a 4-D mask its
language model never reads), so it is the reference for Orchard with the mask turned off:
equal token for token there too, and different from the masked answers, which shows the
mask matters.

Gemma 4's reference is mlx-vlm's own `stream_generate`, which applies the mask (its
language model reads the processor's `mm_token_type_ids` where the config says
`use_bidirectional_attention: "vision"`); with the mask off, Orchard answers as mlx-vlm's
same forward without those ids. Its per-layer inputs (at image tokens the pad token's)
are checked by turning that off too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from PIL import Image

from replicas.contract import (
    ChatMessage,
    ChatPrompt,
    ErrorKind,
    Failed,
    GenerationRequest,
    ImageAt,
    SamplingParams,
)
from replicas.engine.config import EngineConfig
from replicas.replica import ModelReplica, ReplicaOptions
from replicas.sources import resolve_source
from tests.streams import stream_events
from tests.vision_requests import (
    answers,
    ask,
    assert_preempted_rows_continue_exactly,
    finished,
    image,
    mlx_vlms_two_turns,
    tokens,
    two_turns,
)

Reference = Callable[[GenerationRequest], list[int]]


@dataclass(frozen=True)
class Family:
    name: str
    source: str
    placeholder: str  # what the chat template writes per image
    tokens_64x32: int  # a 64 x 32 picture's image tokens (a 64 x 64 one's: 16)
    masked_rows: frozenset[str]  # `requests()` whose answers the image mask changes


GEMMA3 = Family("gemma3", "builtin:vision-gemma3", "<start_of_image>", 16,
                frozenset({"blue", "two"}))
GEMMA4 = Family("gemma4", "builtin:vision-gemma4", "<|image|>", 10,
                frozenset({"red", "blue", "two"}))


def requests() -> list[GenerationRequest]:
    """Text rows, and rows with 0, 1 and 2 images of different shapes."""
    return [ask("text", text="Hello there"), ask("red", image("red")),
            ask("blue", image("blue", (64, 48))),
            ask("two", image("green", (48, 40)), image("purple", (64, 32))),
            ask("words", text="Tell me a story", max_tokens=12)]


def replica_with(family: Family, **engine: Any) -> ModelReplica:
    rep = ModelReplica(ReplicaOptions(model_id="g3", source=family.source,
                                      engine=EngineConfig(**engine)))
    rep.start()
    return rep


@pytest.fixture(scope="module", params=[GEMMA3, GEMMA4], ids=lambda f: f.name)
def family(request: pytest.FixtureRequest) -> Family:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def replica(family: Family) -> Iterator[ModelReplica]:
    rep = replica_with(family)
    assert rep.sees
    yield rep
    rep.shutdown()


@pytest.fixture(scope="module")
def vlm(family: Family) -> tuple[Any, Any]:
    from mlx_vlm import load

    return load(str(resolve_source(family.source)))  # type: ignore[no-any-return]


def _prompt(processor: Any, request: GenerationRequest) -> tuple[str, list[Any]]:
    """The request's chat as mlx-vlm renders it (each turn's text, then its images), and
    its pictures in order."""
    assert isinstance(request.prompt, ChatPrompt)
    messages: list[dict[str, Any]] = []
    pictures: list[Any] = []
    for message in request.prompt.messages:
        if message.role == "assistant":
            messages.append({"role": "assistant", "content": message.content})
            continue
        content: list[dict[str, Any]] = [{"type": "text", "text": message.content}]
        content += [{"type": "image"} for _ in message.images]
        messages.append({"role": message.role, "content": content})
        pictures += [Image.open(io.BytesIO(at.image.data)) for at in message.images]
    prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=True)
    return prompt, pictures


def gemma_masks(ids: np.ndarray, image_token: int, window: int) -> tuple[Any, Any]:
    """transformers' Gemma 3 prefill masks, written out (`create_masks_for_vision_model`):
    a global layer's is causal OR query and key in the same run of image tokens; a sliding
    layer's is that AND the key less than `window` positions back."""
    import mlx.core as mx

    is_image = ids == image_token
    starts = is_image & ~np.concatenate([[False], is_image[:-1]])
    group = np.where(is_image, np.cumsum(starts) - 1, -1)
    rows, cols = np.indices((len(ids), len(ids)))
    full = (cols <= rows) | ((group[:, None] == group[None]) & (group[:, None] >= 0))
    return mx.array(full), mx.array(full & (rows - cols < window))


def masked_generate(model: Any, processor: Any, request: GenerationRequest) -> list[int]:
    """mlx-vlm's Gemma, greedy, under its image mask: Gemma 4's own `stream_generate`;
    Gemma 3's prompt prefilled under Gemma 3's masks (`gemma3_masked_generate`)."""
    if model.config.model_type == "gemma4":
        return vlm_stream(model, processor, request)
    return gemma3_masked_generate(model, processor, request)


def causal_generate(model: Any, processor: Any, request: GenerationRequest) -> list[int]:
    """mlx-vlm's Gemma, greedy, without the image mask: Gemma 3's own `stream_generate`
    (which leaves it out); Gemma 4's forward given no `mm_token_type_ids`
    (`gemma4_causal_generate`)."""
    if model.config.model_type == "gemma4":
        return gemma4_causal_generate(model, processor, request)
    return vlm_stream(model, processor, request)


def vlm_stream(model: Any, processor: Any, request: GenerationRequest) -> list[int]:
    """mlx-vlm's own `stream_generate`, greedy."""
    from mlx_vlm import stream_generate

    prompt, pictures = _prompt(processor, request)
    n = request.sampling.max_tokens
    extra = {"image": pictures} if pictures else {}
    return [r.token for r in stream_generate(model, processor, prompt, max_tokens=n,
                                             temperature=0.0, **extra)][:n]


def gemma4_causal_generate(model: Any, processor: Any, request: GenerationRequest) -> list[int]:
    """mlx-vlm's Gemma 4, greedy: its merge and per-layer inputs (`get_input_embeddings`)
    and its language model, prefilled without `mm_token_type_ids` (so causal throughout);
    ending at an end-of-sequence token, as `stream_generate` does."""
    import mlx.core as mx

    prompt, pictures = _prompt(processor, request)
    inputs = processor(text=prompt, images=pictures or None, return_tensors="np")
    ids = mx.array(np.asarray(inputs["input_ids"]))
    pixels = inputs["pixel_values"] if pictures else None
    if pixels is not None:
        pixels = [mx.array(np.asarray(p)) for p in pixels] if isinstance(pixels, list) \
            else mx.array(np.asarray(pixels))
    features = model.get_input_embeddings(ids, pixels)
    cache = model.language_model.make_cache()
    logits = model.language_model(inputs=None, inputs_embeds=features.inputs_embeds,
                                  per_layer_inputs=features.per_layer_inputs,
                                  cache=cache).logits
    out: list[int] = []
    eos = set(model.config.eos_token_id or ())
    assert request.sampling.max_tokens is not None
    while len(out) < request.sampling.max_tokens:
        out.append(int(mx.argmax(logits[0, -1]).item()))
        if out[-1] in eos:
            break
        logits = model.language_model(mx.array([[out[-1]]]), cache=cache).logits
    return out


def gemma3_masked_generate(model: Any, processor: Any, request: GenerationRequest) -> list[int]:
    """mlx-vlm's Gemma 3, greedy, its prompt prefilled under Gemma 3's masks: mlx-vlm's
    merge (`get_input_embeddings`) and its own layers, each given its kind's mask."""
    import mlx.core as mx

    prompt, pictures = _prompt(processor, request)
    inputs = processor(text=prompt, images=pictures or None, return_tensors="np")
    ids = np.asarray(inputs["input_ids"])
    pixels = mx.array(np.asarray(inputs["pixel_values"])) if pictures else None
    embeddings = model.get_input_embeddings(mx.array(ids), pixels,
                                            mask=mx.ones(ids.shape)).inputs_embeds
    text = model.language_model.model
    full, sliding = gemma_masks(ids[0], model.config.image_token_index,
                                text.config.sliding_window)
    cache = model.language_model.make_cache()
    # Gemma3Model's own forward, but each layer with its kind's mask (it takes one for all).
    h = embeddings * mx.array(text.config.hidden_size ** 0.5, mx.bfloat16).astype(
        embeddings.dtype)
    for layer, c in zip(text.layers, cache):
        h = layer(h, sliding if layer.self_attn.is_sliding else full, c)
    logits = model.language_model.lm_head(text.norm(h))
    out: list[int] = []
    assert request.sampling.max_tokens is not None
    while len(out) < request.sampling.max_tokens:
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model.language_model(mx.array([[out[-1]]]), cache=cache).logits
    return out


@pytest.fixture(scope="module")
def reference(vlm: tuple[Any, Any]) -> Reference:
    """mlx-vlm's Gemma under its image masks, greedy: the reference."""
    model, processor = vlm
    return lambda request: masked_generate(model, processor, request)


@pytest.fixture(scope="module")
def vlm_causal(vlm: tuple[Any, Any]) -> Reference:
    """mlx-vlm's Gemma without the image mask, greedy."""
    model, processor = vlm
    return lambda request: causal_generate(model, processor, request)


def test_answers_are_gemmas_alone(replica: ModelReplica, reference: Reference) -> None:
    ours = {r.request_id: tokens(stream_events(replica, r)) for r in requests()}
    assert ours == {r.request_id: reference(r) for r in requests()}
    assert len({tuple(t) for t in ours.values()}) == len(ours)  # images matter


def test_images_batch_with_text_rows(replica: ModelReplica, reference: Reference) -> None:
    assert answers(replica, requests()) == [reference(r) for r in requests()]


def test_the_mask_matters(family: Family, reference: Reference, vlm_causal: Reference) -> None:
    """With the image mask turned off, Orchard answers as mlx-vlm does without it (the
    causal mask everywhere), and the rows with images that the mask changes answer
    otherwise than the reference."""
    rep = replica_with(family, prompt_cache_bytes=0)
    try:
        assert rep._vision is not None  # noqa: SLF001
        rep._vision.bidirectional = False  # noqa: SLF001
        causal = answers(rep, requests())
    finally:
        rep.shutdown()
    assert causal == [vlm_causal(r) for r in requests()]
    masked = [reference(r) for r in requests()]
    changed = [r.request_id for r, c, m in zip(requests(), causal, masked) if c != m]
    assert family.masked_rows <= set(changed)
    assert not {"text", "words"} & set(changed)  # text rows never see the mask


def test_the_prefix_cache_keys_on_the_image(replica: ModelReplica,
                                           reference: Reference) -> None:
    """A second request with the same image reuses the first's KV (the image's, prefilled
    under the mask, and the text's after it) and answers as the reference does."""
    first = stream_events(replica, ask("c1", image("orange", (64, 40))))
    again = stream_events(replica, ask("c2", image("orange", (64, 40))))
    other = stream_events(replica, ask("c3", image("teal", (64, 40))))
    assert tokens(again) == tokens(first) == reference(ask("c", image("orange", (64, 40))))
    prompt = finished(again).usage.prompt_tokens
    assert finished(again).usage.cached_tokens == prompt - 1
    assert finished(other).usage.cached_tokens == 0
    assert tokens(other) != tokens(first)


@pytest.mark.parametrize("step", [3, 20])
def test_chunked_prefill_keeps_each_image_whole(family: Family, step: int,
                                                reference: Reference) -> None:
    """A prefill step shorter than an image (16 tokens), or ending inside one: each image
    is prefilled in one chunk (the one that reaches it), and the answers are the
    reference's. No prefix cache: every prompt is prefilled whole."""
    rep = replica_with(family, prefill_step_size=step, prompt_cache_bytes=0)
    try:
        batched = answers(rep, requests())
    finally:
        rep.shutdown()
    assert batched == [reference(r) for r in requests()]


def test_tokenize_counts_an_images_real_tokens(family: Family, replica: ModelReplica) -> None:
    """`/tokenize` and `count_tokens` see each image's tokens (a 64 x 64 picture's 16; a
    64 x 32 one's 16 for Gemma 3, 10 for Gemma 4, which keeps its aspect), not one
    placeholder."""
    request = ask("count", image("red"), image("blue", (64, 32)))
    ids = asyncio.run(replica.tokenize(request))
    assert isinstance(ids, tuple)
    vision = replica._vision  # noqa: SLF001
    assert vision is not None
    assert ids.count(vision.image_token_id) == 16 + family.tokens_64x32
    assert len(ids) == finished(stream_events(replica, request)).usage.prompt_tokens


def test_a_resumed_stream_goes_on_exactly(replica: ModelReplica) -> None:
    """A stream about two images cut after some tokens and resumed with the ids sent so far
    (`GenerationRequest.resume`): the rest is the uninterrupted stream's."""
    request = ask("whole", image("maroon", (64, 48)), image("navy"), max_tokens=16)
    whole = tokens(stream_events(replica, request))
    for cut in (1, 7, 15):
        resumed = dataclasses.replace(request, request_id=f"resumed-{cut}",
                                      resume=tuple(whole[:cut]))
        assert whole[:cut] + tokens(stream_events(replica, resumed)) == whole, cut


def test_preempted_image_rows_continue_exactly(family: Family) -> None:
    """Preempted rows about images resume by prefill (the image prefix again, under the
    mask) and answer as on an ample budget."""
    assert_preempted_rows_continue_exactly(family.source, "g3", requests())


def test_a_sliding_window_shorter_than_the_prompt(family: Family, tmp_path: Path) -> None:
    """The builtin with a 24-token window (its sliding layer's cache rotates inside these
    prompts, an image's 16 tokens fit): answers are the reference's, whole and in
    chunks; with the mask off, mlx-vlm's without it."""
    from mlx_vlm import load

    copy = tmp_path / f"{family.name}-window"
    shutil.copytree(resolve_source(family.source), copy)
    config = json.loads((copy / "config.json").read_text())
    config["text_config"]["sliding_window"] = 24
    (copy / "config.json").write_text(json.dumps(config))
    model, processor = load(str(copy))
    masked = [masked_generate(model, processor, r) for r in requests()]

    def served(bidirectional: bool = True, **engine: Any) -> list[list[int]]:
        rep = ModelReplica(ReplicaOptions(model_id="g3", source=str(copy),
                                          engine=EngineConfig(**engine)))
        rep.start()
        try:
            assert rep._vision is not None  # noqa: SLF001
            rep._vision.bidirectional = bidirectional  # noqa: SLF001
            return answers(rep, requests())
        finally:
            rep.shutdown()

    assert served() == masked
    assert served(prefill_step_size=3, prompt_cache_bytes=0) == masked
    causal = [causal_generate(model, processor, r) for r in requests()]
    assert served(False, prompt_cache_bytes=0) == causal != masked


def test_images_in_several_turns_and_a_tool_result(family: Family, replica: ModelReplica,
                                                   reference: Reference) -> None:
    """Images in two user turns with text between them: each its own block (the text
    between them causal), as the reference (Gemma 4's: mlx-vlm's own generation, as for
    the other families); and a screenshot in a tool result reaches the model."""
    request = two_turns("g3")
    ours = tokens(stream_events(replica, request))
    assert ours == reference(request)
    if family is GEMMA4:
        assert ours == mlx_vlms_two_turns(family.source)

    def screenshot(color: str) -> list[int]:
        turn = (ChatMessage("user", "Take a screenshot."),
                ChatMessage("assistant", "", tool_calls=()),
                ChatMessage("tool", "screenshot:", images=(ImageAt(11, image(color)),),
                            tool_call_id="call_1", name="screenshot"))
        return tokens(stream_events(replica, GenerationRequest(
            f"tool-{color}", "g3", ChatPrompt(turn),
            SamplingParams(max_tokens=8, temperature=0.0), report_tokens=True)))

    assert screenshot("white") != screenshot("black")


def test_an_image_token_in_the_text_does_not_pass_for_an_image(family: Family,
                                                               replica: ModelReplica) -> None:
    """Gemma 3's template writes `<start_of_image>` per image, Gemma 4's `<|image|>`: the
    same text typed by the client is not an image (the count must match the request's
    images)."""
    events = stream_events(replica, ask("inject", image("red"),
                                        text=f"Look {family.placeholder}"))
    assert len(events) == 1 and isinstance(events[0], Failed), events
    assert events[0].kind is ErrorKind.INVALID_REQUEST
    assert "placed 2 of the request's 1 images" in events[0].message


def test_gemma4s_per_layer_inputs_read_the_pad_token_at_images() -> None:
    """Gemma 4's per-layer inputs at an image's tokens are the pad token's, as mlx-vlm's
    (`replicas.engine.model.gemma4`): looked up at the image token's own id instead, the
    rows with images answer otherwise than the reference, the text rows the same."""
    from mlx_vlm import load

    model, processor = load(str(resolve_source(GEMMA4.source)))
    rep = replica_with(GEMMA4, prompt_cache_bytes=0)
    try:
        text = rep.model.model.language_model.model
        text._image_token = -1  # noqa: SLF001 - no image token is replaced
        unpadded = answers(rep, requests())
    finally:
        rep.shutdown()
    reference = [masked_generate(model, processor, r) for r in requests()]
    changed = {r.request_id for r, u, m in zip(requests(), unpadded, reference) if u != m}
    assert changed and changed <= {"red", "blue", "two"}
