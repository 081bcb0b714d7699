"""A private Ray cluster serving Orchard on 127.0.0.1, for the reliability tests.

The cluster is started by this process (`ray.init(address="local")`), never found by
address, so it cannot be another run's cluster; the tests use the same connection to ask
replicas for their engine stats and to kill one. Three models, all the built-in tiny one,
each sized for what the tests do to it:

- `orchard-solo`: one replica with room to spare, so a stats call is never queued behind
  the generation it observes (disconnects, deadlines, limits).
- `orchard-tight`: one replica admitting one running and one queued request
  (backpressure, a request that leaves while queued).
- `orchard-tiny`: two replicas, one request each, two queued (replica death, the soak).
- `orchard-defaults`: one replica whose config sets a `thinking_budget` and `default_stops`
  (`DEFAULTS_SETTINGS`), so those config-level defaults are tested over HTTP.

A second application, under `/colo`, serves `orchard-colo` with `ingress.colocate`: HTTP
from the model replica itself, admitting one generation at a time.

A third, under `/memory`, serves `orchard-memory` in the default layout (one model on one
replica: colocated, `colocate: auto`): one replica with a KV memory budget of
`MEMORY_BUDGET_TOKENS` tokens and few requests allowed to wait for it (`MEMORY_SETTINGS`),
at the model's own context, so KV admission (not Serve's queue, not the context) is what
refuses (issue 25). Its own application because its deadline is long: a request waiting
for memory on a shared 2-core box may outlast the main app's 5 s and end as a 504.

A fourth, under `/resume`, serves `orchard-pair` (two replicas) and `orchard-single` (one)
with streams that resume on another replica, or the replacement, when theirs dies (issue
32), and a deadline long enough for a replacement to load. The main app turns resuming
off (`resume_attempts: 0`), so its replica-death tests prove the other half: a stream that
cannot resume ends with the protocol's error.
"""

from __future__ import annotations

import asyncio
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import ray
from ray import serve

from deployments.app import build_app
from deployments.serve_options import controller_options
from replicas.builtin import ensure_builtin

PORT = int(os.environ.get("ORCHARD_RELIABILITY_PORT", "8200"))
BASE_URL = f"http://127.0.0.1:{PORT}"
APP = "orchard"
API_KEY = "orchard-reliability-key"
KEYS_ENV = "ORCHARD_API_KEYS"
# Long enough for every admitted request of the soak, far shorter than an endless generation.
REQUEST_TIMEOUT_S = 5.0
# Most models here serve at this context (`max_model_len`, far below the tiny model's
# 32768): a prompt past it is refused before any prefill, and a clamped max_tokens stays short.
CONTEXT_LENGTH = 1024
# A generation that outlives every deadline here on any machine: the tiny model does a few
# hundred tokens a second on a 2-core box, so 1024 tokens could end inside 5 s.
ENDLESS_TOKENS = 30000


@dataclass(frozen=True)
class Pool:
    model: str
    replicas: int
    max_ongoing: int
    max_queued: int
    app: str = APP
    prefix: str = ""  # the application's route prefix
    # The model's own context (32768) where a test needs a generation to outlast a deadline.
    capped: bool = True

    @property
    def capacity(self) -> int:
        """Requests admitted at once: running plus queued."""
        return self.replicas * self.max_ongoing + self.max_queued


SOLO = Pool("orchard-solo", replicas=1, max_ongoing=16, max_queued=16)
TIGHT = Pool("orchard-tight", replicas=1, max_ongoing=1, max_queued=1, capped=False)
TINY = Pool("orchard-tiny", replicas=2, max_ongoing=1, max_queued=2, capped=False)
DEFAULTS = Pool("orchard-defaults", replicas=1, max_ongoing=8, max_queued=8)
# Far below feathers-think's reasoning (144 tokens) and riddle-think's (33); "3." cuts the
# `cities` list after its second entry; "Check:" occurs only in riddle-think's reasoning.
DEFAULTS_SETTINGS: dict[str, Any] = {"thinking_budget": 12, "default_stops": ["3.", "Check:"]}
# The tiny model's KV per token: 2 (K and V) x 2 layers x 2 KV heads x head_dim 32 x 4 bytes
# (float32). test_memory_http.py's 400 checks it: the replica says the budget holds 4096.
TINY_KV_BYTES_PER_TOKEN = 1024
MEMORY_BUDGET_TOKENS = 4096
# Serve admits all 32 of the overload test at once (max_ongoing), so only the KV budget
# holds requests back: about six long requests run, four wait, the rest are refused.
MEMORY_APP = "orchard-memory"
MEMORY_PREFIX = "/memory"
MEMORY = Pool("orchard-memory", replicas=1, max_ongoing=32, max_queued=32, app=MEMORY_APP,
              prefix=MEMORY_PREFIX, capped=False)
MEMORY_SETTINGS: dict[str, Any] = {"memory": {
    "budget_bytes": MEMORY_BUDGET_TOKENS * TINY_KV_BYTES_PER_TOKEN, "max_waiting": 4}}
MEMORY_TIMEOUT_S = 120.0
COLO_APP = "orchard-colo"
COLO_PREFIX = "/colo"
COLO = Pool("orchard-colo", replicas=1, max_ongoing=1, max_queued=-1, app=COLO_APP,
            prefix=COLO_PREFIX)
RESUME_APP = "orchard-resume"
RESUME_PREFIX = "/resume"
PAIR = Pool("orchard-pair", replicas=2, max_ongoing=16, max_queued=16, app=RESUME_APP,
            prefix=RESUME_PREFIX, capped=False)
SINGLE = Pool("orchard-single", replicas=1, max_ongoing=16, max_queued=16, app=RESUME_APP,
              prefix=RESUME_PREFIX, capped=False)
RESUME_TIMEOUT_S = 180.0
# How long a stream may wait for the only replica's replacement: far above the few seconds
# it takes on a quiet box: on a loaded 2-core CI box the default 60 s once ran out.
RESUME_WAIT_S = 150.0


def app_args() -> dict[str, Any]:
    return {
        "api_keys_env": KEYS_ENV,
        "ingress": {"request_timeout_s": REQUEST_TIMEOUT_S, "resume_attempts": 0},
        "models": [
            {"id": p.model, "source": "builtin:tiny", "num_replicas": p.replicas,
             "max_ongoing_requests": p.max_ongoing, "max_queued_requests": p.max_queued,
             "max_model_len": CONTEXT_LENGTH if p.capped else None,
             **(DEFAULTS_SETTINGS if p is DEFAULTS else {})}
            for p in (SOLO, TIGHT, TINY, DEFAULTS)
        ],
    }


def colocated_args() -> dict[str, Any]:
    return {
        "api_keys_env": KEYS_ENV,
        "ingress": {"request_timeout_s": REQUEST_TIMEOUT_S, "colocate": True},
        "models": [{"id": COLO.model, "source": "builtin:tiny",
                    "max_ongoing_requests": COLO.max_ongoing,
                    "max_model_len": CONTEXT_LENGTH}],
    }


def memory_args() -> dict[str, Any]:
    return {
        "api_keys_env": KEYS_ENV,
        "ingress": {"request_timeout_s": MEMORY_TIMEOUT_S},
        "models": [{"id": MEMORY.model, "source": "builtin:tiny",
                    "max_ongoing_requests": MEMORY.max_ongoing,
                    "max_queued_requests": MEMORY.max_queued, **MEMORY_SETTINGS}],
    }


def resume_args() -> dict[str, Any]:
    return {
        "api_keys_env": KEYS_ENV,
        "ingress": {"request_timeout_s": RESUME_TIMEOUT_S, "resume_wait_s": RESUME_WAIT_S},
        "models": [{"id": p.model, "source": "builtin:tiny", "num_replicas": p.replicas,
                    "max_ongoing_requests": p.max_ongoing, "max_queued_requests": p.max_queued,
                    # One session's streams stay on one replica (the one the tests kill).
                    "routing": {"policy": "session", "max_imbalance": 64}}
                   for p in (PAIR, SINGLE)],
    }


@contextmanager
def serve_cluster() -> Iterator[str]:
    """Start the cluster and the app; yield the base URL; tear both down."""
    ensure_builtin("tiny")  # built once here, not by three replicas at once
    previous = os.environ.get(KEYS_ENV)
    os.environ[KEYS_ENV] = API_KEY  # the raylet started next, and so every worker, inherits it
    try:
        ray.init(address="local", include_dashboard=False, num_cpus=4, log_to_driver=False)
    finally:
        if previous is None:
            os.environ.pop(KEYS_ENV, None)
        else:
            os.environ[KEYS_ENV] = previous
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": PORT},
                    controller_options=controller_options())
        serve.run(build_app(app_args()), name=APP, route_prefix="/")
        serve.run(build_app(colocated_args()), name=COLO_APP, route_prefix=COLO_PREFIX)
        serve.run(build_app(memory_args()), name=MEMORY_APP, route_prefix=MEMORY_PREFIX)
        serve.run(build_app(resume_args()), name=RESUME_APP, route_prefix=RESUME_PREFIX)
        yield BASE_URL
    finally:
        serve.shutdown()
        ray.shutdown()


def auth_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


async def engine_stats(model: str, app: str = APP) -> dict[str, Any]:
    """One replica's engine stats (the handle picks the replica; see `replica` in the result)."""
    handle = serve.get_deployment_handle(f"model:{model}", app_name=app)
    stats: dict[str, Any] = await handle.stats.remote()
    return stats


async def all_engine_stats(pool: Pool, timeout_s: float = 30.0) -> dict[str, dict[str, Any]]:
    """Stats from every replica of a pool, keyed by replica, polling until each has answered."""
    seen: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < pool.replicas:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(seen)} of {pool.replicas} replicas answered")
        stats = await engine_stats(pool.model, pool.app)
        seen[stats["replica"]] = stats
    return seen


async def wait_idle(pool: Pool, timeout_s: float = 30.0) -> float:
    """Seconds until every replica of the pool reports no active or waiting request."""
    start = time.monotonic()
    while True:
        stats = await all_engine_stats(pool, timeout_s)
        if all(s["active"] == 0 and s["waiting"] == 0 for s in stats.values()):
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{pool.model} still busy after {timeout_s}s: {stats}")
        await asyncio.sleep(0.05)


def replica_actors(pool: Pool) -> list[str]:
    """Names of the pool's live replica actors (namespace `serve`)."""
    prefix = f"SERVE_REPLICA::{pool.app}#model:{pool.model}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(prefix))


def kill_replica(name: str) -> None:
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
