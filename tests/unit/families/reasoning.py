"""Routing a family's reasoning markup through the channel router, whole and split."""

from __future__ import annotations

from collections.abc import Sequence

from replicas.contract import Channel, TextDelta
from replicas.families.registry import get_channel_format
from replicas.pipeline.channels import ChannelRouter
from tests.unit.test_tool_calls import joined, split

R, A = Channel.REASONING, Channel.ANSWER


def route(fmt: str, text: str, chunks: Sequence[str], state: str | None = None
          ) -> list[tuple[Channel, str]]:
    router = ChannelRouter(get_channel_format(fmt), state=state)
    pieces: list[TextDelta] = []
    for chunk in chunks:
        pieces += router.feed(chunk)
    return joined(pieces + router.finish())


def splits_at_every_boundary(fmt: str, text: str, want: list[tuple[Channel, str]]) -> None:
    """`text` routes to `want` whole, cut at every point, and one character per chunk."""
    assert route(fmt, text, [text]) == want
    for cut in range(1, len(text)):
        assert route(fmt, text, split(text, [cut])) == want, cut
    assert route(fmt, text, list(text)) == want
