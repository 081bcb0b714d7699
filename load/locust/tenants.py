"""Locust users for two tenants sharing one replica (issue 61): a heavy tenant with many long
streams and a light tenant sending one short request at a time.

    locust -f load/locust/tenants.py --host http://127.0.0.1:8000 --headless --users 49 \\
        --heavy-users 48 --heavy-key $HEAVY --light-key $LIGHT [HeavyTenant LightTenant]

`HeavyTenant` (`--heavy-users` of them, a fixed count): chat streams of `--heavy-tokens`
tokens, asked back to back. `LightTenant` (one): chat streams of `--light-tokens`, the
next as soon as one ends, after `--light-delay` seconds (the heavy streams' warm-up). Both
send `--logit-bias` (a JSON object; the runner bans the model's end tokens, so each stream
runs to its length). Each stream is one POST entry named after its tenant, then request
events of that name: `TTFT` (request sent -> first content, ms) and `TOKENS` (its
completion tokens). `python -m load.locust.run_tenants` runs them against Orchard with
and without fair share.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import gevent
from locust import HttpUser, events, task
from locust.argument_parser import LocustArgumentParser
from locust.env import Environment
from locust.exception import StopUser

# Locust puts this file's folder on sys.path while it imports it.
from run_load import loopback_error

PROMPTS = {"heavy": "Tell me about the ocean.", "light": "Hello!"}


@events.init_command_line_parser.add_listener
def _options(parser: LocustArgumentParser) -> None:
    parser.add_argument("--model", default="orchard-tiny", help="model name sent")
    parser.add_argument("--heavy-users", type=int, default=48,
                        help="the heavy tenant's concurrent streams")
    parser.add_argument("--heavy-tokens", type=int, default=256)
    parser.add_argument("--light-tokens", type=int, default=8)
    parser.add_argument("--light-delay", type=float, default=5.0,
                        help="seconds before the light tenant's first request")
    parser.add_argument("--heavy-key", default="", env_var="ORCHARD_HEAVY_KEY", is_secret=True)
    parser.add_argument("--light-key", default="", env_var="ORCHARD_LIGHT_KEY", is_secret=True)
    parser.add_argument("--logit-bias", default="{}", help="a JSON logit_bias for every request")


@events.init.add_listener
def _init(environment: Environment, **_: Any) -> None:
    refused = loopback_error(environment.host) if environment.host else None
    if refused:
        raise SystemExit(refused)
    assert environment.parsed_options is not None
    HeavyTenant.fixed_count = environment.parsed_options.heavy_users


def content_lines(response: Any) -> Iterator[str]:
    """The SSE lines as they arrive (`iter_content` without a size yields each read)."""
    pending = ""
    for chunk in response.iter_content(chunk_size=None, decode_unicode=True):
        *complete, pending = (pending + chunk).split("\n")
        yield from complete
    if pending:
        yield pending


class _Tenant(HttpUser):
    abstract = True
    tenant = ""

    def on_start(self) -> None:
        if loopback_error(self.host or ""):
            raise StopUser()

    @task
    def stream(self) -> None:
        options = self.environment.parsed_options
        assert options is not None
        key = options.heavy_key if self.tenant == "heavy" else options.light_key
        tokens = options.heavy_tokens if self.tenant == "heavy" else options.light_tokens
        body = {"model": options.model, "max_tokens": tokens, "stream": True,
                "messages": [{"role": "user", "content": PROMPTS[self.tenant]}],
                "stream_options": {"include_usage": True},
                "logit_bias": json.loads(options.logit_bias)}
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        start, first, made = time.perf_counter(), None, 0
        with self.client.post("/v1/chat/completions", json=body, headers=headers, stream=True,
                              catch_response=True, name=self.tenant) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            try:
                for line in content_lines(response):
                    if first is None and '"content":"' in line and '"content":""' not in line:
                        first = time.perf_counter() - start
                    if '"completion_tokens":' in line:
                        made = json.loads(line.removeprefix("data: "))["usage"][
                            "completion_tokens"]
            except (OSError, ValueError, KeyError) as exc:
                response.failure(f"broken stream: {type(exc).__name__}: {exc}")
                return
            if first is None or not made:
                response.failure("no content or no usage in the stream")
                return
            response.success()
        self._metric("TTFT", first * 1000)
        self._metric("TOKENS", made)

    def _metric(self, kind: str, value: float) -> None:
        self.environment.events.request.fire(
            request_type=kind, name=self.tenant, response_time=value, response_length=0,
            exception=None, context={})


class HeavyTenant(_Tenant):
    tenant = "heavy"
    fixed_count = 48  # `--heavy-users` at init


class LightTenant(_Tenant):
    tenant = "light"
    fixed_count = 1

    def on_start(self) -> None:
        super().on_start()
        options = self.environment.parsed_options
        gevent.sleep(options.light_delay if options is not None else 0.0)
