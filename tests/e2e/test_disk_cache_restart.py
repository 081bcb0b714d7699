"""The prefix cache's disk tier across a restart of `serve run` (issue 35): the default
config with `prompt_cache.disk_path` set, run twice over one directory. The second run
serves the first run's conversation from disk (`cached_tokens` covers the prompt but its
last token) with the same greedy answer; a file corrupted between the runs is dropped with
a warning in the log, and its prompt is simply prefilled again.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import openai
import pytest
import yaml

from replicas.builtin import ensure_builtin
from replicas.builtin.build import default_cache_root
from tests.serve_process import config_copy, free_port, serve_run

pytestmark = pytest.mark.e2e

HISTORY = " ".join(f"Note {n}: the river runs past the old mill where children play."
                   for n in range(12))


def ask(client: openai.OpenAI, topic: str) -> tuple[str, int, int]:
    """A greedy answer to a long conversation: (text, prompt tokens, cached tokens)."""
    r = client.chat.completions.create(model="orchard-tiny", max_tokens=16, temperature=0,
                                       messages=[{"role": "system", "content": HISTORY},
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
    port = free_port()
    path = config_copy(tmp_path, port)
    config = yaml.safe_load(path.read_text())
    model = config["applications"][0]["args"]["models"][0]
    model["prompt_cache"] = {**model.get("prompt_cache", {}), "disk_path": str(disk)}
    path.write_text(yaml.safe_dump(config))
    ray_tmp = Path(tempfile.mkdtemp(prefix="ord-", dir="/tmp"))
    env = {"ORCHARD_CACHE_DIR": str(cache), "RAY_TMPDIR": str(ray_tmp)}
    question = "Where do the children play?"

    def run(name: str) -> tuple[str, int, int]:
        with serve_run(path, port, tmp_path / f"{name}.log", env=env) as serve:
            client = openai.OpenAI(base_url=f"{serve.base_url}/v1", api_key="unused",
                                   max_retries=0, timeout=120)
            return ask(client, question)

    try:
        first = run("first")
        assert first[2] == 0
        assert sorted(disk.rglob("*.safetensors")), "nothing reached the disk tier at shutdown"
        text, prompt, cached = run("second")
        assert (text, prompt) == first[:2]
        assert cached == prompt - 1  # all but the last prompt token, from disk
        for data in disk.rglob("*.safetensors"):  # cut short, as by a full disk or a crash
            data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        text, prompt, cached = run("third")
        assert (text, prompt, cached) == (first[0], first[1], 0)  # prefilled again
        assert "disk KV cache: dropping" in (tmp_path / "third.log").read_text()
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
