"""Image input below the protocols (`ingress/images.py`, `ingress/media.py`): parsing a part's
source, each limit, Pillow's check of the bytes, resolving a request's pending images, the
offsets text and images keep when joined, and the config that sets the limits."""

from __future__ import annotations

import asyncio
import time

import pytest

from deployments.config import AppArgs
from deployments.ingress_deployment import EdgeArgs
from ingress.client import ModelCard
from ingress.images import ImageReader, ImageSource, PendingImage, check_image
from ingress.media import Content, MediaParts, placeholder
from ingress.options import EdgeOptions, ImageLimits
from replicas.contract import ChatMessage, ChatPrompt, GenerationRequest, ImageAt, ImageData
from replicas.errors import InvalidRequestError
from tests.images import b64, data_url, encoded, header_only_png, png, truncated_png

WHERE = "messages.0.content.1"
LIMITS = ImageLimits()
VISION = ModelCard("v", capabilities=("text", "vision"))


def parse(source: ImageSource, limits: ImageLimits = LIMITS) -> PendingImage:
    return ImageReader(limits).parse(source, WHERE)


def refused(match: str, call: object, *args: object) -> InvalidRequestError:
    assert callable(call)
    with pytest.raises(InvalidRequestError, match=match) as caught:
        call(*args)
    assert caught.value.param is not None and caught.value.param.startswith(WHERE)
    assert WHERE in caught.value.message  # Anthropic's shape has no param: the text names it
    return caught.value


def test_a_data_url_and_a_base64_source_parse_to_bytes_and_type() -> None:
    image = png()
    assert parse(ImageSource(url=data_url(image))) == PendingImage(image, "image/png",
                                                                   where=WHERE)
    # Anthropic's base64 source; `image/jpg` is what some encoders write for JPEG.
    jpeg = encoded("JPEG")
    pending = parse(ImageSource(data=b64(jpeg), media_type="IMAGE/JPG"))
    assert (pending.data, pending.media_type) == (jpeg, "image/jpeg")
    # Parameters before `;base64` are allowed.
    assert parse(ImageSource(url=f"data:image/png;name=a.png;base64,{b64(image)}")).data == image


@pytest.mark.parametrize(("source", "match"), [
    (ImageSource(url="data:image/png;base64,@@not base64@@"), "not valid base64"),
    (ImageSource(data="AAA", media_type="image/png"), "not valid base64"),
    (ImageSource(url="data:image/png,%89PNG"), "must be base64"),
    (ImageSource(url="data:image/bmp;base64,AA=="), "'image/bmp' are not supported"),
    (ImageSource(data="aGk=", media_type="text/plain"), "'text/plain' are not supported"),
    (ImageSource(data="AA=="), "'' are not supported"),
    (ImageSource(url="ftp://host/cat.png"), "not 'ftp'"),
    (ImageSource(url="https://host/cat.png"), "fetch_urls is false.*fetch_urls: true"),
    (ImageSource(file_id="file-1"), "file_id.*no files API"),
    (ImageSource(), "no data"),
])
def test_a_bad_source_is_a_400_naming_the_part(source: ImageSource, match: str) -> None:
    refused(match, parse, source)


def test_a_url_parses_unfetched_only_where_fetching_is_on() -> None:
    pending = parse(ImageSource(url="https://host/cat.png"), ImageLimits(fetch_urls=True))
    assert (pending.url, pending.data) == ("https://host/cat.png", b"")


def test_count_and_size_limits_name_the_setting_and_its_value() -> None:
    reader = ImageReader(ImageLimits(max_count=2))
    for position in range(2):
        reader.parse(ImageSource(url=data_url(png())), f"messages.0.content.{position}")
    error = refused(r"at most 2 images .*\(ingress.images.max_count\)", reader.parse,
                    ImageSource(url=data_url(png())), WHERE)
    assert error.param == WHERE
    big = png(32, 32, noise=True)
    refused(rf"larger than {len(big) - 1} bytes \(ingress.images.max_bytes\)", parse,
            ImageSource(url=data_url(big)), ImageLimits(max_bytes=len(big) - 1))
    assert parse(ImageSource(url=data_url(big)), ImageLimits(max_bytes=len(big))).data == big


@pytest.mark.parametrize(("fmt", "media_type"), [
    ("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif")])
def test_every_supported_type_checks(fmt: str, media_type: str) -> None:
    data = encoded(fmt)
    assert check_image(data, media_type, WHERE, LIMITS) == ImageData(data, media_type)
    assert check_image(data, None, WHERE, LIMITS).media_type == media_type  # as fetched


@pytest.mark.parametrize(("data", "declared", "match"), [
    (truncated_png(), "image/png", "PNG image is corrupt or truncated"),
    (png(64, 64, noise=True)[:300] + bytes(400) + png(64, 64, noise=True)[700:], "image/png",
     "corrupt"),
    (encoded("BMP"), "image/png", "not an image of a supported type"),
    (b"just some text, not an image", "image/png", "not an image of a supported type"),
    (encoded("JPEG"), "image/png", "declared image/png but its data is image/jpeg"),
])
def test_bytes_that_are_not_the_declared_image_are_a_400(data: bytes, declared: str,
                                                          match: str) -> None:
    refused(match, check_image, data, declared, WHERE, LIMITS)


def test_pixels_are_counted_from_the_header_before_decoding() -> None:
    refused(r"more than 100 pixels \(it is 20x10\) \(ingress.images.max_pixels\)",
            check_image, png(20, 10), "image/png", WHERE, ImageLimits(max_pixels=100))
    assert check_image(png(10, 10), "image/png", WHERE, ImageLimits(max_pixels=100))
    # Ten billion pixels claimed in 57 bytes: refused at once, nothing decoded (Pillow's own
    # bomb cap answers before ours here).
    started = time.monotonic()
    refused("more than 50000000 pixels", check_image, header_only_png(100_000, 100_000),
            "image/png", WHERE, LIMITS)
    refused(r"\(it is 10000x8000\)", check_image, header_only_png(10_000, 8_000), "image/png",
            WHERE, LIMITS)
    assert time.monotonic() - started < 10  # decoding them would take minutes, or all memory


def test_content_join_moves_images_with_their_text() -> None:
    image = ImageData(b"x", "image/png")
    first = Content("ab", (ImageAt(0, image), ImageAt(2, image)))
    second = Content("", (ImageAt(0, image),))
    joined = Content.join(["Error: ", first, second, "cd"], "\n\n")
    assert joined.text == "Error: \n\nab\n\n\n\ncd"
    assert [at.offset for at in joined.images] == [9, 11, 13]
    assert not Content() and Content("", (ImageAt(0, image),))  # an image alone is content


def test_resolve_swaps_pending_images_for_checked_ones_in_place() -> None:
    reader = ImageReader(LIMITS)
    first, second = png(4, 4), encoded("GIF")
    one = reader.parse(ImageSource(url=data_url(first)), WHERE)
    two = reader.parse(ImageSource(data=b64(second), media_type="image/gif"), "x")
    messages = (ChatMessage("system", "plain"),
                ChatMessage("user", "ab", images=(ImageAt(1, one),)),
                ChatMessage("tool", "", images=(ImageAt(0, two),), tool_call_id="c", name="t"))
    request = GenerationRequest("r", "v", ChatPrompt(messages))
    resolved = asyncio.run(reader.resolve(request)).prompt
    assert isinstance(resolved, ChatPrompt)
    assert resolved.messages == (
        messages[0],
        ChatMessage("user", "ab", images=(ImageAt(1, ImageData(first, "image/png")),)),
        ChatMessage("tool", "", images=(ImageAt(0, ImageData(second, "image/gif")),),
                    tool_call_id="c", name="t"))
    assert all(type(at.image) is ImageData for m in resolved.messages for at in m.images)


def test_a_corrupt_image_fails_the_resolve_step() -> None:
    reader = ImageReader(LIMITS)
    pending = reader.parse(ImageSource(url=data_url(truncated_png())), WHERE)
    request = GenerationRequest("r", "v", ChatPrompt((
        ChatMessage("user", "", images=(ImageAt(0, pending),)),)))
    with pytest.raises(InvalidRequestError, match="corrupt"):
        asyncio.run(reader.resolve(request))


def test_media_parts_by_model() -> None:
    source = ImageSource(url=data_url(png()))
    text_only = MediaParts.for_model(ModelCard("t"), LIMITS)
    assert text_only.replace("image_url", WHERE, source) == Content(placeholder("image"))
    assert text_only.replace("refusal", WHERE) is None  # not media: the adapter's own 400
    # A text-only model never looks at the image: garbage is still just a placeholder.
    assert text_only.replace("image", WHERE, ImageSource(data="@@")) == Content(
        placeholder("image"))
    assert "this model reads text only" in text_only.warnings()[0]

    sees = MediaParts.for_model(VISION, LIMITS)
    content = sees.replace("image_url", WHERE, source)
    assert content is not None and content.text == "" and len(content.images) == 1
    assert sees.warnings() == ()
    assert sees.replace("document", "messages.0.content.2") == Content(
        "[document omitted: this model reads text and images only]")
    assert sees.warnings() == ("this model reads text and images only; other content was "
                               "left out and replaced by a placeholder: "
                               "messages.0.content.2 (document)",)


def test_the_config_sets_the_limits_with_ingress_options_defaults() -> None:
    model = {"id": "m", "source": "builtin:tiny"}
    defaults = EdgeArgs.from_config(AppArgs.model_validate({"models": [model]}))
    assert defaults.options({}).images == ImageLimits() == EdgeOptions().images
    config = AppArgs.model_validate({"models": [model], "ingress": {"images": {
        "max_count": 2, "max_bytes": 1000, "max_pixels": 10_000, "fetch_urls": True,
        "fetch_timeout_s": 2.5}}})
    assert EdgeArgs.from_config(config).options({}).images == ImageLimits(
        max_count=2, max_bytes=1000, max_pixels=10_000, fetch_urls=True, fetch_timeout_s=2.5)
    with pytest.raises(ValueError, match="max_image"):
        AppArgs.model_validate({"models": [model], "ingress": {"images": {"max_image": 1}}})
