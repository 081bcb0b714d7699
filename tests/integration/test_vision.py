"""A model that sees (`builtin:vision`, a mistral3), in a replica in-process: its answers
are mlx-vlm's own, they depend on the image, and the text path's features hold with images.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest
from PIL import Image

from replicas.contract import (
    ChatMessage,
    ChatPrompt,
    ErrorKind,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    GuidedSpec,
    ImageAt,
    ImageData,
    OutputEvent,
    SamplingParams,
    StopSpec,
    TextDelta,
    TokenIds,
    ToolCallStart,
    ToolChoice,
    ToolSpec,
)
from replicas.engine.config import EngineConfig
from replicas.replica import ModelReplica, ReplicaOptions
from replicas.sources import resolve_source
from tests.streams import collect, stream_events
from tests.vision_requests import QUESTION, ask, finished, tokens


def image(color: str, size: tuple[int, int] = (48, 40), kind: str = "PNG") -> ImageData:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, kind)
    return ImageData(buffer.getvalue(), f"image/{kind.lower()}")


def refused(events: list[OutputEvent], says: str) -> None:
    """The request's one event: the client's error (a 400 at the edge), naming `says`."""
    assert len(events) == 1 and isinstance(events[0], Failed), events
    assert events[0].kind is ErrorKind.INVALID_REQUEST and says in events[0].message, events


@pytest.fixture(scope="module")
def replica() -> Iterator[ModelReplica]:
    rep = ModelReplica(ReplicaOptions(model_id="vision", source="builtin:vision"))
    rep.start()
    assert rep.sees
    yield rep
    rep.shutdown()


def mlx_vlm_tokens(color: str, max_tokens: int) -> list[int]:
    """mlx-vlm's own greedy generation for the same prompt and image: the reference."""
    from mlx_vlm import load, stream_generate

    model, processor = load(str(resolve_source("builtin:vision")))
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                             {"type": "image"}]}]
    prompt = processor.tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=True)
    picture = Image.open(io.BytesIO(image(color).data))
    # Its last response repeats the last token with the totals: only the first N count.
    return [r.token for r in stream_generate(model, processor, prompt, image=[picture],
                                             max_tokens=max_tokens, temperature=0.0)][:max_tokens]


def test_answers_are_mlx_vlms_and_follow_the_image(replica: ModelReplica) -> None:
    red = tokens(stream_events(replica, ask("red", image("red"), max_tokens=12)))
    blue = tokens(stream_events(replica, ask("blue", image("blue"), max_tokens=12)))
    assert red == mlx_vlm_tokens("red", 12)
    assert blue == mlx_vlm_tokens("blue", 12)
    assert red != blue  # the answer depends on the image


def test_images_batch_with_text_requests(replica: ModelReplica) -> None:
    """Requests with 0, 1 and 2 images, all at once, each as it is alone."""
    requests = [ask("plain", text="Hello there"), ask("one", image("red")),
                ask("two", image("green"), image("blue", (64, 24))),
                ask("jpeg", image("yellow", kind="JPEG")), ask("again", image("red"))]
    alone = [tokens(stream_events(replica, r)) for r in requests]

    async def together() -> list[list[OutputEvent]]:
        return list(await asyncio.gather(*(collect(replica.stream(r)) for r in requests)))

    assert [tokens(events) for events in asyncio.run(together())] == alone
    assert len({tuple(t) for t in alone[:4]}) == 4


def test_the_prefix_cache_keys_on_the_image(replica: ModelReplica) -> None:
    first = stream_events(replica, ask("c1", image("purple")))
    again = stream_events(replica, ask("c2", image("purple")))
    other = stream_events(replica, ask("c3", image("orange")))
    assert tokens(again) == tokens(first)
    prompt = finished(again).usage.prompt_tokens
    assert finished(again).usage.cached_tokens == prompt - 1  # the image's KV, reused
    # The same text with another image: nothing of the image prefix is reused.
    assert finished(other).usage.cached_tokens == 0
    assert tokens(other) != tokens(first)


def test_images_in_several_turns_and_a_tool_result(replica: ModelReplica) -> None:
    history = (
        ChatMessage("user", "Look:", images=(ImageAt(5, image("red")),)),
        ChatMessage("assistant", "I see it."),
        ChatMessage("user", "And now?", images=(ImageAt(0, image("blue")),)),
    )
    request = GenerationRequest("turns", "vision", ChatPrompt(history),
                                SamplingParams(max_tokens=6, temperature=0.0))
    assert finished(stream_events(replica, request)).usage.completion_tokens == 6
    tool_turn = (
        ChatMessage("user", "Take a screenshot."),
        ChatMessage("assistant", "", tool_calls=()),
        ChatMessage("tool", "screenshot:", images=(ImageAt(11, image("white")),),
                    tool_call_id="call_1", name="screenshot"),
    )
    request = GenerationRequest("tool", "vision", ChatPrompt(tool_turn),
                                SamplingParams(max_tokens=6, temperature=0.0))
    assert finished(stream_events(replica, request)).usage.prompt_tokens > 20


def test_guided_json_and_a_forced_tool_call_with_an_image(replica: ModelReplica) -> None:
    guided = stream_events(replica, ask("json", image("red"), max_tokens=60,
                                        guided=GuidedSpec("json_schema", json.dumps({
                                            "type": "object", "properties": {
                                                "color": {"enum": ["red", "blue"]}},
                                            "required": ["color"],
                                            "additionalProperties": False}))))
    text = "".join(e.text for e in guided if isinstance(e, TextDelta))
    assert json.loads(text)["color"] in ("red", "blue")
    tool = ToolSpec("describe", None, json.dumps({
        "type": "object", "properties": {"color": {"enum": ["red"]}}, "required": ["color"],
        "additionalProperties": False}), strict=True)
    called = stream_events(replica, ask("call", image("red"), max_tokens=60, tools=(tool,),
                                        tool_choice=ToolChoice("required", "describe", parallel=False)))
    assert [e.name for e in called if isinstance(e, ToolCallStart)] == ["describe"]


@pytest.mark.parametrize("bad, says", [
    (ImageData(b"\x89PNG\r\n\x1a\n not really", "image/png"), "could not be decoded"),
    (ImageData(b"", "image/png"), "could not be decoded"),
])
def test_a_bad_image_is_the_clients_error(replica: ModelReplica, bad: ImageData,
                                          says: str) -> None:
    refused(stream_events(replica, ask("bad", bad)), says)
    assert tokens(stream_events(replica, ask("after", image("red"))))  # still serving


def test_an_image_token_in_the_text_does_not_pass_for_an_image(replica: ModelReplica) -> None:
    refused(stream_events(replica, ask("inject", image("red"), text="Look [IMG] here")),
            "placed 2 of the request's 1 images")


def test_a_text_model_refuses_images() -> None:
    rep = ModelReplica(ReplicaOptions(model_id="vision", source="builtin:vision", kind="text",
                                      engine=EngineConfig(prompt_cache_bytes=0)))
    rep.start()
    try:
        assert not rep.sees
        refused(stream_events(rep, ask("text-only", image("red"))), "reads text only")
        events = stream_events(rep, ask("words", text="Hello"))
        assert not any(isinstance(e, Failed) for e in events)
    finally:
        rep.shutdown()


def test_kind_vision_on_a_text_model_fails_the_load() -> None:
    rep = ModelReplica(ReplicaOptions(model_id="t", source="builtin:bench", kind="vision"))
    with pytest.raises(Exception, match="images are served only for model types"):
        rep.start()
    rep.shutdown()


def test_an_unsupported_vision_family_is_refused_at_load(tmp_path: Path) -> None:
    """The same checkpoint named a family Orchard does not serve with images (`pixtral`,
    whose language model mlx-lm loads): the load fails naming it, rather than serving it
    as text only by surprise; `kind: text` serves it as text."""
    copy = tmp_path / "pixtral"
    shutil.copytree(resolve_source("builtin:vision"), copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "model_type": "pixtral"}))
    rep = ModelReplica(ReplicaOptions(model_id="other", source=str(copy)))
    with pytest.raises(Exception, match="model type pixtral has a vision tower"):
        rep.start()
    rep.shutdown()
    text = ModelReplica(ReplicaOptions(model_id="other", source=str(copy), kind="text",
                                       engine=EngineConfig(prompt_cache_bytes=0)))
    text.start()
    try:
        assert not text.sees
        assert finished(stream_events(text, ask("words", text="Hello"))).usage \
            .completion_tokens == 10
    finally:
        text.shutdown()


def test_a_vision_tower_failure_fails_its_request_alone(replica: ModelReplica) -> None:
    """The tower raising (mlx-vlm refusing an image it was handed) fails that request with
    an internal error; a text request beside it and the replica go on."""
    vision = replica._vision
    assert vision is not None
    encoder = vision._encoder
    original = encoder.get_input_embeddings

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the tower cannot take this image")

    encoder.get_input_embeddings = broken
    try:
        async def together() -> list[list[OutputEvent]]:
            return list(await asyncio.gather(
                collect(replica.stream(ask("broken", image("teal")))),
                collect(replica.stream(ask("words", text="Hello there")))))

        failed, words = asyncio.run(together())
    finally:
        encoder.get_input_embeddings = original
    assert len(failed) == 1 and isinstance(failed[0], Failed), failed
    assert failed[0].kind is ErrorKind.INTERNAL
    assert finished(words).usage.completion_tokens == 10
    replica.check_health()
    assert tokens(stream_events(replica, ask("after", image("teal"))))


def test_a_stop_string_ends_an_answer_about_an_image(replica: ModelReplica) -> None:
    def text(events: list[OutputEvent]) -> str:
        return "".join(e.text for e in events if isinstance(e, TextDelta))

    whole = text(stream_events(replica, ask("whole", image("navy"), max_tokens=16)))
    # Two characters from the second half, none a replacement for a split byte sequence.
    at = next(i for i in range(len(whole) // 2, len(whole) - 1)
              if "\ufffd" not in whole[i:i + 2])
    stop = whole[at:at + 2]
    events = stream_events(replica, ask("stopped", image("navy"), max_tokens=16,
                                        stop=StopSpec(strings=(stop,))))
    assert text(events) == whole[:whole.index(stop)]
    assert finished(events).reason is FinishReason.STOP_SEQUENCE


def test_an_image_prefix_is_prefilled_between_decode_steps() -> None:
    """With a chunk of 2 tokens the image prefix takes a dozen chunks, one per engine loop:
    a stream already decoding gets a step after each, instead of waiting out the whole
    prefill (the engine's step count while the image request prefills shows it)."""
    rep = ModelReplica(ReplicaOptions(model_id="vision", source="builtin:vision",
                                      engine=EngineConfig(prefill_step_size=2)))
    rep.start()
    try:
        prefix = len(rep._vision.prompt(  # type: ignore[union-attr]
            rep.inputs.render(ask("p", image("olive"))).text, [image("olive")]).embeddings.key)
        never_end = {t: -1e4 for t in rep.model.eos_token_ids}
        decoding = ask("decoding", text="Hello there", max_tokens=2000)
        decoding = dataclasses.replace(decoding, sampling=dataclasses.replace(
            decoding.sampling, logit_bias=never_end))

        async def scenario() -> tuple[int, list[OutputEvent]]:
            running = rep.stream(decoding)
            await anext(running)  # in the batch, decoding
            before = rep.stats().steps
            events = await collect(rep.stream(ask("olive", image("olive"))))
            steps = rep.stats().steps - before
            await running.aclose()
            return steps, events

        steps, events = asyncio.run(scenario())  # first: nothing of the image is cached
        alone = tokens(stream_events(rep, ask("alone", image("olive"))))
    finally:
        rep.shutdown()
    assert tokens(events) == alone  # the same answer, prefilled in chunks beside a stream
    chunks = -(-prefix // 2)
    assert chunks >= 10 and steps >= chunks + len(alone)
