"""Stored responses survive a restart of `serve run` (issue 32), in every layout.

Each layout's config is the real `serve_config.yaml` on a port of its own. The runs follow
one another over one `ORCHARD_CACHE_DIR`, each in the next layout: default, two-hop,
store-actor, default again. Each run but the last stores a function call (`store: true`,
the official `openai` SDK); each run but the first must still `retrieve` the call the run
before it stored and continue it by `previous_response_id`. So every layout writes a
response that a restarted server reads, and reads one that a stopped server wrote (four
Ray starts for the six of a write and a read per layout). The follow-up's input tokens
equal those of the same history sent written out, so the stored turn really was in the
prompt; the answer is the scripted one.

Layouts: the default (HTTP from the model's replica, the store in it), two-hop with three
models (the issue's report: the store in the one ingress replica), and two ingress
replicas (the store in a Ray actor that both reach).
"""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
import ray  # noqa: F401  (first: Ray puts the psutil it ships on the path)
import psutil  # noqa: E402

from replicas.builtin import ensure_builtin, script
from replicas.builtin.build import default_cache_root
from tests.e2e.test_layouts import family
from tests.e2e.test_responses_http import calls, response_args, round_trip_input
from tests.serve_process import ServeProcess, config_copy, free_port, serve_run

pytestmark = pytest.mark.e2e

APP = "orchard"  # serve_config.yaml's application: the store file is named after it
TINY = {"source": "builtin:tiny", "num_replicas": 1, "max_ongoing_requests": 16}
# layout -> what it changes in the real config's `args`
LAYOUTS: dict[str, dict[str, Any]] = {
    "default": {},
    "two-hop": {"ingress": {"colocate": False},
                "models": [{"id": name, **TINY} for name in
                           ("orchard-tiny", "orchard-tiny-2", "orchard-tiny-3")]},
    "store-actor": {"ingress": {"colocate": False, "num_replicas": 2}},
}
# layout -> how many of Ray's processes (by title) prove it is that layout: who serves HTTP,
# and where the store lives (deployments/responses/store.py names its actor's class).
PROCESSES = {
    "default": {"ServeReplica:orchard:Ingress": 0, "_StoreActor": 0},
    "two-hop": {"ServeReplica:orchard:Ingress": 1, "_StoreActor": 0,
                "ServeReplica:orchard:model:orchard-tiny-3": 1},
    "store-actor": {"ServeReplica:orchard:Ingress": 2, "_StoreActor": 1},
}


def layout_config(tmp: Path, port: int, layout: str) -> Path:
    # Two ingress replicas on one machine are two HTTP servers: Serve's proxy in front of
    # them, as on a cluster, since the replica's own port is one.
    path = config_copy(tmp, port, direct=layout != "store-actor")
    config = yaml.safe_load(path.read_text())
    config["applications"][0]["args"].update(LAYOUTS[layout])
    path.write_text(yaml.safe_dump(config))
    return path


@contextmanager
def orchard(config: Path, port: int, env: dict[str, str],
            log_path: Path) -> Iterator[tuple[openai.OpenAI, ServeProcess]]:
    with serve_run(config, port, log_path, env=env) as serve:
        yield openai.OpenAI(base_url=f"{serve.base_url}/v1", api_key="unused",
                            max_retries=0, timeout=120), serve


def titles(serve: ServeProcess, wanted: dict[str, int],
           timeout_s: float = 60.0) -> dict[str, int]:
    """How many processes under `serve run` carry each title (Ray sets an actor's), once
    they are `wanted` or after `timeout_s`: the other models' replicas may still start."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = dict.fromkeys(wanted, 0)
        for proc in family(serve.proc.pid):
            try:
                line = " ".join(proc.cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            for title in wanted:
                found[title] += line.startswith(f"ray::{title}")
        if found == wanted or time.monotonic() > deadline:
            return found
        time.sleep(1)


def item_input(item: Any) -> dict[str, Any]:
    """An output item as the client sends it back in `input`."""
    data: dict[str, Any] = item.model_dump(mode="json", exclude_none=True)
    return data


def stored_rows(cache: Path) -> int:
    with sqlite3.connect(cache / "responses" / f"{APP}.sqlite3") as db:
        return int(db.execute("SELECT COUNT(*) FROM responses").fetchone()[0])


# The layouts in the order they run: each reads what the one before it stored.
RUNS = ["default", "two-hop", "store-actor", "default"]


def test_a_stored_response_survives_a_restart_in_every_layout(tmp_path: Path) -> None:
    ensure_builtin("tiny")  # built once here, then shared with the private cache below
    cache = tmp_path / "cache"  # the store starts empty: nothing from an earlier run answers
    cache.mkdir()
    (cache / "builtin").symlink_to(default_cache_root(), target_is_directory=True)
    # A Ray of its own (short path: Ray puts Unix sockets under it), whatever else runs here.
    ray_tmp = Path(tempfile.mkdtemp(prefix="ors-", dir="/tmp"))
    env = {"ORCHARD_CACHE_DIR": str(cache), "RAY_TMPDIR": str(ray_tmp)}
    stored: Any = None  # what the run before stored, in its layout
    rows = 0
    try:
        for n, layout in enumerate(RUNS):
            port = free_port()  # each run its own: a port held a minute may be taken meanwhile
            config = layout_config(tmp_path, port, layout)
            with orchard(config, port, env, tmp_path / f"{n}-{layout}.log") as (client, serve):
                assert titles(serve, PROCESSES[layout]) == PROCESSES[layout], layout
                if stored is not None:
                    check_follow_up(client, stored)
                    rows += 1  # the follow-up is stored too
                if n < len(RUNS) - 1:
                    stored = client.responses.create(**response_args("tool-one"))
                    assert stored.store is True, layout
                    assert calls(stored) == list(script("tool-one").expected_calls), layout
                    assert client.responses.retrieve(stored.id).model_dump() == \
                        stored.model_dump()
                    rows += 1
            # In the file, not only in a process now gone.
            assert stored_rows(cache) == rows, layout
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def check_follow_up(client: openai.OpenAI, first: Any) -> None:
    """`first`, stored by a server now gone, is retrieved whole and continued by its id."""
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    # Only the call's output is sent: the question and the call come from the store.
    follow = client.responses.create(**response_args(
        "tool-result", input=round_trip_input(first), previous_response_id=first.id))
    written_out = client.responses.create(**response_args(
        "tool-result", store=False, input=[
            *response_args("tool-one")["input"],
            *(item_input(i) for i in first.output), *round_trip_input(first)]))
    assert follow.previous_response_id == first.id and follow.status == "completed"
    assert follow.output_text == written_out.output_text == script("tool-result").answer
    assert follow.usage is not None and written_out.usage is not None
    assert follow.usage.input_tokens == written_out.usage.input_tokens
