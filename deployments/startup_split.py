"""Where the time to a `serve run`'s first answer went: one log line, from the model replica
that gives it, e.g.

    orchard: first answer 14.2s after serve run: ray 3.1s, serve 4.0s, app imports 1.5s,
    builtin 2.9s, replica start 2.4s, load 0.1s, first token 0.2s

Phases, each from the end of the one before:
- ray: `serve run`'s own start (the CLI's imports) and Ray's, to its driver joining Ray;
- serve: Serve's controller and proxy, and the task that builds the app, to its import of
  `deployments.app`;
- app imports: that import, to `build_app`'s call;
- builtin: `build_app` building or checking the built-in models (`replicas.builtin`);
- app build: the rest of `build_app` (shown when over 0.05 s);
- replica start: Serve starting the replica's process and its imports, to its constructor;
- load: the constructor (the model's load);
- first token: the replica ready, to its engine's first token (the first request's
  arrival included).

`build_app` records its marks in Ray's internal key-value store, under each model's id; the
replica reads them back with the driver's start (Ray's job table) when it answers first.
A phase whose mark is missing or belongs to another start is left out, and the total
starts at the earliest mark kept: a replacement replica, long after the build, times its own
start; an app built outside Serve (a test) has no build marks; a driver that joined a
cluster long before the build (`ray start`, then `serve deploy`) is not counted.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from replicas.startup import announce

log = logging.getLogger("orchard.startup")

_KEY = "orchard:startup:{model}"
_POLL_S = 0.05  # how often the replica looks for its first token; it stops once seen
_SHOWN_FROM_S = 0.05  # a minor phase (app build) below this is left out of the line
_FRESH_S = 300.0  # marks older than this at the next step are another start's


@dataclass
class BuildMarks:
    """Wall-clock times (`time.time()`) of `build_app`'s steps, in the build task."""

    imported: float  # deployments.app's import began
    called: float = field(default_factory=time.time)
    builtin_s: float = 0.0  # building/checking the built-in models
    built: float = 0.0

    def save(self, model_ids: list[str]) -> None:
        """Into Ray's internal KV, one entry per model, when this runs inside Ray."""
        self.built = time.time()
        store = _internal_kv()
        if store is None:
            return
        put, _ = store
        text = json.dumps(self.__dict__).encode()
        for model in model_ids:
            put(_KEY.format(model=model), text)


def _internal_kv() -> tuple[Callable[..., object], Callable[..., object]] | None:
    import ray
    from ray.experimental import internal_kv

    if not ray.is_initialized() or not internal_kv._internal_kv_initialized():
        return None
    return internal_kv._internal_kv_put, internal_kv._internal_kv_get


def _build_marks(model: str) -> dict[str, float] | None:
    store = _internal_kv()
    if store is None:
        return None
    _, get = store
    raw = get(_KEY.format(model=model))
    return json.loads(raw) if isinstance(raw, bytes) else None


def _driver_marks() -> tuple[float, float] | None:
    """(`serve run`'s process start, its joining Ray): the job that started this replica's
    controller, when its driver runs on this machine; else None."""
    import ray
    from ray._private import state

    job = ray.get_runtime_context().get_job_id()
    for entry in state.jobs():
        if entry["JobID"] != job:
            continue
        import psutil  # type: ignore[import-untyped]  # Ray's own, on its path once imported

        try:
            started = psutil.Process(entry["DriverPid"]).create_time()
        except (psutil.Error, ValueError):
            return None
        joined = entry["StartTime"] / 1000
        # A reused pid, or a driver that joined a cluster someone else started long before.
        return (started, joined) if 0 <= joined - started < 600 else None
    return None


def fresh_marks(constructed: float, build: Mapping[str, float] | None,
                driver: Callable[[], tuple[float, float] | None]) -> dict[str, float]:
    """The build's and the driver's marks that belong to this replica's start: the build
    just before it (not a replacement replica's, long after), the driver just before that."""
    if build is None or not 0 <= constructed - build["built"] < _FRESH_S:
        return {}
    marks = dict(build)
    joined = driver()
    if joined is not None and 0 <= build["imported"] - joined[1] < _FRESH_S:
        marks["serve_run"], marks["ray_joined"] = joined
    return marks


def split_line(marks: Mapping[str, float]) -> str:
    """The log line from the marks present (keys: serve_run, ray_joined, imported, called,
    builtin_s, built, constructed, ready, first_token)."""
    steps: list[tuple[str, float]] = []
    order = ("serve_run", "ray_joined", "imported", "called")
    names = {"ray_joined": "ray", "imported": "serve", "called": "app imports"}
    present = [k for k in order if k in marks]
    for before, after in zip(present, present[1:]):
        steps.append((names[after], marks[after] - marks[before]))
    if "called" in marks and "built" in marks:
        builtin = marks.get("builtin_s", 0.0)
        steps.append(("builtin", builtin))
        steps.append(("app build", marks["built"] - marks["called"] - builtin))
    if "built" in marks:
        steps.append(("replica start", marks["constructed"] - marks["built"]))
    elif present:  # a driver's marks without the build's: not kept (`fresh_marks`)
        steps.append(("replica start", marks["constructed"] - marks[present[-1]]))
    steps.append(("load", marks["ready"] - marks["constructed"]))
    steps.append(("first token", marks["first_token"] - marks["ready"]))
    first = next(marks[k] for k in (*order, "built", "constructed") if k in marks)
    since = "serve run" if "serve_run" in marks else \
        "Ray's start" if "ray_joined" in marks else "the app's build" \
        if "imported" in marks else "the replica's start"
    shown = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in steps
                      if name != "app build" or seconds >= _SHOWN_FROM_S)
    return f"first answer {marks['first_token'] - first:.1f}s after {since}: {shown}"


def watch_first_token(model: str, constructed: float, answered: Callable[[], bool],
                      stopped: threading.Event) -> threading.Thread:
    """Once `answered()` (the engine has emitted a token), log the split (`split_line`);
    polls every `_POLL_S` from a daemon thread until then or until `stopped` is set."""
    ready = time.time()

    def watch() -> None:
        while not answered():
            if stopped.wait(_POLL_S):
                return
        marks: dict[str, float] = {"constructed": constructed, "ready": ready,
                                   "first_token": time.time()}
        try:
            marks.update(fresh_marks(constructed, _build_marks(model), _driver_marks))
        except Exception:  # noqa: BLE001 (a log line is never worth failing a replica)
            log.debug("startup marks unavailable", exc_info=True)
        announce(f"{model}: {split_line(marks)}")

    thread = threading.Thread(target=watch, name="orchard-first-answer", daemon=True)
    thread.start()
    return thread
