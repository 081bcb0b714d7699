"""lm-evaluation-harness (`lm-eval` from PyPI, the real CLI) against a real `serve run`.

Three tasks over `local-completions` and one over `local-chat-completions`, their data a
JSON file written here from the built-in model's scripts, so the right answers are known:

- `orchard_choice` (multiple choice, loglikelihood of each choice): the scripted answer
  against the other scripts' answers; accuracy 1.0 means loglikelihood ranks it first;
- `orchard_loglikelihood`: `acc` is the harness's is-greedy check (every token of the
  scripted answer is the model's most likely one), with its perplexity;
- `orchard_generate` and `orchard_chat`: `generate_until`, exact match with the script.

Loglikelihood requests are `echo` + `logprobs` with token-id prompts, several per request;
the harness tokenizes through the server's `/tokenize` (vLLM's endpoints, which it detects).
Nothing reaches the network: the datasets are local JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from replicas.builtin import ensure_builtin, load_scripts
from tests.serve_process import ServeProcess, config_copy, free_port, serve_run

pytestmark = pytest.mark.e2e
MODEL = "orchard-tiny"
CHAT = [s for s in load_scripts() if s.kind == "chat" and len(s.messages) == 1
        and not s.tools and s.enable_thinking is None]
COMPLETIONS = [s for s in load_scripts() if s.kind == "completion"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    tmp = tmp_path_factory.mktemp("lm-eval-serve")
    port = free_port()
    with serve_run(config_copy(tmp, port), port, tmp / "serve_run.log") as proc:
        yield proc


def raw_items() -> list[dict[str, Any]]:
    """Every script as a raw-text context (chats rendered by the model's own template, as
    the server renders them) and the exact text the model generates after it; distractors
    are the other scripts' texts.

    `context_head`/`tail`: the same text split before its first space. The harness moves a
    context's trailing whitespace into the continuation, and the tiny model was trained on
    its answers only, never to predict a prompt's own "\n": split inside the answer, the
    continuation's tokens are exactly the trained ones (a leading space belongs to the word
    after it in this tokenizer)."""
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_builtin("tiny")))
    items = [{"id": s.id, "context": tokenizer.apply_chat_template(
        list(s.template_messages), add_generation_prompt=True, tokenize=False),
        "answer": s.expected_text} for s in CHAT]
    items += [{"id": s.id, "context": s.prompt, "answer": s.expected_text} for s in COMPLETIONS]
    answers = [item["answer"] for item in items]
    for i, item in enumerate(items):
        item["choices"] = [item["answer"], answers[(i + 1) % len(answers)],
                           answers[(i + 5) % len(answers)]]
        cut = item["answer"].find(" ")
        cut = 0 if cut < 0 else cut
        item["context_head"] = item["context"] + item["answer"][:cut]
        item["tail"] = item["answer"][cut:]
    return items


TASKS = {
    "orchard_choice": {"output_type": "multiple_choice", "doc_to_text": "{{context}}",
                       "doc_to_choice": "{{choices}}", "doc_to_target": 0,
                       "metric_list": [{"metric": "acc"}], "data": "raw"},
    "orchard_loglikelihood": {"output_type": "loglikelihood",
                              "doc_to_text": "{{context_head}}", "doc_to_target": "{{tail}}",
                              "metric_list": [{"metric": "acc"}, {"metric": "perplexity"}],
                              "data": "raw"},
    "orchard_generate": {"output_type": "generate_until", "doc_to_text": "{{context}}",
                         "doc_to_target": "{{answer}}", "data": "raw",
                         "metric_list": [{"metric": "exact_match"}],
                         "generation_kwargs": {"until": ["<|im_end|>"], "max_gen_toks": 320,
                                               "do_sample": False, "temperature": 0}},
    "orchard_chat": {"output_type": "generate_until", "doc_to_text": "{{question}}",
                     "doc_to_target": "{{answer}}", "data": "chat",
                     "metric_list": [{"metric": "exact_match"}],
                     "generation_kwargs": {"until": ["<|im_end|>"], "max_gen_toks": 320,
                                           "do_sample": False, "temperature": 0}},
}


def write_tasks(folder: Path) -> Path:
    data = {
        "raw": raw_items(),
        "chat": [{"id": s.id, "question": s.messages[0].content, "answer": s.answer}
                 for s in CHAT],
    }
    for name, rows in data.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for task, spec in TASKS.items():
        spec = dict(spec)
        rows = spec.pop("data")
        config = {"task": task, "dataset_path": "json", "test_split": "test",
                  "dataset_kwargs": {"data_files": {"test": str(folder / f"{rows}.jsonl")}},
                  "target_delimiter": "", **spec}
        # YAML is a superset of JSON: the harness reads these as its task files.
        (folder / f"{task}.yaml").write_text(json.dumps(config, indent=1))
    return folder


def run_lm_eval(folder: Path, model: str, model_args: dict[str, Any], tasks: list[str],
                extra: list[str] = (), batch: int = 1) -> dict[str, Any]:
    out = folder / f"out-{model}"
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "OPENAI_API_KEY": "unused"}
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", args,
           "--tasks", ",".join(tasks), "--include_path", str(folder),
           "--output_path", str(out), "--batch_size", str(batch), *extra]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"lm_eval failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    results = sorted(out.rglob("results_*.json"))
    assert results, f"no results written:\n{done.stderr[-4000:]}"
    return json.loads(results[-1].read_text())["results"]


def test_lm_eval_completions(server: ServeProcess, tmp_path: Path) -> None:
    folder = write_tasks(tmp_path)
    # No tokenizer given: the harness finds the server's /tokenizer_info and /tokenize and
    # tokenizes through them (its "auto" backend), as it does against vLLM.
    results = run_lm_eval(folder, "local-completions", {
        "model": MODEL, "base_url": f"{server.base_url}/v1/completions",
        "num_concurrent": 2, "max_retries": 1}, ["orchard_choice", "orchard_loglikelihood",
                                                 "orchard_generate"],
        batch=4)  # several prompts per request, as harnesses batch them
    n = len(CHAT) + len(COMPLETIONS)
    assert n >= 10
    # Loglikelihood ranks every scripted continuation first, and every one is greedy.
    assert results["orchard_choice"]["acc,none"] == 1.0, results
    assert results["orchard_loglikelihood"]["acc,none"] == 1.0, results
    # Trained to a logit margin, the scripted tokens carry nearly all the probability.
    assert 1.0 <= results["orchard_loglikelihood"]["perplexity,none"] < 1.2, results
    assert results["orchard_generate"]["exact_match,none"] == 1.0, results
    # 45 choice, 15 loglikelihood and 15 generation requests went out in batches of 4.
    requests = 3 * n + n + n
    handled = server.wait_handled("POST", "/v1/completions", requests // 4)
    assert requests // 4 <= len(handled) < requests // 2, len(handled)
    assert server.wait_handled("POST", "/tokenize", 1), "the harness did not tokenize remotely"


def test_lm_eval_chat(server: ServeProcess, tmp_path: Path) -> None:
    folder = write_tasks(tmp_path)
    results = run_lm_eval(folder, "local-chat-completions", {
        "model": MODEL, "base_url": f"{server.base_url}/v1/chat/completions",
        "num_concurrent": 2, "max_retries": 1}, ["orchard_chat"],
        extra=["--apply_chat_template"])
    assert results["orchard_chat"]["exact_match,none"] == 1.0, results
