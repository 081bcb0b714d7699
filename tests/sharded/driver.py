"""One Ray driver of its own for the sharded tests (not pytest's process, which another test
may have joined to a Ray of its own), started once for the package: it reads the model
deployments' stats and each rank's MLX memory limit on request.

A driver per question cost a Python start, `ray.init` and a router per handle each time
(seconds here, tens of seconds on a loaded two-core box); this one pays them once. Each
request is one JSON line on its stdin, each answer one marked JSON line on its stdout.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tests.cluster.conftest import GCS_PORT, ROOT, LocalCluster

# The answer's line starts with this; anything else on stdout is Ray's, and skipped.
_MARK = "@@orchard-driver "
ANSWER_S = 180.0  # one question, from its line to its answer (a cold router included)

_SCRIPT = """
import json, sys
import ray
from ray import serve
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
MARK = sys.argv[2]
handles = {}

def stats(models):
    found = {}
    for model in models:  # a model id, or a deployment's name (prefill:ID)
        name = model if ":" in model else f"model:{model}"
        if name not in handles:  # a handle follows its deployment's replicas as they change
            handles[name] = serve.get_deployment_handle(name, app_name="orchard")
        found[model] = handles[name].stats.remote().result(timeout_s=60)
    return found

def limits(model):
    # Each rank-1 actor's MLX memory limit, read in the rank's own process.
    named = sorted((a["name"], a["namespace"]) for a in ray.util.list_named_actors(True)
                   if a["name"].startswith(f"orchard-shard:{model}:"))
    return [ray.get(ray.get_actor(n, namespace=ns).memory_limit.remote(), timeout=60)
            for n, ns in named]

for line in sys.stdin:
    number, kind, args = json.loads(line)
    try:
        answer = {"number": number, "ok": stats(args) if kind == "stats" else limits(*args)}
    except Exception as error:  # the test reports it; the driver keeps serving
        answer = {"number": number, "error": f"{type(error).__name__}: {error}"}
    print(MARK + json.dumps(answer, default=str), flush=True)
"""


class Driver:
    def __init__(self, cluster: LocalCluster, log: Path) -> None:
        self._log = log
        with log.open("ab") as err:  # the child keeps its own copy
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _SCRIPT, f"127.0.0.1:{GCS_PORT}", _MARK], cwd=ROOT,
                env=cluster.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                text=True, bufsize=1)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._lock = threading.Lock()
        self._asked = 0

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(_MARK):
                self._lines.put(line[len(_MARK):])
        self._lines.put(None)  # it exited

    def _ask(self, kind: str, args: list[str]) -> Any:
        assert self._proc.stdin is not None
        with self._lock:
            self._asked += 1
            self._proc.stdin.write(json.dumps([self._asked, kind, args]) + "\n")
            self._proc.stdin.flush()
            deadline = time.monotonic() + ANSWER_S
            answer: dict[str, Any] = {}
            # An answer to an earlier question (one that timed out) is not this one's.
            while answer.get("number") != self._asked:
                try:
                    line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    line = None
                assert line is not None, f"the driver did not answer {kind} {args}: " \
                    f"{self._log.read_text(errors='replace')[-3000:]}"
                answer = json.loads(line)
        assert "ok" in answer, f"{kind} {args}: {answer['error']}"
        return answer["ok"]

    def stats(self, *models: str) -> dict[str, Any]:
        """Each model deployment's stats (a model id, or a deployment's name: prefill:ID)."""
        found: dict[str, Any] = self._ask("stats", list(models))
        return found

    def limits(self, model: str) -> list[int]:
        """The MLX memory limit of each rank-1 actor of `model`, read in its own process."""
        found: list[int] = self._ask("limits", [model])
        return found

    def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()  # it leaves its loop and exits
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
