"""The capture server: Orchard's real ingress app on 127.0.0.1 with a scripted, recording
`ModelClient` in place of the model.

A real client run against it goes through the real adapters both ways: the fake answers a
task's first turn with a call to the client's tool (`ToolCallStart/Delta/End`, then
`Finished(TOOL_CALLS)`), the client runs the tool and sends the result back, and the fake
answers that turn with the task's final text. Every `GenerationRequest` the adapters built
is recorded; those are the prompts the agent model is trained on.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn

from ingress.app import create_app
from ingress.client import ModelCard
from replicas.contract import (
    Channel,
    ChatPrompt,
    FinishReason,
    Finished,
    GenerationRequest,
    OutputEvent,
    TextDelta,
    TokenizerInfo,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)

from .tasks import MODEL_ID, TASKS, AgentTask

UNSCRIPTED = "This request is not part of any scripted task."


@dataclass(frozen=True)
class Recorded:
    """One request the adapters built, the task it belongs to (None: unscripted) and
    whether the fake answered it with the tool call (else with the final text)."""

    request: GenerationRequest
    task: AgentTask | None
    called_tool: bool


class RecordingClient:
    """A `ModelClient` that plays the scripted tasks and records every request."""

    def __init__(self, tasks: Sequence[AgentTask] = TASKS) -> None:
        self._tasks = tuple(tasks)
        self._card = ModelCard(MODEL_ID)
        self._lock = threading.Lock()
        self._recorded: list[Recorded] = []

    @property
    def recorded(self) -> list[Recorded]:
        with self._lock:
            return list(self._recorded)

    def models(self) -> Sequence[ModelCard]:
        return (self._card,)

    def resolve(self, model: str) -> ModelCard | None:
        return self._card if model == MODEL_ID else None

    async def stream(self, request: GenerationRequest) -> AsyncIterator[list[OutputEvent]]:
        task = self._task_for(request)
        answered = _has_tool_result(request)
        with self._lock:
            self._recorded.append(Recorded(request, task, task is not None and not answered))
        usage = Usage(prompt_tokens=1, completion_tokens=1)
        if task is None:
            yield [TextDelta(Channel.ANSWER, UNSCRIPTED), Finished(FinishReason.EOS, usage)]
        elif answered:
            yield [TextDelta(Channel.ANSWER, task.answer), Finished(FinishReason.EOS, usage)]
        else:
            arguments = task.arguments_json
            yield [
                ToolCallStart(0, uuid.uuid4().hex[:24], task.tool),
                ToolCallDelta(0, arguments),
                ToolCallEnd(0, arguments),
                Finished(FinishReason.TOOL_CALLS, usage),
            ]

    async def tokenize(self, request: GenerationRequest,
                       add_special_tokens: bool = True) -> tuple[int, ...]:
        return (1,)

    async def detokenize(self, model: str, token_ids: tuple[int, ...]) -> str:
        return ""

    async def tokenizer_info(self, model: str) -> TokenizerInfo:
        raise NotImplementedError("the capture app only records generations")

    def _task_for(self, request: GenerationRequest) -> AgentTask | None:
        offered = {tool.name for tool in request.tools}
        return next((t for t in self._tasks if t.tool in offered), None)


def _has_tool_result(request: GenerationRequest) -> bool:
    prompt = request.prompt
    return isinstance(prompt, ChatPrompt) and bool(prompt.messages) and \
        prompt.messages[-1].role == "tool"


@contextmanager
def capture_server(client: RecordingClient) -> Iterator[str]:
    """Serve `create_app(client)` with uvicorn on a free loopback port; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(client), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the capture server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
