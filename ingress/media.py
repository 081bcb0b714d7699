"""Non-text content in a request: images for a model that sees, placeholders for the rest.

A model whose card lists `vision` (`ingress.client.VISION`) gets each image part as an
`ImageAt` among its message's text, checked first (`ingress/images.py`). Anything else it
cannot read (every media part on a text-only model; documents, files and audio on any model)
is not refused: that would fail not one turn but the whole conversation, since clients
resend the history on every turn (one screenshot pasted into a Claude Code session). So the
part becomes a short placeholder text that the chat template renders like any other text,
the model answers, and the response names what was left out in `orchard_warnings` and the
`x-orchard-warning` header.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Iterable

from ingress.client import VISION, ModelCard
from ingress.images import ImageReader, ImageSource
from ingress.options import ImageLimits
from replicas.contract import GenerationRequest, ImageAt

# Wire part or block types (OpenAI chat, Anthropic, Responses) -> what the placeholder
# calls them. A type not listed here is not media, and stays the adapter's own 400.
MEDIA_KINDS: Final[dict[str, str]] = {
    "image_url": "image",  # OpenAI chat
    "input_audio": "audio",
    "file": "file",
    "image": "image",  # Anthropic, also inside tool_result
    "document": "document",
    "input_image": "image",  # Responses
    "input_file": "file",
}


# What a model reads, by whether it sees: what the placeholders and warnings say.
_READS = {False: "text only", True: "text and images only"}


def placeholder(kind: str, sees: bool = False) -> str:
    """The text the model reads where a part of `kind` was; `sees`: the model reads images."""
    return f"[{kind} omitted: this model reads {_READS[sees]}]"


@dataclass(frozen=True)
class Content:
    """A message's text and the images among it, each at an offset into `text`. Adapters
    build one per part and join them, so offsets follow the text however it is assembled."""

    text: str = ""
    images: tuple[ImageAt, ...] = ()

    def __bool__(self) -> bool:  # an image alone is content: the message is not empty
        return bool(self.text or self.images)

    @classmethod
    def join(cls, parts: Iterable[Content | str], separator: str = "") -> Content:
        """The parts in order, `separator` between them, their images moved along."""
        texts: list[str] = []
        images: list[ImageAt] = []
        length = 0
        for part in parts:
            if texts:
                texts.append(separator)
                length += len(separator)
            content = Content(part) if isinstance(part, str) else part
            images.extend(ImageAt(length + at.offset, at.image) for at in content.images)
            texts.append(content.text)
            length += len(content.text)
        return cls("".join(texts), tuple(images))


class MediaParts:
    """What one request's media parts become, collected while its adapter converts it:
    images for a model that sees (`images` set), placeholders for what it cannot read."""

    def __init__(self, images: ImageReader | None = None) -> None:
        self._images = images
        self._left_out: list[str] = []  # "<where> (<kind>)", in request order

    @classmethod
    def for_model(cls, card: ModelCard, limits: ImageLimits) -> MediaParts:
        return cls(ImageReader(limits) if VISION in card.capabilities else None)

    def replace(self, part_type: str, where: str,
                source: ImageSource | None = None) -> Content | None:
        """What stands where a part of wire type `part_type` was (`where`: the field path
        the client sent), or None when that type is not media this module handles. An image
        needs its `source` only when the model sees."""
        kind = MEDIA_KINDS.get(part_type)
        if kind is None:
            return None
        if kind == "image" and self._images is not None:
            image = self._images.parse(source or ImageSource(), where)
            return Content("", (ImageAt(0, image),))
        self._left_out.append(f"{where} ({kind})")
        return Content(placeholder(kind, self._images is not None))

    async def resolve(self, request: GenerationRequest) -> GenerationRequest:
        """`request` with its images fetched and checked; a 400 for any that fails.
        Await it before the request goes anywhere."""
        return request if self._images is None else await self._images.resolve(request)

    def warnings(self) -> tuple[str, ...]:
        if not self._left_out:
            return ()
        sees = self._images is not None
        other = "other" if sees else "non-text"
        return (f"this model reads {_READS[sees]}; {other} content was left out and replaced "
                f"by a placeholder: {', '.join(self._left_out)}",)
