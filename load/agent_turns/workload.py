"""The agent-turns workload, shared by `load.agent_turns.bench` and its `--suite`,
`--memory` and `--admission` modes: conversations that resend a long system prompt plus
every earlier turn, one turn against an in-process replica, and the per-turn numbers every
report prints.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

from replicas.contract import (
    ChatMessage,
    ChatPrompt,
    Failed,
    Finished,
    GenerationRequest,
    OutputEvent,
    ReasoningSpec,
    SamplingParams,
    TextDelta,
)
from replicas.replica import ModelReplica

_WORDS = ("file", "read", "write", "patch", "test", "error", "line", "function", "class",
          "return", "value", "module", "import", "config", "result", "search", "path",
          "command", "output", "build", "check", "change", "review", "index", "token")


@dataclass
class Turn:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


@dataclass
class TurnLog:
    """Every conversation's turns, as they ran."""

    turns: list[list[Turn]] = field(default_factory=list)  # [turn index][conversation]


def text(rng: random.Random, words: int) -> str:
    return " ".join(f"{rng.choice(_WORDS)}{rng.randrange(100)}" for _ in range(words))


async def one_turn(rep: ModelReplica, rid: str, messages: tuple[ChatMessage, ...],
                   max_tokens: int) -> tuple[Turn, str]:
    request = GenerationRequest(
        request_id=rid, model="bench", prompt=ChatPrompt(messages),
        sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens),
        reasoning=ReasoningSpec(enabled=False))
    start = time.perf_counter()
    ttft = None
    events: list[OutputEvent] = []
    async for batch in rep.stream(request):
        if ttft is None:
            ttft = time.perf_counter() - start
        events.extend(batch)
    end = events[-1]
    if isinstance(end, Failed) or not isinstance(end, Finished) or ttft is None:
        raise RuntimeError(f"turn failed: {end}")
    reply = "".join(e.text for e in events if isinstance(e, TextDelta))
    return Turn(ttft, end.usage.prompt_tokens, end.usage.cached_tokens), reply


async def conversations(rep: ModelReplica, args: argparse.Namespace, salt: str) -> TurnLog:
    rng = random.Random(salt)
    system = ChatMessage("system", f"[{salt}] You are a coding agent. " +
                         text(rng, args.system_words))
    history = [[system] for _ in range(args.conversations)]
    run = TurnLog()
    for t in range(args.turns):
        for conv in history:
            conv.append(ChatMessage("user", text(rng, args.turn_words)))
        results = await asyncio.gather(*(
            one_turn(rep, f"{salt}-{c}-{t}", tuple(conv), args.max_tokens)
            for c, conv in enumerate(history)))
        run.turns.append([turn for turn, _ in results])
        for conv, (_, reply) in zip(history, results):
            conv.append(ChatMessage("assistant", reply))
    return run


def median_ttft(run: TurnLog, t: int) -> float:
    return statistics.median(turn.ttft_s for turn in run.turns[t])

