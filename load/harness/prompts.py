"""The prompts the benchmarks send: one story prompt, made unique where a prefix cache must
not help, the shared benchmark prompts of `payloads.json`, and long random histories."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

PROMPT = "Write a long story about a lighthouse keeper and the sea."
PAYLOADS = Path(__file__).resolve().parents[1] / "payloads.json"
# Plain words the built-in tokenizer spends about 2.7 tokens on, each with its space.
WORDS = ("the river runs past the old mill where children play in summer and the "
         "lighthouse keeper writes letters about storms ships and the quiet sea").split()


def bench_prompts() -> list[str]:
    return json.loads(PAYLOADS.read_text(encoding="utf-8"))["bench_prompts"]


def unique_prompt(tag: str) -> str:
    # The hash goes first: any shared opening past the chat template is a cacheable prefix.
    return f"{hashlib.sha256(tag.encode()).hexdigest()[:12]} {PROMPT}"


def history(tokens: int, rng: random.Random) -> str:
    """About `tokens` tokens of text that no other history shares a prefix with."""
    words = tokens * 10 // 27
    return f"Session {rng.random()}. " + " ".join(rng.choice(WORDS) for _ in range(words))
