"""RayModelClient's resume policy over fake handles (no Ray instance): what it sends the next
replica when one fails under a stream, and when it gives up (issue 32). The real thing,
kill -9 included, is `tests/reliability/test_stream_resume.py`."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.exceptions import RayActorError

from deployments.model_clients import RayModelClient, ResumePolicy
from ingress.client import ModelCard
from replicas.contract import (
    Channel,
    ErrorKind,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    OutputEvent,
    TextDelta,
    TextPrompt,
    TokenIds,
    TokenLogprob,
    Usage,
)
from tests.fakes import ScriptedCall
from tests.streams import collect

pytestmark = pytest.mark.cluster

REQUEST = GenerationRequest(request_id="r1", model="m", prompt=TextPrompt("hi"))
END = Finished(FinishReason.EOS, Usage(1, 3))
Script = list[list[OutputEvent] | BaseException]


class Handle:
    """Hands out one scripted replica per `stream.remote` call and keeps what was sent."""

    def __init__(self, *replicas: Script) -> None:
        self._replicas = list(replicas)
        self.sent: list[GenerationRequest] = []
        self.stream = self

    def options(self, **_: Any) -> "Handle":
        return self

    def remote(self, request: GenerationRequest) -> ScriptedCall:
        self.sent.append(request)
        # One attempt's stream: the "accepted" marker, then its script.
        return ScriptedCall([[], *self._replicas.pop(0)])


def run(handle: Handle, attempts: int = 4) -> tuple[list[OutputEvent], list[str]]:
    resumed: list[str] = []
    client = RayModelClient([ModelCard("m")], {"m": handle},  # type: ignore[dict-item]
                            replica_wait_s=1.0,
                            resume=ResumePolicy(attempts, wait_s=10.0, backoff_s=0.0),
                            on_resume=resumed.append)
    return asyncio.run(asyncio.wait_for(collect(client.stream(REQUEST)), 10)), resumed


def text(delta: str) -> TextDelta:
    return TextDelta(Channel.ANSWER, delta)


def test_a_dead_replica_s_stream_goes_on_from_what_was_sent() -> None:
    handle = Handle([[TokenIds((5,)), text("a")], [TokenIds((6,)), text("b")],
                     RayActorError()],
                    [[TokenIds((7,)), text("c")], [TokenIds((8,)), END]])
    events, resumed = run(handle)
    assert events == [text("abc"), END]  # one stream, no token ids, nothing twice
    assert [r.report_tokens for r in handle.sent] == [True, True]
    assert [r.resume for r in handle.sent] == [None, (5, 6)]
    assert resumed == ["m"]


def test_a_replica_fault_resumes_and_the_events_before_it_are_kept() -> None:
    lost = Failed(ErrorKind.INTERNAL, "a shard may be lost", replica_fault=True)
    handle = Handle([[TokenIds((5, 6)), text("ab"), lost]], [[TokenIds((7,)), text("c"), END]])
    events, _ = run(handle)
    assert events == [text("abc"), END]
    assert handle.sent[1].resume == (5, 6)


def test_a_request_s_own_failure_is_not_resumed() -> None:
    own = Failed(ErrorKind.INTERNAL, "constraint failed")
    handle = Handle([[TokenIds((5,)), text("a")], [own]])
    events, resumed = run(handle)
    assert events == [text("a"), own] and resumed == [] and len(handle.sent) == 1


def test_before_any_event_the_request_starts_again_from_nothing() -> None:
    handle = Handle([RayActorError()], [[TokenIds((5,)), text("a"), END]])
    events, _ = run(handle)
    assert events == [text("a"), END]
    assert handle.sent[1].resume is None


def test_past_its_attempts_a_stream_ends_with_the_protocol_s_error() -> None:
    handle = Handle([[TokenIds((5,)), text("a")], RayActorError()],
                    [[TokenIds((6,)), text("b")], RayActorError()])
    events, resumed = run(handle, attempts=1)
    assert events[0] == text("ab") and len(events) == 2
    assert isinstance(events[1], Failed) and events[1].kind is ErrorKind.INTERNAL
    assert events[1].message == "the replica serving 'm' failed"
    assert handle.sent[1].resume == (5,) and len(handle.sent) == 2


def test_a_replica_that_refuses_costs_time_not_attempts() -> None:
    """An unhealthy replica Serve has not replaced yet refuses at once; the stream tries
    again, pausing longer each time, until a healthy one takes it."""
    refused: Script = [[Failed(ErrorKind.INTERNAL, "the model is unavailable",
                               replica_fault=True)]]
    handle = Handle([[TokenIds((5,)), text("a")], RayActorError()],
                    *([refused] * 4), [[TokenIds((6,)), text("b"), END]])
    events, resumed = run(handle, attempts=1)
    assert events == [text("ab"), END]
    assert [r.resume for r in handle.sent[1:]] == [(5,)] * 5


def test_a_replica_that_keeps_refusing_ends_the_stream_within_the_wait() -> None:
    refused: Script = [[Failed(ErrorKind.INTERNAL, "the model is unavailable",
                               replica_fault=True)]]
    handle = Handle([[TokenIds((5,)), text("a")], RayActorError()], *([refused] * 50))
    client = RayModelClient([ModelCard("m")], {"m": handle},  # type: ignore[dict-item]
                            replica_wait_s=1.0,
                            resume=ResumePolicy(4, wait_s=0.5, backoff_s=0.05))
    events = asyncio.run(asyncio.wait_for(collect(client.stream(REQUEST)), 10))
    assert events[0] == text("a") and isinstance(events[-1], Failed)
    assert 2 < len(handle.sent) < 50  # it tried again, and gave up at the deadline


def test_a_restart_from_scratch_forgets_the_ids_it_had_sent() -> None:
    """The first replica sends only a token id (a `<think>` marker, say) and dies: nothing
    reached the client, so the next one starts over, and sends that id again. When it too
    dies after some text, the third continues from its ids alone (issue 59: not (9, 9, 5))."""
    handle = Handle([[TokenIds((9,))], RayActorError()],
                    [[TokenIds((9,))], [TokenIds((5,)), text("a")], RayActorError()],
                    [[TokenIds((6,)), text("b"), END]])
    events, _ = run(handle)
    assert events == [text("ab"), END]
    assert [r.resume for r in handle.sent] == [None, None, (9, 5)]


def test_the_logprob_entries_held_at_the_cut_go_to_the_next_replica() -> None:
    """A stop's possible prefix holds the last token's text, and its logprob entry, when the
    replica dies: the next replica is handed that entry, to send with its first text."""
    held = (TokenLogprob("\n", 198, -0.5),)
    handle = Handle([[TokenIds((5,)), text("a")], [TokenIds((198,), held)], RayActorError()],
                    [[TokenIds((6,)), text("\nb"), END]])
    events, _ = run(handle)
    assert events == [text("a\nb"), END]
    assert handle.sent[1].resume == (5, 198) and handle.sent[1].resume_logprobs == held
    assert handle.sent[0].resume_logprobs == ()
