"""The prefix cache's disk tier across restarts of `serve run` (issues 35, 59): the default
config with `prompt_cache.disk_path` set, run over one directory and stopped each way a
user stops it: SIGTERM to `serve run` (systemd, launchd, `docker stop`: Ray's handler
aborts it, and no replica shuts down), SIGINT to it, and Ctrl-C to the process group. Each
next run serves the conversation the last one saw from disk (`cached_tokens` covers the
prompt but its last token) with the same greedy answer. The first conversation's files are
corrupted before the last run: they are dropped with a warning in the log, and that prompt
is simply prefilled again (three Ray starts, one per way of stopping). Each stop ends
`serve run` by itself and leaves nothing it started running; Ctrl-C and SIGINT exit 0.
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import time
from pathlib import Path

import openai
import pytest
import yaml

from replicas.builtin import ensure_builtin
from replicas.builtin.build import default_cache_root
from tests.serve_process import Stop, config_copy, free_port, serve_run

pytestmark = pytest.mark.e2e

# About 2,800 prompt tokens, as the chat the user stopped and restarted.
HISTORY = " ".join(f"Note {n}: the river runs past the old mill where children play."
                   for n in range(80))
OTHER = " ".join(f"Rule {n}: the bakery opens before the market and closes at noon."
                 for n in range(40))


def ask(client: openai.OpenAI, topic: str, system: str = HISTORY) -> tuple[str, int, int]:
    """A greedy answer to a long conversation: (text, prompt tokens, cached tokens)."""
    r = client.chat.completions.create(model="orchard-tiny", max_tokens=16, temperature=0,
                                       messages=[{"role": "system", "content": system},
                                                 {"role": "user", "content": topic}])
    usage = r.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return (r.choices[0].message.content or "", usage.prompt_tokens,
            usage.prompt_tokens_details.cached_tokens or 0)


def test_a_restart_serves_the_conversation_from_disk(tmp_path: Path) -> None:
    ensure_builtin("tiny")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "builtin").symlink_to(default_cache_root(), target_is_directory=True)
    disk = tmp_path / "kv"

    def configured(port: int) -> Path:
        path = config_copy(tmp_path, port)
        config = yaml.safe_load(path.read_text())
        model = config["applications"][0]["args"]["models"][0]
        model["prompt_cache"] = {**model.get("prompt_cache", {}), "disk_path": str(disk)}
        path.write_text(yaml.safe_dump(config))
        return path

    ray_tmp = Path(tempfile.mkdtemp(prefix="ord-", dir="/tmp"))
    env = {"ORCHARD_CACHE_DIR": str(cache), "RAY_TMPDIR": str(ray_tmp)}
    question = "Where do the children play?"

    def run(name: str, stop: Stop, *systems: str) -> list[tuple[str, int, int]]:
        port = free_port()  # each run its own: a port held a minute may be taken meanwhile
        with serve_run(configured(port), port, tmp_path / f"{name}.log", env=env,
                       stop_with=stop) as serve:
            client = openai.OpenAI(base_url=f"{serve.base_url}/v1", api_key="unused",
                                   max_retries=0, timeout=120)
            before = written()
            answers = [ask(client, question, system) for system in systems]
            # Entries are written as requests leave them, in the background: a stop that
            # lets no replica shut down (SIGTERM) keeps what was written by then.
            deadline = time.monotonic() + 30
            while len(written() - before) < len(systems) and time.monotonic() < deadline:
                time.sleep(0.2)
        # Each way of stopping ends `serve run` on its own, before the harness would kill it
        # (past STOP_TIMEOUT_S), and takes down everything it started. Ctrl-C and SIGINT shut
        # Serve down (exit code 0); on SIGTERM Ray's own signal handler aborts the driver
        # (SIGABRT), which Orchard's code does not run in.
        stopped = serve.stopped
        assert stopped is not None and stopped.leftovers == (), stopped
        if stop == "sigterm":
            assert stopped.returncode != -signal.SIGKILL, stopped
        else:
            assert stopped.returncode == 0, stopped
        return answers

    def written() -> set[tuple[str, float]]:
        return {(str(p), p.stat().st_mtime) for p in disk.rglob("*.safetensors")}

    def entries() -> dict[Path, list[int]]:
        """Each entry's KV file and the tokens its sidecar says it holds."""
        return {data: json.loads(data.with_suffix(".json").read_text())["tokens"]
                for data in disk.rglob("*.safetensors") if data.with_suffix(".json").is_file()}

    try:
        [first] = run("first", "sigterm", HISTORY)
        assert first[2] == 0
        assert written(), "nothing reached the disk tier before SIGTERM"
        history_keys = list(entries().values())  # the first conversation's alone
        [again, other] = run("second", "sigint", HISTORY, OTHER)
        assert again[:2] == first[:2]
        assert again[2] == again[1] - 1  # all but the last prompt token, from disk
        assert other[2] < 10  # new here (the chat template's first tokens are shared)

        def of_history(tokens: list[int]) -> bool:  # far more in common than the template
            return any(tokens[:200] == key[:200] for key in history_keys)

        # The first conversation's files cut short, as by a full disk or a crash; the
        # other's left whole.
        cut = [data for data, tokens in entries().items() if of_history(tokens)]
        assert cut and len(cut) < len(entries())
        for data in cut:
            data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        # What the SIGINT run saw, from disk; then the cut conversation, prefilled again.
        [other_again, (text, prompt, cached)] = run("third", "ctrl-c", OTHER, HISTORY)
        assert other_again[:2] == other[:2] and other_again[2] == other[1] - 1
        assert (text, prompt) == first[:2]
        assert cached < 10  # the template's first tokens at most, as `other` above
        assert "disk KV cache: dropping" in (tmp_path / "third.log").read_text()
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
