"""One `serve run` for the modules that each need built-in models beyond the config's own
(embeddings, vision, MTP, every tool format's family model, rerankers): each talks to its
own models only, by id, so one app serving the union of their models (one Ray start and one
shutdown instead of five) proves the same.

Each module still declares its models; this app serves them all side by side, with the
images limit the vision module tests and a Ray temp dir of its own (its metrics discovery
file names this app's ports only, which the MTP module scrapes).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from replicas.builtin import ensure_builtin
from replicas.builtin.build import default_cache_root
from tests.observability.test_observability_http import App
from tests.serve_process import config_copy, free_port, ready, serve_run

# Some 20 replicas load side by side on two cores.
STARTUP_TIMEOUT_S = 600


def shared_models() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The union of the modules' models (one entry per id: the modules agree on shared
    ones, e.g. `orchard-tiny`) and the ingress settings they need."""
    from tests.e2e import (
        test_adapters_http,
        test_embeddings_http,
        test_mtp_http,
        test_rerank_http,
        test_tool_format_models,
        test_vision_http,
    )

    wanted: list[dict[str, Any]] = [*test_embeddings_http.MODELS, *test_vision_http.MODELS,
                                    *test_mtp_http.MODELS, *test_tool_format_models.MODELS,
                                    *test_rerank_http.MODELS, *test_adapters_http.MODELS]
    models: dict[str, dict[str, Any]] = {}
    for model in wanted:
        assert models.setdefault(model["id"], model) == model, f"two settings for {model['id']}"
    return list(models.values()), {"images": {"max_count": test_vision_http.MAX_IMAGES}}


def _answers(client: httpx.Client, base_url: str, model: dict[str, Any]) -> bool:
    """A chat model answers a one-token completion; an embedding-only one an embedding;
    a cross-encoder a rerank."""
    if model["source"] == "builtin:cross-encoder":
        try:
            return client.post(f"{base_url}/v1/rerank", timeout=30, json={
                "model": model["id"], "query": "Hi", "documents": ["Hi"]}).status_code == 200
        except httpx.HTTPError:
            return False
    if model["source"] not in ("builtin:embed", "builtin:embed-bert"):
        return ready(client, base_url, model["id"])
    try:
        return client.post(f"{base_url}/v1/embeddings", timeout=30, json={
            "model": model["id"], "input": "Hi"}).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def shared_app(tmp: Path) -> Iterator[App]:
    models, ingress = shared_models()
    for model in models:  # built here, not in the replicas' constructors
        ensure_builtin(model["source"].removeprefix("builtin:"))
    from tests.e2e.test_adapters_http import ensure_adapters

    ensure_adapters()  # the LoRA adapters its model names, on disk before it loads
    cache = tmp / "cache"  # an Orchard cache of its own, the built-in models linked in
    cache.mkdir()
    (cache / "builtin").symlink_to(default_cache_root(), target_is_directory=True)
    port = free_port()
    path = config_copy(tmp, port, models=models)
    config = yaml.safe_load(path.read_text())
    args = config["applications"][0]["args"]
    args["ingress"] = {**args.get("ingress", {}), **ingress}
    path.write_text(yaml.safe_dump(config))
    ray_tmp = Path(tempfile.mkdtemp(prefix="ors-", dir="/tmp"))
    env = {"ORCHARD_CACHE_DIR": str(cache), "RAY_TMPDIR": str(ray_tmp),
           "RAY_metrics_report_interval_ms": "1000"}
    try:
        with serve_run(path, port, tmp / "serve.log", env=env,
                       timeout_s=STARTUP_TIMEOUT_S) as serve:
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            with httpx.Client() as client:
                for model in models:  # every model up, not only the first
                    while not _answers(client, serve.base_url, model):
                        assert serve.proc.poll() is None and time.monotonic() < deadline, \
                            f"{model['id']} did not come up; log:\n{serve.log()[-5000:]}"
                        time.sleep(1)
            yield App(serve, ray_tmp)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
