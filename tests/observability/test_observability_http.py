"""Metrics, request logs and the dashboard against a real `serve run` of the tiny model.

One app for the module: a short load (chat with reasoning, messages, responses, a stream,
a guided request, a 400, a refusal at capacity, a cancel, repeated and distinct prompts for
the prefix cache), then Ray's Prometheus endpoint must show every `orchard_*` metric with
the model label, and a real Prometheus, scraping it with `docs/prometheus-single.yml`,
must return data for every query of `docs/grafana-dashboard.json`.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from deployments.metrics import ENGINE_METRICS, REQUEST_METRICS
from replicas.builtin import ensure_builtin
from tests.serve_process import ROOT, ServeProcess, config_copy, free_port, serve_run

pytestmark = pytest.mark.e2e

MODEL = "orchard-tiny"
DEADLINE_S = 180.0
RIDDLE = "What has keys but can't open locks?"  # a built-in script that reasons first


@dataclass
class App:
    serve: ServeProcess
    ray_tmp: Path

    def metrics_targets(self) -> list[str]:
        """Ray's metrics endpoints, from the service discovery file it keeps up to date."""
        path = self.ray_tmp / "ray" / "prom_metrics_service_discovery.json"
        if not path.is_file():
            return []
        return [t for group in json.loads(path.read_text()) for t in group["targets"]]

    def scrape(self) -> str:
        text = []
        for target in self.metrics_targets():
            try:
                text.append(httpx.get(f"http://{target}/metrics", timeout=10).text)
            except httpx.HTTPError:
                pass  # a target that is not up yet
        return "\n".join(text)


def _eos_ids() -> list[int]:
    ids = json.loads((ensure_builtin("tiny") / "generation_config.json").read_text())
    return list(ids["eos_token_id"])


# Both layouts: HTTP served from the model replica (the default for one model on one
# replica), and an ingress replica in front of the model's.
@pytest.fixture(scope="module", params=["colocated", "two-hop"])
def app(request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    ensure_builtin("tiny")
    port = free_port()
    # One generation at a time, so a second one is refused; a cache that holds about one
    # prompt's KV, so distinct prompts evict.
    models = [{"id": MODEL, "source": "builtin:tiny", "num_replicas": 1,
               "max_ongoing_requests": 1, "max_queued_requests": 1,
               "prompt_cache": {"max_bytes": 300_000}}]
    config_path = config_copy(tmp_path_factory.mktemp("serve"), port, models)
    config = yaml.safe_load(config_path.read_text())
    args = config["applications"][0]["args"]
    args["observability"] = {"metrics_interval_s": 0.5, "json_logs": True}
    args["ingress"] = {"colocate": request.param == "colocated", "replica_wait_s": 60}
    config_path.write_text(yaml.safe_dump(config))
    # A private Ray temp dir: its discovery file names this app's metrics port only (a short
    # path, since Ray puts Unix sockets under it).
    ray_tmp = Path(tempfile.mkdtemp(prefix="orq-", dir="/tmp"))
    env = {"RAY_TMPDIR": str(ray_tmp), "RAY_metrics_report_interval_ms": "1000"}
    log_path = tmp_path_factory.mktemp("log") / "serve_run.log"
    try:
        with serve_run(config_path, port, log_path, env=env) as serve:
            yield App(serve, ray_tmp)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "temperature": 0, "max_tokens": 64, **extra}


def short_load(base: str) -> None:
    """Every kind of request the metrics count, one after another (capacity is one)."""
    with httpx.Client(base_url=base, timeout=120) as http:
        for _ in range(2):  # the second finds the first's prompt in the prefix cache
            assert http.post("/v1/chat/completions", json=_chat(RIDDLE)).status_code == 200
        assert http.post("/v1/messages", json=_chat("Hello there", max_tokens=32)).status_code \
            == 200
        assert http.post("/v1/responses", json={"model": MODEL, "input": "Tell me a joke.",
                                                 "max_output_tokens": 32}).status_code == 200
        with http.stream("POST", "/v1/chat/completions",
                         json=_chat("Count to three.", stream=True)) as streamed:
            assert streamed.status_code == 200
            streamed.read()
        guided = _chat("Name a color.", response_format={"type": "json_object"})
        assert http.post("/v1/chat/completions", json=guided).status_code == 200
        for text in ("Write a haiku about the sea, please, in detail. " * 4,
                     "Explain what a tokenizer does, step by step, slowly. " * 4):
            assert http.post("/v1/chat/completions", json=_chat(text)).status_code == 200
        assert http.post("/v1/chat/completions", json={"model": MODEL}).status_code == 400
        # A long stream holds the only slot: the next request is refused, then it is
        # cancelled by closing the connection mid-stream.
        no_eos = {str(i): -100 for i in _eos_ids()}
        long = _chat("Count to three.", stream=True, max_tokens=2000, logit_bias=no_eos,
                     temperature=1.0)
        with http.stream("POST", "/v1/chat/completions", json=long) as held, \
                httpx.Client(base_url=base, timeout=120) as other:
            assert held.status_code == 200
            chunks = held.iter_raw()  # held: a dropped iterator would close the stream
            next(chunks)
            # Two at once: colocated refuses both; behind an ingress one may wait in Serve's
            # queue (one place, as configured) and the other is refused.
            with ThreadPoolExecutor(2) as pool:
                waiting = [pool.submit(other.post, "/v1/chat/completions", json=_chat("Hi"))
                           for _ in range(2)]
                deadline = time.monotonic() + 60
                while not any(w.done() for w in waiting) and time.monotonic() < deadline:
                    time.sleep(0.1)
                first = next(w for w in waiting if w.done()).result()
                assert first.status_code == 503, first.text
                chunks.close()
                held.close()  # cancels the long generation; a queued request then runs


@pytest.fixture(scope="module")
def loaded(app: App) -> App:
    short_load(app.serve.base_url)
    return app


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """`ray_NAME` samples (histograms: their _count) as (labels, value)."""
    pattern = re.compile(rf"^ray_{name}(?:_count)?\{{(.*?)\}} (\S+)$", re.M)
    out = []
    for labels, value in pattern.findall(text):
        out.append((dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)))
    return out


def _wait_for_metrics(app: App, check: Any) -> str:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        text = app.scrape()
        missing = check(text)
        if not missing:
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"after {DEADLINE_S:.0f}s these are missing or wrong: "
                                 f"{missing}\ntargets {app.metrics_targets()}")
        time.sleep(1)


def _total(text: str, name: str, **labels: str) -> float:
    return sum(v for tags, v in _samples(text, name)
               if all(tags.get(k) == want for k, want in labels.items()))


def test_every_metric_is_exported_with_the_model_label(loaded: App) -> None:
    expected = {
        "orchard_requests_total": 9, "orchard_time_to_first_token_seconds": 7,
        "orchard_inter_token_latency_seconds": 6, "orchard_request_duration_seconds": 9,
        "orchard_prompt_tokens_total": 50, "orchard_output_tokens_total": 20,
        "orchard_cached_tokens_total": 1, "orchard_reasoning_tokens_total": 1,
        "orchard_cancellations_total": 1, "orchard_errors_total": 2,
        "orchard_backpressure_refusals_total": 1,
        "orchard_batch_size": 20, "orchard_engine_step_seconds": 20,
        "orchard_prefix_cache_hits_total": 1, "orchard_prefix_cache_misses_total": 1,
        "orchard_prefix_cache_evictions_total": 1, "orchard_prefix_cache_bytes": 1,
        "orchard_grammar_compile_seconds": 1,
    }
    assert set(expected) | {"orchard_queue_depth", "orchard_running_sequences"} == \
        set(REQUEST_METRICS) | set(ENGINE_METRICS)

    def missing(text: str) -> list[str]:
        wrong = [name for name, least in expected.items()
                 if _total(text, name, model=MODEL) < least]
        # One process per replica: no sync samples, and the shard gauge says 1.
        if _total(text, "orchard_replica_shards", model=MODEL) != 1:
            wrong.append("orchard_replica_shards (not 1)")
        if _samples(text, "orchard_shard_sync_seconds"):
            wrong.append("orchard_shard_sync_seconds (an unsharded replica synced)")
        # Gauges are present (their values are whatever the engine holds right now).
        wrong += [name for name in ("orchard_queue_depth", "orchard_running_sequences")
                  if not _samples(text, name)]
        # The cancel reaches the engine's counters once the stream is seen closed.
        if _total(text, "orchard_running_sequences", model=MODEL) != 0:
            wrong.append("orchard_running_sequences (not back to 0)")
        return wrong

    text = _wait_for_metrics(loaded, missing)
    for name in expected:
        assert all(tags.get("model") == MODEL for tags, _ in _samples(text, name)), name
    # Labels that say what happened.
    assert _total(text, "orchard_requests_total", endpoint="/v1/messages", status="200",
                  protocol="anthropic", finish_reason="eos") >= 1
    assert _total(text, "orchard_requests_total", endpoint="/v1/responses", status="200",
                  protocol="responses") >= 1
    assert _total(text, "orchard_requests_total", status="400", finish_reason="error") >= 1
    assert _total(text, "orchard_requests_total", status="503") >= 1
    assert _total(text, "orchard_requests_total", finish_reason="cancelled") >= 1
    assert _total(text, "orchard_errors_total", kind="invalid_request") >= 1
    assert _total(text, "orchard_errors_total", kind="overloaded") >= 1


def test_one_json_request_log_line_per_request(loaded: App) -> None:
    def lines() -> list[dict[str, Any]]:
        found = []
        for line in loaded.serve.log().splitlines():
            start = line.find('{"event":"request"')
            if start >= 0:
                found.append(json.loads(line[start:]))
        return found

    deadline = time.monotonic() + 60
    while len(lines()) < 9 and time.monotonic() < deadline:
        time.sleep(0.5)
    records = lines()
    riddle = [r for r in records if r["endpoint"] == "/v1/chat/completions"
              and r["reasoning_tokens"]]
    assert len(riddle) >= 2, records
    first = riddle[0]
    assert first["model"] == MODEL and first["protocol"] == "openai"
    assert first["request_id"].startswith("chatcmpl-") and first["status"] == 200
    assert first["prompt_tokens"] > 0 and first["output_tokens"] > 0
    assert first["finish_reason"] == "eos" and first["ttft_ms"] <= first["duration_ms"]
    assert any(r["cached_tokens"] for r in riddle[1:]), riddle
    log = loaded.serve.log()
    assert "piano" not in log.lower() and RIDDLE not in log  # never the text


# ---- a real Prometheus ---------------------------------------------------------------------

def _prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("the prometheus binary is missing: install it with "
                    "`apt-get install -y --no-install-recommends prometheus` (Debian/Ubuntu) "
                    "or `brew install prometheus` (macOS)")
    return binary


@pytest.fixture(scope="module")
def prometheus(loaded: App, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = _prometheus_binary()
    deadline = time.monotonic() + DEADLINE_S
    while not loaded.metrics_targets():
        assert time.monotonic() < deadline, "Ray wrote no metrics service discovery file"
        time.sleep(1)
    config = yaml.safe_load((ROOT / "docs" / "prometheus-single.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    job = config["scrape_configs"][0]
    job["static_configs"] = [{"targets": loaded.metrics_targets()}]  # this app's ports
    work = tmp_path_factory.mktemp("prometheus")
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (work / "prometheus.log").open("w")
    proc = subprocess.Popen([binary, f"--config.file={work / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(f"{base}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, \
                (work / "prometheus.log").read_text()[-3000:]
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _panel_queries() -> list[tuple[str, str]]:
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"]
            for target in panel["targets"]]


def test_every_dashboard_query_returns_data(loaded: App, prometheus: str) -> None:
    queries = _panel_queries()
    assert len(queries) >= 13
    deadline = time.monotonic() + DEADLINE_S
    pending = dict.fromkeys(queries, "never asked")
    while pending and time.monotonic() < deadline:
        short_load(loaded.serve.base_url)  # fresh samples, so rates over the window move
        for title, expr in list(pending):
            # Grafana's variables: every model, and a window that holds several scrapes.
            query = expr.replace("$model", ".*").replace("$__rate_interval", "1m")
            answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": query},
                               timeout=10).json()
            result = answer.get("data", {}).get("result", [])
            values = [float(r["value"][1]) for r in result]
            if answer.get("status") == "success" and values \
                    and all(v == v for v in values):  # NaN: no rate yet
                del pending[(title, expr)]
            else:
                pending[(title, expr)] = json.dumps(answer)[:300]
    assert not pending, pending
