"""The hand-over from the engine thread to a stream: `EventBuffer` wakes its reader only when
the reader waits (or the request ends while it lingers), and `merge_deltas` joins what a
chunk carries without changing what the pieces add up to."""

from __future__ import annotations

import asyncio
import threading

import pytest

from replicas.contract import (
    Channel,
    FinishReason,
    Finished,
    OutputEvent,
    TextDelta,
    ToolCallDelta,
    ToolCallStart,
    Usage,
    merge_deltas,
)
from replicas.engine.delivery import EventBuffer, deliver

ANSWER, REASONING = Channel.ANSWER, Channel.REASONING
END = Finished(FinishReason.LENGTH, Usage(1, 3))


def test_adjacent_deltas_join_and_nothing_else_moves() -> None:
    events: list[OutputEvent] = [
        TextDelta(REASONING, "a"), TextDelta(REASONING, "b"), TextDelta(ANSWER, "c"),
        TextDelta(ANSWER, "d"), ToolCallStart(0, "id", "f"), ToolCallDelta(0, '{"x"'),
        ToolCallDelta(0, ": 1}"), ToolCallDelta(1, "{}"), TextDelta(ANSWER, "e"), END,
    ]
    assert merge_deltas(events) == [
        TextDelta(REASONING, "ab"), TextDelta(ANSWER, "cd"), ToolCallStart(0, "id", "f"),
        ToolCallDelta(0, '{"x": 1}'), ToolCallDelta(1, "{}"), TextDelta(ANSWER, "e"), END,
    ]


@pytest.mark.parametrize("cut", range(7))
def test_merging_any_split_gives_what_merging_the_whole_gives(cut: int) -> None:
    events: list[OutputEvent] = [TextDelta(ANSWER, t) for t in "hello!"] + [END]
    whole = merge_deltas(events)
    assert merge_deltas(merge_deltas(events[:cut]) + merge_deltas(events[cut:])) == whole
    assert whole == [TextDelta(ANSWER, "hello!"), END]


def test_a_put_wakes_only_a_waiting_reader() -> None:
    async def scenario() -> None:
        buffer = EventBuffer(asyncio.get_running_loop())
        assert buffer.put([TextDelta(ANSWER, "a")]) is False  # nobody waits: no wake-up
        assert await buffer.next() == [TextDelta(ANSWER, "a")]  # already there
        reader = asyncio.ensure_future(buffer.next())
        await asyncio.sleep(0)  # the reader now waits
        # From another thread, as the engine does: `deliver` wakes the reader's loop.
        worker = threading.Thread(target=deliver, args=([(buffer, [TextDelta(ANSWER, "b")])],))
        worker.start()
        assert await asyncio.wait_for(reader, 5) == [TextDelta(ANSWER, "b")]
        worker.join()
        assert buffer.put([TextDelta(ANSWER, "c")]) is False  # the reader is gone again

    asyncio.run(scenario())


def test_lingering_gathers_later_steps_without_waking_per_step() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        buffer = EventBuffer(loop)
        buffer.put([TextDelta(ANSWER, "a")])
        reader = asyncio.ensure_future(buffer.next(hold_until=loop.time() + 0.2))
        await asyncio.sleep(0.05)  # the reader lingers
        wakes = [buffer.put([TextDelta(ANSWER, t)]) for t in "bcd"]
        assert wakes == [False, False, False]  # tokens during the linger wake nobody
        assert merge_deltas(await reader) == [TextDelta(ANSWER, "abcd")]

    asyncio.run(scenario())


def test_the_end_cuts_a_linger_short() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        buffer = EventBuffer(loop)
        buffer.put([TextDelta(ANSWER, "a")])
        started = loop.time()
        reader = asyncio.ensure_future(buffer.next(hold_until=started + 30))
        await asyncio.sleep(0.01)
        assert buffer.put([TextDelta(ANSWER, "b"), END]) is True  # the end wakes it
        buffer.wake()
        events = await asyncio.wait_for(reader, 5)
        assert events == [TextDelta(ANSWER, "a"), TextDelta(ANSWER, "b"), END]
        assert loop.time() - started < 5  # not the 30 s linger

    asyncio.run(scenario())


def test_an_end_already_buffered_is_not_held_back() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        buffer = EventBuffer(loop)
        buffer.put([TextDelta(ANSWER, "a"), END])
        events = await asyncio.wait_for(buffer.next(hold_until=loop.time() + 30), 5)
        assert events == [TextDelta(ANSWER, "a"), END]

    asyncio.run(scenario())
