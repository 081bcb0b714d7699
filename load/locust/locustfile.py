"""Locust users that stream from Orchard's OpenAI and Anthropic APIs and time every token.

    locust -f load/locust/locustfile.py --host http://127.0.0.1:8000 [OpenAIChatUser MixedUser ...]

User classes (pick them by name on the command line; all run by default, by weight):
OpenAIChatUser, OpenAICompletionsUser, AnthropicMessagesUser (the chat ones with tool calls,
single, parallel, and a tool result in history), and MixedUser (plain, stop strings,
response_format json_schema/json_object, reasoning with and without a thinking budget,
forced tool choice and a call after reasoning, across both APIs). Their prompts and bodies
are data in load/payloads.json; the stream readers and output checks are in
load/locust/stream_checks.py.

Each request is one Locust "POST" entry named after its payload (its time is the time to
the HTTP status line, which Orchard sends with the first token) that fails on a non-200, a
stream error event, a stream cut short (no finish reason, no usage, no `[DONE]` or
`message_stop`) or an output that breaks the payload's `expect`. Each successful stream then
reports metrics as further request events of that name:

    TTFT      request sent -> first generated output (answer, reasoning or a tool call), ms
    ITL       gap between consecutive output-carrying SSE frames, ms (one sample per gap)
    TPOT      (E2E - TTFT) / (output tokens - 1), ms per token
    E2E       request sent -> end of stream, ms
    TOKENS    output tokens from the response's usage (a count, not ms)
    TOKENS/S  output tokens / E2E for that stream (a rate, not ms)

With --csv, an aggregate (all output tokens / wall time from first request to last end)
is written to <prefix>_summary.json when the test stops.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import requests
import urllib3
from locust import HttpUser, events, task
from locust.argument_parser import LocustArgumentParser
from locust.env import Environment
from locust.exception import StopUser

# Locust puts this file's folder on sys.path while it imports it.
from run_load import loopback_error
from stream_checks import READERS, Stream, check_output

PAYLOADS_PATH = Path(__file__).resolve().parents[1] / "payloads.json"
API_PATHS = {
    "openai_chat": "/v1/chat/completions",
    "openai_completions": "/v1/completions",
    "anthropic_messages": "/v1/messages",
}


@dataclass(frozen=True)
class Payload:
    name: str
    api: str
    weight: float
    body: dict[str, Any]
    expect: dict[str, Any]


@dataclass(frozen=True)
class Settings:
    model: str
    defaults: dict[str, Any]
    workloads: dict[str, list[Payload]]
    max_tokens: int  # 0: each payload's own
    think_time: float
    check_output: bool
    headers: dict[str, str]  # the API key, when the server wants one

    @classmethod
    def from_options(cls, options: argparse.Namespace) -> Settings:
        data = json.loads(Path(options.payloads).read_text(encoding="utf-8"))
        workloads = {
            name: [Payload(p["name"], p["api"], float(p.get("weight", 1)), p["body"], p.get("expect", {}))
                   for p in items]
            for name, items in data["workloads"].items()
        }
        unknown = {p.api for items in workloads.values() for p in items} - set(API_PATHS)
        if unknown:
            raise ValueError(f"{options.payloads}: unknown api {sorted(unknown)}")
        # `Authorization: Bearer` is accepted on the Anthropic routes too.
        headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        return cls(options.model, data.get("defaults", {}), workloads, options.max_tokens,
                   options.think_time, not options.no_output_checks, headers)

    def body(self, payload: Payload) -> dict[str, Any]:
        body = {**self.defaults, **payload.body, "model": self.model, "stream": True}
        if self.max_tokens:
            body["max_tokens"] = self.max_tokens
        if payload.api != "anthropic_messages":
            body["stream_options"] = {"include_usage": True}  # usage is how tokens are counted
        return body


def sse_lines(raw: Any) -> Iterator[str]:
    """Lines of an event stream as the bytes arrive.

    `read1` returns whatever one socket read brings (chunked or not), so a frame never sits
    in a buffer waiting for more bytes, and the time a frame is parsed is its arrival time.
    requests' iter_lines would wait for 512 bytes, or for the end of a non-chunked body.
    """
    pending = b""
    while chunk := raw.read1(65536):
        *complete, pending = (pending + chunk).split(b"\n")
        for line in complete:
            yield line.decode("utf-8").rstrip("\r")
    if pending:
        yield pending.decode("utf-8")


@dataclass
class Totals:
    """Across the run, for the aggregate tokens/s."""

    first_start: float | None = None
    last_end: float | None = None
    output_tokens: int = 0
    completed: int = 0
    failed: int = 0

    def summary(self) -> dict[str, Any]:
        seconds = (self.last_end or 0.0) - (self.first_start or 0.0)
        return {"output_tokens": self.output_tokens, "seconds": seconds,
                "output_tokens_per_s": self.output_tokens / seconds if seconds > 0 else 0.0,
                "completed": self.completed, "failed": self.failed}


_settings: Settings | None = None
TOTALS = Totals()


@events.init_command_line_parser.add_listener
def _options(parser: LocustArgumentParser) -> None:
    parser.add_argument("--model", default="orchard-tiny", env_var="ORCHARD_MODEL",
                        help="model name sent in every request")
    parser.add_argument("--payloads", default=str(PAYLOADS_PATH), help="payloads JSON file")
    parser.add_argument("--max-tokens", type=int, default=0, help="override max_tokens (0: the payload's)")
    parser.add_argument("--think-time", type=float, default=0.0, help="seconds between a user's requests")
    parser.add_argument("--api-key", default="", env_var="ORCHARD_API_KEY", is_secret=True,
                        help="API key for servers that require one (or $ORCHARD_API_KEY)")
    parser.add_argument("--no-output-checks", action="store_true", default=False,
                        help="skip the payloads' `expect` checks (for models other than orchard-tiny)")


@events.init.add_listener
def _init(environment: Environment, **_: Any) -> None:
    global _settings
    refused = loopback_error(environment.host) if environment.host else None
    if refused:
        print(refused, file=sys.stderr)
        raise SystemExit(2)
    assert environment.parsed_options is not None
    _settings = Settings.from_options(environment.parsed_options)


@events.test_stop.add_listener
def _write_summary(environment: Environment, **_: Any) -> None:
    prefix = getattr(environment.parsed_options, "csv_prefix", None)
    if prefix:
        Path(f"{prefix}_summary.json").write_text(json.dumps(TOTALS.summary(), indent=2) + "\n")


def _metric(env: Environment, kind: str, name: str, value: float) -> None:
    env.events.request.fire(request_type=kind, name=name, response_time=value, response_length=0,
                            exception=None, context={})


def _report(env: Environment, name: str, s: Stream, end: float) -> None:
    e2e = end - s.start
    tokens = s.output_tokens or 0
    _metric(env, "E2E", name, e2e * 1e3)
    _metric(env, "TOKENS", name, tokens)
    _metric(env, "TOKENS/S", name, tokens / e2e)
    if s.arrivals:
        ttft = s.arrivals[0] - s.start
        _metric(env, "TTFT", name, ttft * 1e3)
        for before, after in pairwise(s.arrivals):
            _metric(env, "ITL", name, (after - before) * 1e3)
        if tokens > 1:
            _metric(env, "TPOT", name, (e2e - ttft) * 1e3 / (tokens - 1))


class _StreamingUser(HttpUser):
    abstract = True
    workload = ""  # the payloads.json workload this user draws from

    def wait_time(self) -> float:
        return _settings.think_time if _settings else 0.0

    def on_start(self) -> None:
        if loopback_error(self.host or ""):  # the web UI can set a host after init
            raise StopUser()

    @task
    def generate(self) -> None:
        assert _settings is not None
        payloads = _settings.workloads[self.workload]
        payload = random.choices(payloads, weights=[p.weight for p in payloads])[0]
        self.stream_once(_settings, payload)

    def stream_once(self, settings: Settings, payload: Payload) -> None:
        s = Stream(time.perf_counter())
        TOTALS.first_start = TOTALS.first_start or s.start
        with self.client.post(API_PATHS[payload.api], json=settings.body(payload), headers=settings.headers,
                              stream=True, catch_response=True, name=payload.name) as response:
            problem = None
            if response.status_code != 200:
                problem = f"HTTP {response.status_code}: {response.text[:200]}"
            else:
                try:
                    READERS[payload.api](sse_lines(response.raw), s)
                    problem = s.problem() or (check_output(s, payload.expect, payload.body) if settings.check_output else None)
                except (requests.RequestException, urllib3.exceptions.HTTPError, OSError, ValueError,
                        KeyError, TypeError) as exc:
                    problem = f"broken stream: {type(exc).__name__}: {exc}"
            end = time.perf_counter()
            TOTALS.last_end = end
            if problem:
                TOTALS.failed += 1
                response.failure(problem)
                return
            response.success()
        TOTALS.completed += 1
        TOTALS.output_tokens += s.output_tokens or 0
        _report(self.environment, payload.name, s, end)


class OpenAIChatUser(_StreamingUser):
    weight = 3
    workload = "openai_chat"


class OpenAICompletionsUser(_StreamingUser):
    weight = 1
    workload = "openai_completions"


class AnthropicMessagesUser(_StreamingUser):
    weight = 2
    workload = "anthropic_messages"


class MixedUser(_StreamingUser):
    weight = 2
    workload = "mixed"
