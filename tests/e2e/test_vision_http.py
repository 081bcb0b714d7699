"""Images over a real `serve run` on loopback, through the official `openai` and `anthropic`
SDKs: `builtin:vision` (a mistral3 checkpoint, seen as a VLM from its config) and
`builtin:vision-qwen25` (Qwen2.5-VL's layout, M-RoPE) and `builtin:vision-gemma3` (Gemma 3's,
its images attending both ways) next to the chat model `builtin:tiny`
(text only), several models so the two-hop layout (the Ray handle client) carries the images.

Random weights make the words meaningless, but the answer follows the image: two images
give two greedy answers, and the same image gives the same answer in every API, streamed
or not, alone or batched with text requests. The replica-level tests
(tests/integration/test_vision.py, test_vision_qwen.py, test_vision_gemma.py) hold the answers
to mlx-vlm's own generation.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest
from PIL import Image

from tests.images import b64, data_url, truncated_png
from tests.observability.test_observability_http import App

pytestmark = pytest.mark.e2e

VISION, TEXT = "orchard-vision", "orchard-tiny"
QWEN = "orchard-vision-qwen"  # Qwen2.5-VL's layout: M-RoPE (test_vision_qwen.py)
GEMMA = "orchard-vision-gemma"  # Gemma 3's: bidirectional image attention (test_vision_gemma.py)
MODELS = [{"id": VISION, "source": "builtin:vision", "max_ongoing_requests": 16},
          {"id": QWEN, "source": "builtin:vision-qwen25", "max_ongoing_requests": 16},
          {"id": GEMMA, "source": "builtin:vision-gemma3", "max_ongoing_requests": 16},
          {"id": TEXT, "source": "builtin:tiny", "max_ongoing_requests": 16}]
MAX_IMAGES = 3
QUESTION = "What is in this picture?"
TOKENS = 12
# Greedy: the anthropic SDK pinned here takes no `temperature` argument of its own.
GREEDY = {"temperature": 0}


def picture(color: str, size: tuple[int, int] = (48, 40)) -> bytes:
    import io

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def base_url(shared_app: App) -> str:
    """MODELS, with `images.max_count: MAX_IMAGES`, served with the other modules' extra
    models by one app (conftest)."""
    return shared_app.serve.base_url


@pytest.fixture(scope="module")
def oa(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def an(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def chat_content(*images: bytes, text: str = QUESTION) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text}] + [
        {"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]


def chat(oa: openai.OpenAI, *images: bytes, model: str = VISION, text: str = QUESTION,
         **extra: Any) -> str:
    r = oa.chat.completions.create(model=model, max_tokens=TOKENS, temperature=0,
                                   messages=[{"role": "user",
                                              "content": chat_content(*images, text=text)}],
                                   **extra)
    return r.choices[0].message.content or ""


def test_models_say_which_sees(oa: openai.OpenAI) -> None:
    listed = {m.id: m.model_dump() for m in oa.models.list().data}
    assert "vision" in listed[VISION]["capabilities"]
    assert "vision" in listed[QWEN]["capabilities"]
    assert "vision" in listed[GEMMA]["capabilities"]
    assert "vision" not in listed[TEXT]["capabilities"]
    assert "vision" in oa.models.retrieve(VISION).model_dump()["capabilities"]


def test_the_answer_follows_the_image_streamed_or_not(oa: openai.OpenAI) -> None:
    red, blue = chat(oa, picture("red")), chat(oa, picture("blue"))
    assert red and blue and red != blue
    stream = oa.chat.completions.create(
        model=VISION, max_tokens=TOKENS, temperature=0, stream=True,
        messages=[{"role": "user", "content": chat_content(picture("red"))}])
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == red


def image_block(image: bytes) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": b64(image)}}


@pytest.mark.parametrize("model", [VISION, QWEN, GEMMA])
def test_every_api_sees_the_same_image(oa: openai.OpenAI, an: anthropic.Anthropic,
                                       model: str) -> None:
    image = picture("green")
    expected = chat(oa, image, model=model)
    # Anthropic's thinking is off unless asked for; chat's reasoning_effort "none" matches.
    unthinking = chat(oa, image, model=model, reasoning_effort="none")
    messages: Any = [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                                  image_block(image)]}]
    message = an.messages.create(model=model, max_tokens=TOKENS, extra_body=GREEDY,
                                 messages=messages)
    assert "".join(b.text for b in message.content if b.type == "text") == unthinking
    with an.messages.stream(model=model, max_tokens=TOKENS, extra_body=GREEDY,
                            messages=messages) as stream:
        assert "".join(stream.text_stream) == unthinking
    response = oa.responses.create(model=model, max_output_tokens=TOKENS, temperature=0,
                                   input=[{"role": "user", "content": [
                                       {"type": "input_text", "text": QUESTION},
                                       {"type": "input_image", "image_url": data_url(image),
                                        "detail": "auto"}]}])
    assert response.output_text == expected


@pytest.mark.parametrize("model", [VISION, QWEN, GEMMA])
def test_an_image_in_a_tool_result_reaches_the_model(an: anthropic.Anthropic,
                                                     model: str) -> None:
    def turn(color: str) -> str:
        messages: Any = [
            {"role": "user", "content": "Take a screenshot."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                               "name": "screenshot", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [image_block(picture(color))]}]}]
        message = an.messages.create(
            model=model, max_tokens=TOKENS, extra_body=GREEDY, messages=messages,
            tools=[{"name": "screenshot", "description": "Take a screenshot.",
                    "input_schema": {"type": "object", "properties": {}}}])
        return "".join(b.text for b in message.content if b.type == "text")

    assert turn("white") != turn("black")


def test_images_batch_with_text_requests(oa: openai.OpenAI) -> None:
    asks: list[tuple[tuple[bytes, ...], str]] = [
        ((picture("red"),), VISION), ((), VISION), ((picture("blue"), picture("yellow")), VISION),
        ((), TEXT), ((picture("purple", (64, 24)),), VISION)]
    alone = [chat(oa, *images, model=model) for images, model in asks]
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(lambda a: chat(oa, *a[0], model=a[1]), asks * 2))
    assert together == alone * 2


def test_bad_images_are_400s_and_the_server_keeps_serving(
        oa: openai.OpenAI, an: anthropic.Anthropic) -> None:
    with pytest.raises(openai.BadRequestError, match="corrupt or truncated"):
        chat(oa, truncated_png())
    with pytest.raises(openai.BadRequestError, match=f"at most {MAX_IMAGES} images"):
        chat(oa, *[picture(c) for c in ("red", "green", "blue", "white")])
    with pytest.raises(openai.BadRequestError, match="does not fetch image URLs"):
        oa.chat.completions.create(model=VISION, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {
                "url": "http://127.0.0.1:9/cat.png"}}]}])
    with pytest.raises(anthropic.BadRequestError) as error:
        an.messages.create(model=VISION, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/bmp",
                                         "data": b64(b"BM not really")}}]}])
    assert error.value.body["type"] == "error"  # type: ignore[index]
    assert "image/bmp" in str(error.value)
    assert chat(oa, picture("red"))  # still serving


def test_a_text_model_reads_a_placeholder(base_url: str) -> None:
    response = httpx.post(f"{base_url}/v1/chat/completions", timeout=120, json={
        "model": TEXT, "max_tokens": 4, "messages": [
            {"role": "user", "content": chat_content(picture("red"))}]})
    assert response.status_code == 200
    assert "reads text only" in response.headers["x-orchard-warning"]
