"""The agent model's training set, from the requests recorded during the capture runs.

Per task: the first turn (the user's prompt, tools offered) must produce the tool call in
the model's Hermes syntax, the second (the tool's result sent back) the final answer.

Codex's `exec_command` result starts with a random chunk id and the measured wall time
(`Chunk ID: 5f0c2a` / `Wall time: 0.1107 seconds`), so that turn's prompt changes on every
run. Its recorded request is used as a template: the model is trained on `TRAIN_VARIANTS`
copies with other seeded random values there, and must also answer `HELD_OUT_VARIANTS`
copies it never saw. The recorded values themselves are not used, so the training set (and
the cached model's key) is the same on every run.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Sequence

from replicas.contract import ChatMessage, ChatPrompt, GenerationRequest

from .agent_model import Turn, hermes_call
from .capture import Recorded
from .tasks import CLAUDE_TASK, CODEX_TASK, TASKS, AgentTask

CODEX_TIMING = re.compile(r"Chunk ID: [0-9a-f]+\nWall time: \d+\.\d+ seconds\n")
TRAIN_VARIANTS = 8
HELD_OUT_VARIANTS = 6
SEED = 15


class CaptureError(AssertionError):
    """The capture runs did not produce the two turns a task needs."""


def chat_messages(request: GenerationRequest) -> tuple[ChatMessage, ...]:
    assert isinstance(request.prompt, ChatPrompt), request.prompt
    return request.prompt.messages


def task_turns(task: AgentTask, recorded: Sequence[Recorded]) -> tuple[GenerationRequest, ...]:
    """The task's recorded requests; exactly two are expected: the call, then the answer."""
    mine = [r for r in recorded if r.task == task]
    if [r.called_tool for r in mine] != [True, False]:
        raise CaptureError(
            f"{task.name}: expected one request answered with the {task.tool} call and then "
            f"one with the tool's result, got {[r.called_tool for r in mine]}")
    return tuple(r.request for r in mine)


def training_set(recorded: Sequence[Recorded]) -> tuple[list[Turn], list[Turn]]:
    """(turns to train on, held-out turns the model must also get right)."""
    train: list[Turn] = []
    held_out: list[Turn] = []
    for task in TASKS:
        call, answer = task_turns(task, recorded)
        train.append(Turn(f"{task.name}-call", call, hermes_call(task.tool, task.arguments)))
        if task is CODEX_TASK:
            rng = random.Random(SEED)
            variants = [_codex_variant(answer, rng) for _ in range(
                TRAIN_VARIANTS + HELD_OUT_VARIANTS)]
            train += [Turn(f"codex-answer-{i}", r, task.answer)
                      for i, r in enumerate(variants[:TRAIN_VARIANTS])]
            held_out += [Turn(f"codex-answer-held-out-{i}", r, task.answer)
                         for i, r in enumerate(variants[TRAIN_VARIANTS:])]
        else:
            assert task is CLAUDE_TASK
            train.append(Turn(f"{task.name}-answer", answer, task.answer))
    return train, held_out


def _codex_variant(request: GenerationRequest, rng: random.Random) -> GenerationRequest:
    *earlier, result = chat_messages(request)
    if len(CODEX_TIMING.findall(result.content)) != 1:
        raise CaptureError(
            "Codex's exec_command result no longer starts with the chunk id and wall time "
            f"this suite varies; the result was:\n{result.content}")
    timing = f"Chunk ID: {rng.randrange(16**6):06x}\nWall time: {rng.uniform(0, 3):.4f} seconds\n"
    content = CODEX_TIMING.sub(timing, result.content)
    messages = (*earlier, dataclasses.replace(result, content=content))
    return dataclasses.replace(request, prompt=ChatPrompt(messages))
