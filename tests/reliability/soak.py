"""A bounded overload run against one model pool, and its report.

`concurrency` clients loop for `duration_s` over a mix of both APIs, streaming and not,
some leaving mid-stream on purpose. Each answer is one of: ok (a 200 that ended the
protocol's normal way), refused (503 or 529 with Retry-After), left (the client hung up
after the first delta, by design), failed (anything else), or hung (no answer within the
hang limit). Recovery is the time from the end of the load until every replica's engine is
idle and a fresh request in each protocol succeeds. Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from tests.reliability.cluster import REQUEST_TIMEOUT_S, Pool, auth_headers, wait_idle
from tests.reliability.wire import Reply, anthropic_message, openai_chat, send

# The server ends every request by its deadline; an answer this late means something hung
# (a minute past the deadline: CI's loaded box has stalled for that long).
HANG_S = REQUEST_TIMEOUT_S + 60
SCRIPTS = ("hello", "cities", "haiku", "riddle-nothink")


@dataclass
class SoakReport:
    model: str
    concurrency: int
    capacity: int
    duration_s: float
    sent: int = 0
    ok: int = 0
    refused: int = 0
    left: int = 0
    failed: int = 0
    hung: int = 0
    recovery_s: float | None = None
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # the first few, for the log

    def record_failure(self, what: str) -> None:
        self.failed += 1
        if len(self.failures) < 10:
            self.failures.append(what)

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["statuses"] = {str(k): v for k, v in sorted(self.statuses.items())}
        return data

    def table(self) -> str:
        recovery = "never" if self.recovery_s is None else f"{self.recovery_s:.2f}s"
        lines = [
            f"soak: {self.concurrency} clients for {self.duration_s:.0f}s against "
            f"{self.model} (capacity {self.capacity} admitted at once)",
            f"  sent {self.sent}   ok {self.ok}   refused {self.refused}   left {self.left}   "
            f"failed {self.failed}   hung {self.hung}",
            f"  statuses {dict(sorted(self.statuses.items()))}   recovery {recovery}",
        ]
        lines += [f"  failure: {f}" for f in self.failures]
        return "\n".join(lines)


def _request(rng: random.Random, model: str) -> tuple[str, dict[str, Any], bool]:
    """A random request: (path, body, whether the client hangs up after the first delta)."""
    sid = rng.choice(SCRIPTS)
    max_tokens = rng.randint(8, 48)
    stream = rng.random() < 0.6
    leave = stream and rng.random() < 0.15
    if rng.random() < 0.5:
        return "/v1/messages", anthropic_message(model, stream=stream, max_tokens=max_tokens,
                                                 sid=sid), leave
    return "/v1/chat/completions", openai_chat(model, stream=stream, max_tokens=max_tokens,
                                               sid=sid), leave


async def _leave_early(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Reply:
    async with http.stream("POST", path, json=body) as response:
        text = ""
        async for chunk in response.aiter_text():
            text += chunk
            if "delta" in chunk:
                break  # hang up mid-stream
        return Reply(path, response.status_code, dict(response.headers), text)


def _classify(report: SoakReport, reply: Reply, left: bool) -> None:
    report.statuses[reply.status] += 1
    overload_status = 529 if reply.path == "/v1/messages" else 503
    if reply.status == overload_status and reply.headers.get("retry-after"):
        report.refused += 1
    elif left and reply.status == 200:
        report.left += 1
    elif reply.completed:
        report.ok += 1
    else:
        report.record_failure(f"{reply.path} {reply.status}: {reply.body[-200:]!r}")


async def _client(http: httpx.AsyncClient, report: SoakReport, rng: random.Random,
                  stop_at: float) -> None:
    while time.monotonic() < stop_at:
        path, body, leave = _request(rng, report.model)
        report.sent += 1
        try:
            attempt = _leave_early(http, path, body) if leave else send(http, path, body)
            reply = await asyncio.wait_for(attempt, HANG_S)
        except asyncio.TimeoutError:
            report.hung += 1
            continue
        except httpx.HTTPError as exc:
            report.record_failure(f"{path}: {type(exc).__name__}")
            continue
        _classify(report, reply, leave)
        if reply.status != 200:
            await asyncio.sleep(rng.uniform(0.05, 0.2))  # a client backing off, briefly


async def _recover(http: httpx.AsyncClient, pool: Pool, limit_s: float) -> float | None:
    start = time.monotonic()
    try:
        await wait_idle(pool, timeout_s=limit_s)
        for path, body in (("/v1/chat/completions", openai_chat(pool.model, stream=False)),
                           ("/v1/messages", anthropic_message(pool.model, stream=False))):
            while not (await send(http, path, body)).completed:
                if time.monotonic() - start > limit_s:
                    return None
                await asyncio.sleep(0.1)
    except TimeoutError:
        return None
    return time.monotonic() - start


async def soak(base_url: str, pool: Pool, *, duration_s: float, concurrency: int,
               seed: int = 0, recovery_limit_s: float = 60.0) -> SoakReport:
    report = SoakReport(pool.model, concurrency, pool.capacity, duration_s)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, headers=auth_headers(), timeout=HANG_S,
                                 limits=limits) as http:
        stop_at = time.monotonic() + duration_s
        await asyncio.gather(*(_client(http, report, random.Random(seed * 1000 + i), stop_at)
                               for i in range(concurrency)))
        report.recovery_s = await _recover(http, pool, recovery_limit_s)
    return report
