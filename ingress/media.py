"""Non-text content on a text-only model: left out, with a placeholder, and warned about.

Every model Orchard serves reads text only (mlx-lm language models). Refusing an image
would fail not one turn but the whole conversation, since clients resend the history on
every turn (one screenshot pasted into a Claude Code session). So each image, document,
file or audio part becomes a short placeholder text that the chat template renders like
any other text, the model answers, and the response names what was left out in
`orchard_warnings` and the `x-orchard-warning` header.
"""

from __future__ import annotations

from typing import Final

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


def placeholder(kind: str) -> str:
    """The text the model reads where a part of `kind` was."""
    return f"[{kind} omitted: this model reads text only]"


class OmittedMedia:
    """What one request left out, collected while its adapter converts the messages."""

    def __init__(self) -> None:
        self._left_out: list[str] = []  # "<where> (<kind>)", in request order

    def replace(self, part_type: str, where: str) -> str | None:
        """The placeholder for a part of wire type `part_type` at `where` (the field path
        the client sent), or None when that type is not media this module handles."""
        kind = MEDIA_KINDS.get(part_type)
        if kind is None:
            return None
        self._left_out.append(f"{where} ({kind})")
        return placeholder(kind)

    def warnings(self) -> tuple[str, ...]:
        if not self._left_out:
            return ()
        return ("this model reads text only; non-text content was left out and replaced "
                f"by a placeholder: {', '.join(self._left_out)}",)
