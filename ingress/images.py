"""Images for a model that sees: read from any protocol's image parts, checked against the
configured limits (`ingress.options.ImageLimits`) before any replica time.

Two steps, so the adapters' converters stay synchronous. While a request converts,
`ImageReader.parse` does what is cheap and needs no I/O (the count, base64, the encoded
size, the URL's scheme) and puts a `PendingImage` where the image stands; the route then
awaits `resolve`, which fetches URLs (where config allows) and opens every image with
Pillow off the event loop, and swaps each pending image for a checked `ImageData`. Every
failure is a 400 (`InvalidRequestError`) that names the part, e.g. `messages.0.content.1`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import io
import ipaddress
from dataclasses import dataclass

import httpx
from PIL import Image

from ingress.options import ImageLimits
from replicas.contract import ChatPrompt, GenerationRequest, ImageAt, ImageData
from replicas.errors import InvalidRequestError

# The media types a replica is promised (`replicas.contract.ImageData`) -> Pillow's format.
FORMATS: dict[str, str] = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP",
                           "image/gif": "GIF"}
# Pillow's format -> media type; a phone's JPEG with a depth map opens as MPO, still a JPEG.
_MEDIA_TYPE = {pillow: media_type for media_type, pillow in FORMATS.items()} | {
    "MPO": "image/jpeg"}
# Not registered, but what some encoders write for JPEG.
_ALIASES = {"image/jpg": "image/jpeg"}
# Where the limits are set, for the errors to say.
_CONFIG = "ingress.images"


@dataclass(frozen=True)
class ImageSource:
    """An image part's source in no protocol's terms: what each adapter's wire model reads
    out of its own shape. Building one never fails; `ImageReader.parse` judges it."""

    url: str | None = None  # a `data:` URL, or an http(s) one to fetch
    data: str | None = None  # base64, with `media_type` given beside it (Anthropic's)
    media_type: str | None = None
    file_id: str | None = None  # a files API's id: this server has no files API


@dataclass(frozen=True)
class PendingImage(ImageData):
    """An image as parsed: its bytes and declared type, not yet opened; or a URL not yet
    fetched (`data` empty). `resolve` replaces it; a replica never sees one."""

    where: str = ""
    url: str | None = None


class ImageReader:
    """One request's images: parsed while its adapter converts, then resolved."""

    def __init__(self, limits: ImageLimits,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._limits = limits
        self._transport = transport  # None: the network (tests hand a mock)
        self._pending: list[PendingImage] = []

    def parse(self, source: ImageSource, where: str) -> PendingImage:
        """The image for the part at `where`, counted against `max_count`."""
        limits = self._limits
        if len(self._pending) == limits.max_count:
            raise InvalidRequestError(
                f"{where}: at most {limits.max_count} images are allowed per request "
                f"({_CONFIG}.max_count)", param=where)
        pending = self._parse(source, where)
        self._pending.append(pending)
        return pending

    def _parse(self, source: ImageSource, where: str) -> PendingImage:
        if source.file_id is not None:
            raise InvalidRequestError(
                f"{where}: images by file_id are not supported: this server has no files "
                "API; send the image inline, base64-encoded", param=f"{where}.file_id")
        if source.url is not None:
            scheme = source.url.partition(":")[0].lower()
            if scheme in ("http", "https"):
                self._check_fetching(where)
                return PendingImage(b"", "", where=where, url=source.url)
            if scheme != "data":
                raise InvalidRequestError(
                    f"{where}: an image URL must be a base64 `data:` URL or an http(s) URL, "
                    f"not {scheme[:16]!r}", param=where)
            media_type, data = _data_url(source.url, where)
        elif source.data is not None:
            media_type, data = source.media_type or "", source.data
        else:
            raise InvalidRequestError(f"{where}: the image has no data: send it as base64 "
                                      "(or as a URL)", param=where)
        media_type = _supported(media_type, where)
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError(f"{where}: the image data is not valid base64",
                                      param=where) from None
        self._check_size(len(raw), where)
        return PendingImage(raw, media_type, where=where)

    def _check_fetching(self, where: str) -> None:
        if not self._limits.fetch_urls:
            raise InvalidRequestError(
                f"{where}: this server does not fetch image URLs ({_CONFIG}.fetch_urls is "
                "false); send the image inline, base64-encoded, or have the operator set "
                f"`{_CONFIG}.fetch_urls: true` in the config", param=where)

    def _check_size(self, size: int, where: str) -> None:
        if size > self._limits.max_bytes:
            raise InvalidRequestError(
                f"{where}: the image is larger than {self._limits.max_bytes} bytes "
                f"({_CONFIG}.max_bytes)", param=where)

    async def resolve(self, request: GenerationRequest) -> GenerationRequest:
        """`request` with every pending image fetched where it is a URL, and checked."""
        if not self._pending:
            return request
        checked: dict[ImageData, ImageData] = {}
        for pending in self._pending:  # one at a time: at most `max_count`, mostly inline
            data = pending.data if pending.url is None else await self._fetch(pending)
            # A fetched image is whatever its bytes are: servers' Content-Type is often vague.
            declared = pending.media_type if pending.url is None else None
            checked[pending] = await asyncio.to_thread(check_image, data, declared,
                                                       pending.where, self._limits)
        prompt = request.prompt
        if not isinstance(prompt, ChatPrompt):  # images only come in chat messages
            return request
        messages = tuple(
            dataclasses.replace(message, images=tuple(
                ImageAt(at.offset, checked.get(at.image, at.image)) for at in message.images))
            if message.images else message for message in prompt.messages)
        return dataclasses.replace(request, prompt=dataclasses.replace(prompt,
                                                                       messages=messages))

    async def _body(self, url: str, where: str) -> bytes:
        async def public(request: httpx.Request) -> None:  # every hop, redirects included
            if not self._limits.fetch_private:
                await _check_public(request.url, where)

        async with httpx.AsyncClient(follow_redirects=True, transport=self._transport,
                                     event_hooks={"request": [public]}) as http:
            async with http.stream("GET", url) as response:
                if not response.is_success:
                    raise InvalidRequestError(
                        f"{where}: fetching the image URL answered HTTP "
                        f"{response.status_code}", param=where)
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    self._check_size(len(body), where)
                return bytes(body)

    async def _fetch(self, pending: PendingImage) -> bytes:
        """The URL's body, read no further than `max_bytes` and for no longer than the
        fetch timeout; any failure to get it is the client's 400."""
        where, url = pending.where, pending.url or ""
        timeout = self._limits.fetch_timeout_s
        try:
            # wait_for, not asyncio.timeout: Python 3.10 is still supported.
            return await asyncio.wait_for(self._body(url, where), timeout)
        except asyncio.TimeoutError:
            raise InvalidRequestError(
                f"{where}: fetching the image URL took longer than {timeout} s "
                f"({_CONFIG}.fetch_timeout_s)", param=where) from None
        except httpx.HTTPError as exc:
            raise InvalidRequestError(f"{where}: the image URL could not be fetched: "
                                      f"{type(exc).__name__}: {exc}", param=where) from None


async def _check_public(url: httpx.URL, where: str) -> None:
    """A 400 unless every address `url`'s host resolves to is public. (A name that resolves
    otherwise by the time httpx connects slips past: the check narrows, not closes, that.)"""
    host, port = url.host, url.port or (443 if url.scheme == "https" else 80)
    try:
        found = await asyncio.get_running_loop().getaddrinfo(host, port)
    except OSError:
        return  # the fetch itself fails and says so
    for *_, address in found:
        ip = ipaddress.ip_address(address[0])
        if not ip.is_global or ip.is_multicast:
            raise InvalidRequestError(
                f"{where}: the image URL's host {host} is a loopback, private or link-local "
                f"address, which this server does not fetch ({_CONFIG}.fetch_private is "
                "false)", param=where)


def check_image(data: bytes, declared: str | None, where: str,
                limits: ImageLimits) -> ImageData:
    """`data` as a checked image: one of `FORMATS` (the `declared` one, when given), within
    `max_pixels` by its header, and decodable whole. Blocking: run it off the event loop."""
    try:
        image = Image.open(io.BytesIO(data), formats=list(FORMATS.values()))
    except Image.DecompressionBombError:  # Pillow's own cap, far past any sane max_pixels
        raise _too_many_pixels(where, limits) from None
    except Exception:  # noqa: BLE001 - whatever Pillow raises on client bytes: not an image
        raise InvalidRequestError(
            f"{where}: the data is not an image of a supported type "
            f"({', '.join(FORMATS)})", param=where) from None
    with image:
        media_type = _MEDIA_TYPE[image.format or ""]
        if declared is not None and declared != media_type:
            raise InvalidRequestError(
                f"{where}: the image is declared {declared} but its data is {media_type}",
                param=where)
        width, height = image.size
        if width * height > limits.max_pixels:
            raise _too_many_pixels(where, limits, f"{width}x{height}")
        try:
            image.load()  # checks what the header cannot: the pixel data itself
        except Exception as exc:  # noqa: BLE001 - any decoder failure is a corrupt image
            raise InvalidRequestError(f"{where}: the {image.format} image is corrupt or "
                                      f"truncated ({exc})", param=where) from None
    return ImageData(data, media_type)


def _too_many_pixels(where: str, limits: ImageLimits,
                     size: str | None = None) -> InvalidRequestError:
    has = f" (it is {size})" if size else ""
    return InvalidRequestError(
        f"{where}: the image has more than {limits.max_pixels} pixels{has} "
        f"({_CONFIG}.max_pixels)", param=where)


def _data_url(url: str, where: str) -> tuple[str, str]:
    """(media type, base64 text) of `data:<media type>[;param...];base64,<data>`."""
    header, comma, data = url[len("data:"):].partition(",")
    params = header.split(";")
    if not comma or params[-1].strip().lower() != "base64":
        raise InvalidRequestError(
            f"{where}: a data URL must be base64: data:<media type>;base64,<data>",
            param=where)
    return params[0], data


def _supported(media_type: str, where: str) -> str:
    normal = media_type.strip().lower()
    normal = _ALIASES.get(normal, normal)
    if normal not in FORMATS:
        raise InvalidRequestError(
            f"{where}: images of type {media_type[:64]!r} are not supported; use one of "
            f"{', '.join(FORMATS)}", param=where)
    return normal
