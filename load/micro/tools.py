"""Tool-call grammar cost on `builtin:bench`: setup, mask per token, decode throughput.

    python -m load.micro.tools [--format hermes] [--batch 1] [--max-tokens 96] [--repeat 3]

Eight tools with realistic schemas (files, bash, web fetch, search with filters, a todo
list of objects...). Prints the grammar setup time (compile_tool_grammar + GuidedMatcher,
`required` and `auto`), the mask time per token replayed over one whole call to every
tool (every token of the call, so string, number, enum and nested-array positions all
count), and greedy decode tokens/s through mlx-lm's BatchGenerator with the `required`
grammar and without, alternating, as the median ratio of `--repeat` pairs with its range.
The bench model has random weights, so its calls are not meaningful: the grammar makes
them valid, and a run may end at max tokens inside a long string.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

import mlx.core as mx
import numpy as np

from load.micro.guided_loop import decode, mask_us
from replicas.contract import ToolChoice, ToolSpec
from replicas.pipeline.guided import GuidedMatcher, GuidedTokenizer
from replicas.pipeline.guided.tools import compile_tool_grammar
from replicas.sources import load_source as load_model


def _obj(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


_PATH = {"type": "string", "description": "absolute path", "pattern": "^/.*"}
SCHEMAS: dict[str, dict[str, Any]] = {
    "read_file": _obj({"path": _PATH, "offset": {"type": "integer", "minimum": 0},
                       "limit": {"type": "integer", "minimum": 1, "maximum": 2000}}, ["path"]),
    "write_file": _obj({"path": _PATH, "content": {"type": "string"}}, ["path", "content"]),
    "edit_file": _obj({"path": _PATH, "old_string": {"type": "string"},
                       "new_string": {"type": "string"}, "replace_all": {"type": "boolean"}},
                      ["path", "old_string", "new_string"]),
    "bash": _obj({"command": {"type": "string"},
                  "timeout": {"type": "integer", "minimum": 1, "maximum": 600},
                  "description": {"type": "string", "maxLength": 80}}, ["command"]),
    "web_fetch": _obj({"url": {"type": "string", "pattern": "^https?://[^ ]+$"},
                       "format": {"enum": ["markdown", "text", "html"]}}, ["url", "format"]),
    "search": _obj({"query": {"type": "string", "minLength": 1},
                    "filters": _obj({"path_glob": {"type": "string"},
                                     "file_type": {"enum": ["py", "md", "json", "any"]},
                                     "case_sensitive": {"type": "boolean"}}, []),
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 100}},
                   ["query"]),
    "todo_write": _obj({"todos": {"type": "array", "minItems": 1, "items": _obj({
        "id": {"type": "string"}, "content": {"type": "string"},
        "status": {"enum": ["pending", "in_progress", "done"]},
        "priority": {"enum": ["low", "medium", "high"]}},
        ["id", "content", "status"])}}, ["todos"]),
    "list_dir": _obj({"path": _PATH, "ignore": {"type": "array", "items": {"type": "string"},
                                                "maxItems": 20}}, ["path"]),
}
TOOLS = tuple(ToolSpec(name, f"the {name} tool", json.dumps(s)) for name, s in SCHEMAS.items())
# One call per tool, in the models' own spacing, for the mask replay.
CALLS: dict[str, dict[str, Any]] = {
    "read_file": {"path": "/src/app/main.py", "offset": 120, "limit": 80},
    "write_file": {"path": "/tmp/notes.md", "content": "# Notes\n\n- grammar setup\n- masks\n"},
    "edit_file": {"path": "/src/app/main.py", "old_string": "def run(x):",
                  "new_string": "def run(x: int) -> None:", "replace_all": False},
    "bash": {"command": "python -m pytest -q tests/unit/test_x.py", "timeout": 120,
             "description": "run the unit tests"},
    "web_fetch": {"url": "https://example.com/docs/page?id=3", "format": "markdown"},
    "search": {"query": "def compile_guided", "filters": {"path_glob": "replicas/**",
                                                          "file_type": "py"}, "max_results": 5},
    "todo_write": {"todos": [{"id": "1", "content": "write the grammar", "status": "done",
                              "priority": "high"},
                             {"id": "2", "content": "bench it", "status": "in_progress"}]},
    "list_dir": {"path": "/src", "ignore": ["__pycache__", "*.pyc"]},
}
PROMPT = "Read /src/app/main.py and tell me what run() does."


def call_text(name: str, args: dict[str, Any]) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>'


def setup_ms(tok: GuidedTokenizer, fmt: str, choice: ToolChoice, cold: bool, n: int = 20
             ) -> float:
    """Median compile + matcher time. Cold: a tool set never seen (a fresh name each time);
    warm: the same tools again, as an agent sends them every turn (both are cached)."""
    times = []
    for i in range(n):
        tools = tuple(dataclasses.replace(t, name=f"{t.name}_{i}") for t in TOOLS) if cold \
            else TOOLS
        start = time.perf_counter()
        grammar = compile_tool_grammar(fmt, tools, choice, tokenizer=tok)
        assert grammar is not None
        GuidedMatcher(tok, grammar)
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--format", default="hermes")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeat", type=int, default=3)
    return parser


def main() -> None:
    args = build_parser().parse_args()

    loaded = load_model("builtin:bench")
    hf = loaded.hf_tokenizer
    start = time.perf_counter()
    tok = GuidedTokenizer.from_hf(hf, vocab_size=loaded.vocab_size,
                                  eos_token_ids=sorted(loaded.eos_token_ids))
    tokenizer_ms = 1e3 * (time.perf_counter() - start)
    marker = hf.encode("<tool_call>", add_special_tokens=False)
    print(f"mlx {mx.__version__} on {mx.default_device()}; builtin:bench, tokenizer {len(hf)} "
          f"ids, logits {tok.vocab_size}; <tool_call> is {len(marker)} token(s); "
          f"GuidedTokenizer {tokenizer_ms:.0f} ms")

    required = ToolChoice("required")
    make = lambda: compile_tool_grammar(args.format, TOOLS, required, tokenizer=tok) or ""  # noqa: E731
    for choice in (required, ToolChoice("auto")):
        print(f"grammar setup, {len(TOOLS)} tools, {choice.mode}: "
              f"{setup_ms(tok, args.format, choice, cold=True):.2f} ms new tool set, "
              f"{setup_ms(tok, args.format, choice, cold=False):.3f} ms same tools again "
              "(medians)")

    if args.format == "hermes":  # the replay texts are hermes calls
        ids = hf.encode("\n".join(call_text(n, a) for n, a in CALLS.items()),
                        add_special_tokens=False)
        mean, p99 = mask_us(tok, [*ids, tok.eos_token_ids[0]], make())
        print(f"mask per token over {len(CALLS)} whole calls ({len(ids)} tokens): "
              f"{mean:.0f} us mean, {p99:.0f} us p99")

    prompt = hf.encode(PROMPT, add_special_tokens=False)
    for constrained in (True, False):  # warm up: mx.compile traces, allocator caches
        decode(loaded.model, tok, prompt, 1, 8, constrained, make)
    ratios, pairs = [], []
    for _ in range(args.repeat):
        guided = decode(loaded.model, tok, prompt, args.batch, args.max_tokens, True, make)
        length = max(len(o) for o in guided.outputs)
        free = decode(loaded.model, tok, prompt, args.batch, length, False)
        ratios.append(guided.tokens_per_s / free.tokens_per_s)
        pairs.append((guided.tokens_per_s, free.tokens_per_s))
    print(f"batch {args.batch}, {args.repeat} pairs: constrained "
          f"{statistics.median(g for g, _ in pairs):.1f} tok/s, unconstrained "
          f"{statistics.median(f for _, f in pairs):.1f} tok/s (medians); ratio median "
          f"{statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f})")
    text = hf.decode([t for t in guided.outputs[0] if t not in tok.eos_token_ids])
    ended = "grammar complete" if guided.outputs[0][-1] in tok.eos_token_ids else "max tokens"
    print(f"  constrained output [0] ({ended}): {text[:90]!r}{'...' if len(text) > 90 else ''}")


if __name__ == "__main__":
    main()
