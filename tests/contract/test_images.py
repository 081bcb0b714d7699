"""Images through all three APIs to a model that sees (`capabilities` has `vision`): each
image part arrives as an `ImageAt` at its offset in the message's text, with its bytes; every
bad image is a 400 in the API's own error shape, naming the part; a text-only model next to it
keeps its placeholders; http(s) URLs are fetched only where the config says so."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from ingress.app import create_app
from ingress.client import ModelCard
from ingress.images import ImageReader, ImageSource
from ingress.media import placeholder
from ingress.options import EdgeOptions, ImageLimits
from ingress.protocol import WARNINGS_FIELD
from replicas.contract import (
    Channel,
    ChatMessage,
    FinishReason,
    Finished,
    ImageAt,
    ImageData,
    TextDelta,
    Usage,
)
from replicas.errors import InvalidRequestError
from tests.fakes import FakeClient
from tests.images import b64, encoded, png, truncated_png

SEES, TEXT_ONLY = "orchard-vision", "orchard-tiny"
SCRIPT = [TextDelta(Channel.ANSWER, "A cat."), Finished(FinishReason.EOS, Usage(9, 3))]
CARDS = (ModelCard(SEES, capabilities=("text", "vision")), ModelCard(TEXT_ONLY))
RED, BLUE = png(4, 3), encoded("JPEG", 5, 5)


def app(**limits: Any) -> tuple[FakeClient, TestClient]:
    fake = FakeClient(SCRIPT, models=CARDS)
    options = EdgeOptions(images=ImageLimits(**limits))
    return fake, TestClient(create_app(fake, options))


@dataclass(frozen=True)
class Api:
    """One wire protocol, as these tests need it: where its chat goes, how it writes an
    image part, text and a user turn, and its error shape."""

    name: str
    path: str
    image: Callable[[bytes | None, str, str | None], dict[str, Any]]  # (data, type, url)
    text: Callable[[str], dict[str, Any]]
    body: Callable[[str, list[dict[str, Any]]], dict[str, Any]]  # (model, user content)
    first_part: str  # where the first part of the user turn is

    def error(self, response: Any) -> tuple[str, str | None]:
        """(message, param) of a 400 in this API's shape."""
        assert response.status_code == 400, response.text
        body = response.json()
        if self.name == "anthropic":
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
            return body["error"]["message"], None
        assert body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"], body["error"]["param"]


def _openai_image(data: bytes | None, media_type: str, url: str | None) -> dict[str, Any]:
    return {"type": "image_url",
            "image_url": {"url": url or f"data:{media_type};base64,{b64(data or b'')}",
                          "detail": "auto"}}


def _anthropic_image(data: bytes | None, media_type: str, url: str | None) -> dict[str, Any]:
    source = {"type": "url", "url": url} if url else {
        "type": "base64", "media_type": media_type, "data": b64(data or b"")}
    return {"type": "image", "source": source}


def _responses_image(data: bytes | None, media_type: str, url: str | None) -> dict[str, Any]:
    return {"type": "input_image",
            "image_url": url or f"data:{media_type};base64,{b64(data or b'')}",
            "detail": "auto"}


OPENAI = Api("openai", "/v1/chat/completions", _openai_image,
             lambda text: {"type": "text", "text": text},
             lambda model, content: {"model": model,
                                     "messages": [{"role": "user", "content": content}]},
             "messages.0.content.0")
ANTHROPIC = Api("anthropic", "/v1/messages", _anthropic_image,
                lambda text: {"type": "text", "text": text},
                lambda model, content: {"model": model, "max_tokens": 16,
                                        "messages": [{"role": "user", "content": content}]},
                "messages.0.content.0")
RESPONSES = Api("responses", "/v1/responses", _responses_image,
                lambda text: {"type": "input_text", "text": text},
                lambda model, content: {"model": model,
                                        "input": [{"role": "user", "content": content}]},
                "input.0.content.0")
APIS = [OPENAI, ANTHROPIC, RESPONSES]


def at(api: Api, position: int) -> str:
    return api.first_part[:-1] + str(position)


@pytest.mark.parametrize("api", APIS, ids=lambda api: api.name)
def test_images_reach_a_model_that_sees_at_their_offsets(api: Api) -> None:
    fake, http = app()
    content = [api.text("Compare "), api.image(RED, "image/png", None), api.text(" with "),
               api.image(BLUE, "image/jpeg", None)]
    response = http.post(api.path, json=api.body(SEES, content))
    assert response.status_code == 200, response.text
    assert WARNINGS_FIELD not in response.json() or not response.json()[WARNINGS_FIELD]
    [message] = fake.requests[0].prompt.messages
    assert message == ChatMessage("user", "Compare  with ", images=(
        ImageAt(8, ImageData(RED, "image/png")), ImageAt(14, ImageData(BLUE, "image/jpeg"))))


@pytest.mark.parametrize("api", APIS, ids=lambda api: api.name)
def test_a_text_only_model_still_reads_placeholders(api: Api) -> None:
    fake, http = app()
    content = [api.text("What is this? "), api.image(RED, "image/png", None)]
    body = http.post(api.path, json=api.body(TEXT_ONLY, content)).json()
    [warning] = body[WARNINGS_FIELD]
    assert warning.startswith("this model reads text only") and f"{at(api, 1)} (image)" in warning
    assert fake.requests[0].prompt.messages == (
        ChatMessage("user", "What is this? " + placeholder("image")),)


def test_openai_tool_results_and_several_messages_keep_their_images() -> None:
    fake, http = app()
    messages = [
        {"role": "system", "content": "Look closely."},
        {"role": "user", "content": [_openai_image(RED, "image/png", None)]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1",
         "content": [{"type": "text", "text": "screen:"}, _openai_image(BLUE, "image/jpeg", None)]},
    ]
    response = http.post(OPENAI.path, json={"model": SEES, "messages": messages, "n": 2})
    assert response.status_code == 200, response.text
    system, user, _, tool = fake.requests[0].prompt.messages
    assert system.images == () and user.images == (ImageAt(0, ImageData(RED, "image/png")),)
    assert (tool.content, tool.images) == ("screen:", (ImageAt(7, ImageData(BLUE, "image/jpeg")),))
    assert fake.requests[1].prompt == fake.requests[0].prompt  # n: 2 reads them once, sends both


def test_anthropic_tool_result_images_and_merged_turns() -> None:
    fake, http = app()
    messages = [
        {"role": "user", "content": [_anthropic_image(RED, "image/png", None)]},
        {"role": "user", "content": "and this one"},  # joins the first: one user turn
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "shot", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
             "content": [_anthropic_image(BLUE, "image/jpeg", None),
                         {"type": "text", "text": "blurry"}]},
            {"type": "text", "text": "Well?"}]},
    ]
    response = http.post(ANTHROPIC.path, json={"model": SEES, "max_tokens": 16,
                                               "messages": messages})
    assert response.status_code == 200, response.text
    user, _, result, question = fake.requests[0].prompt.messages
    assert user == ChatMessage("user", "\n\nand this one",
                               images=(ImageAt(0, ImageData(RED, "image/png")),))
    # The error prefix comes before the image, which moves along.
    assert (result.role, result.content, result.images) == (
        "tool", "Error: blurry", (ImageAt(7, ImageData(BLUE, "image/jpeg")),))
    assert question == ChatMessage("user", "Well?")


def test_responses_images_in_outputs_and_history() -> None:
    fake, http = app()
    first = {"model": SEES, "store": True, "input": [
        {"role": "user", "content": [_responses_image(RED, "image/png", None)]},
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [_responses_image(BLUE, "image/jpeg", None)]}]}
    response = http.post(RESPONSES.path, json=first)
    assert response.status_code == 200, response.text
    user, _, tool = fake.requests[0].prompt.messages
    assert user.images == (ImageAt(0, ImageData(RED, "image/png")),)
    assert tool.images == (ImageAt(0, ImageData(BLUE, "image/jpeg")),)
    # The stored input keeps its images: the next turn's history still shows them.
    second = {"model": SEES, "previous_response_id": response.json()["id"],
              "input": "And now?"}
    assert http.post(RESPONSES.path, json=second).status_code == 200
    assert fake.requests[1].prompt.messages[:3] == fake.requests[0].prompt.messages


def test_responses_file_id_is_a_400_naming_it() -> None:
    _, http = app()
    content = [{"type": "input_image", "file_id": "file-123"}]
    message, param = RESPONSES.error(http.post(RESPONSES.path, json=RESPONSES.body(SEES,
                                                                                   content)))
    assert param == "input.0.content.0.file_id" and "no files API" in message


def _bad(api: Api, data: bytes | None, media_type: str = "image/png",
         url: str | None = None) -> list[dict[str, Any]]:
    return [api.text("See: "), api.image(data, media_type, url)]


# (name, limits, the user content for an API, what the message says)
BAD: list[tuple[str, dict[str, Any], Callable[[Api], list[dict[str, Any]]], str]] = [
    ("corrupt", {}, lambda api: _bad(api, truncated_png()), "corrupt or truncated"),
    ("bmp", {}, lambda api: _bad(api, encoded("BMP"), "image/bmp"),
     "'image/bmp' are not supported"),
    ("text file", {}, lambda api: _bad(api, b"not an image", "image/png"),
     "not an image of a supported type"),
    ("too many", {"max_count": 1},
     lambda api: [api.image(RED, "image/png", None), api.image(RED, "image/png", None)],
     "at most 1 images are allowed per request (ingress.images.max_count)"),
    ("too big", {"max_bytes": len(RED) - 1}, lambda api: _bad(api, RED),
     f"larger than {len(RED) - 1} bytes (ingress.images.max_bytes)"),
    ("too many pixels", {"max_pixels": 11}, lambda api: _bad(api, RED),
     "more than 11 pixels (it is 4x3) (ingress.images.max_pixels)"),
    ("url, fetching off", {}, lambda api: _bad(api, None, url="https://example.com/a.png"),
     "ingress.images.fetch_urls is false"),
    ("other scheme", {"fetch_urls": True},
     lambda api: _bad(api, None, url="file:///etc/passwd"), "not 'file'"),
    ("bad base64", {}, lambda api: [api.text("See: "), _bad_base64(api)],
     "not valid base64"),
]


def _bad_base64(api: Api) -> dict[str, Any]:
    part = api.image(RED, "image/png", None)
    if api is ANTHROPIC:
        part["source"]["data"] = "!!" + part["source"]["data"]
    elif api is OPENAI:
        part["image_url"]["url"] = "data:image/png;base64,!!" + b64(RED)
    else:
        part["image_url"] = "data:image/png;base64,!!" + b64(RED)
    return part


@pytest.mark.parametrize("api", APIS, ids=lambda api: api.name)
@pytest.mark.parametrize(("case", "limits", "content", "says"), BAD, ids=[c[0] for c in BAD])
def test_a_bad_image_is_a_400_in_the_apis_shape(
        api: Api, case: str, limits: dict[str, Any],
        content: Callable[[Api], list[dict[str, Any]]], says: str) -> None:
    fake, http = app(**limits)
    message, param = api.error(http.post(api.path, json=api.body(SEES, content(api))))
    assert says in message and message.startswith(f"{at(api, 1)}: "), message
    if api is not ANTHROPIC:
        assert param == at(api, 1)
    assert fake.requests == []
    # The same request to the text-only model is served, with placeholders.
    assert http.post(api.path, json=api.body(TEXT_ONLY, content(api))).status_code == 200


class _Images(BaseHTTPRequestHandler):
    """Serves RED at /red.png (as application/octet-stream: the bytes say what it is), a 404
    elsewhere, and /slow after a pause."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/slow":
            time.sleep(1.0)
        if self.path not in ("/red.png", "/slow"):
            self.send_error(404)
            return
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(len(RED)))
            self.end_headers()
            self.wfile.write(RED)
        except (BrokenPipeError, ConnectionResetError):
            pass  # /slow: the ingress gave up waiting, as it should

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")  # the local server, whatever the CI's proxy


@pytest.mark.parametrize("api", APIS, ids=lambda api: api.name)
def test_a_url_is_fetched_where_the_config_allows(api: Api, image_server: str) -> None:
    fake, http = app(fetch_urls=True, fetch_private=True)  # the server is on loopback
    content = [api.text("See: "), api.image(None, "", f"{image_server}/red.png")]
    response = http.post(api.path, json=api.body(SEES, content))
    assert response.status_code == 200, response.text
    [message] = fake.requests[0].prompt.messages
    assert message.images == (ImageAt(5, ImageData(RED, "image/png")),)


@pytest.mark.parametrize(("path", "limits", "says"), [
    ("/missing.png", {}, "answered HTTP 404"),
    ("/red.png", {"max_bytes": len(RED) - 1}, "ingress.images.max_bytes"),
    ("/slow", {"fetch_timeout_s": 0.2}, "longer than 0.2 s (ingress.images.fetch_timeout_s)"),
])
def test_a_failed_fetch_is_a_400(image_server: str, path: str, limits: dict[str, Any],
                                 says: str) -> None:
    fake, http = app(fetch_urls=True, fetch_private=True, **limits)
    content = [OPENAI.image(None, "", image_server + path)]
    message, param = OPENAI.error(http.post(OPENAI.path, json=OPENAI.body(SEES, content)))
    assert says in message and param == "messages.0.content.0"
    assert fake.requests == []


def test_an_unreachable_host_is_a_400() -> None:
    _, http = app(fetch_urls=True, fetch_private=True, fetch_timeout_s=2)
    content = [ANTHROPIC.image(None, "", "http://127.0.0.1:9/nothing.png")]  # discard: closed
    message, _ = ANTHROPIC.error(http.post(ANTHROPIC.path, json=ANTHROPIC.body(SEES, content)))
    assert message.startswith("messages.0.content.0: the image URL could not be fetched")



def test_a_private_address_is_not_fetched_unless_allowed(image_server: str) -> None:
    fake, http = app(fetch_urls=True)  # the image server is on loopback
    content = [OPENAI.image(None, "", image_server + "/red.png")]
    message, param = OPENAI.error(http.post(OPENAI.path, json=OPENAI.body(SEES, content)))
    assert "ingress.images.fetch_private is false" in message
    assert param == "messages.0.content.0" and fake.requests == []


def test_a_redirect_to_a_private_address_is_refused() -> None:
    """A public host answering with a redirect to loopback: the hop is checked too."""
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url))
        return httpx.Response(302, headers={"Location": "http://127.0.0.1:9/secret.png"})

    reader = ImageReader(ImageLimits(fetch_urls=True), transport=httpx.MockTransport(answer))
    pending = reader.parse(ImageSource(url="http://93.184.216.34/cat.png"), "messages.0")
    with pytest.raises(InvalidRequestError, match="fetch_private is false"):
        asyncio.run(reader._fetch(pending))
    assert asked == ["http://93.184.216.34/cat.png"]  # the redirect was never followed
