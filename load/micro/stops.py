"""Stop matcher cost per token: flat in the output length.

Feeds synthetic token-sized pieces (3-5 characters, like a detokenizer's output) through a
StopMatcher with 16 stop strings, for outputs of 1k, 8k and 32k tokens, where the stops
never match or match only at the very end, and prints ns/token and the 32k/1k ratio (about
1.0 when the cost per token does not grow with the output).

    python -m load.micro.stops
"""

from __future__ import annotations

import argparse
import random
import time

from replicas.contract import FinishReason
from replicas.pipeline.stops import StopMatcher

STOPS = (
    "\n\n\n",
    "</s>",
    "<|im_end|>",
    "<|eot_id|>",
    "###",
    "User:",
    "Assistant:",
    "Observation:",
    "```output",
    "[DONE]",
    "</answer>",
    "the end of the story",
    "in conclusion, we",
    "STOP",
    "3.14159",
    "\n\nHuman:",
)
WORDS = (
    "the model reads each token and the server streams it back to the user while other "
    "requests share the batch so that latency stays low under load and the answer stays "
    "correct in every case we test including lists code and markdown tables"
).split()
PUNCTUATION = (" ", " ", " ", " ", ", ", ". ", ".\n", "\n\n", ": ", " (", ") ", " `", "` ")
LENGTHS = (1_000, 8_000, 32_000)
REPEATS = 30


def token_pieces(count: int, rng: random.Random) -> list[str]:
    """Text in 3-5 character pieces, cut from prose so stops' first characters do occur."""
    words: list[str] = []
    size = 0
    while size < count * 5:
        word = rng.choice(WORDS) + rng.choice(PUNCTUATION)
        words.append(word)
        size += len(word)
    text = "".join(words)
    pieces: list[str] = []
    pos = 0
    while len(pieces) < count:
        step = rng.randint(3, 5)
        pieces.append(text[pos : pos + step])
        pos += step
    return pieces


def run_once(pieces: list[str]) -> tuple[float, str | None]:
    matcher = StopMatcher(STOPS)
    feed = matcher.feed
    start = time.perf_counter_ns()
    matched = None
    for piece in pieces:
        out = feed(piece)
        if out.matched is not None:
            matched = out.matched
            break
    else:
        matcher.finish(FinishReason.LENGTH)
    return time.perf_counter_ns() - start, matched


def build_parser() -> argparse.ArgumentParser:
    # No options; the parser still answers --help and refuses unknown flags, and lets
    # tests/unit/test_results_commands.py check the commands the docs cite.
    return argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])


def main() -> None:
    build_parser().parse_args()
    rng = random.Random(1234)
    print(f"StopMatcher, {len(STOPS)} stops, best of {REPEATS} interleaved runs")
    print(f"{'scenario':<16}" + "".join(f"{n // 1000:>8}k" for n in LENGTHS) + "   32k/1k")
    for scenario, expect_match in (("no match", False), ("match at end", True)):
        outputs = []
        for count in LENGTHS:
            pieces = token_pieces(count, rng)
            if expect_match:
                # The stop arrives split over the last tokens, as a multi-token stop would.
                pieces[-3:] = ["the en", "d of the ", "story"]
            outputs.append(pieces)
        best = [float("inf")] * len(LENGTHS)
        # Lengths take turns within each round, so a busy moment on a shared machine does
        # not land on one length only; the minimum filters what is left.
        for _ in range(REPEATS):
            for k, pieces in enumerate(outputs):
                elapsed, matched = run_once(pieces)
                assert (matched is not None) == expect_match, matched
                best[k] = min(best[k], elapsed / len(pieces))
        cells = "".join(f"{ns:>7.0f}ns" for ns in best)
        print(f"{scenario:<16}{cells}   {best[-1] / best[0]:.2f}")
    decode_ns = tiny_decode_ns_per_token()
    print(f"tiny model decode, one stream: {decode_ns / 1e3:.0f} us/token "
          f"(the matcher is {best[1] / decode_ns:.2%} of that at 8k tokens)")


def tiny_decode_ns_per_token(tokens: int = 64) -> float:
    """Raw mlx-lm decode time per token of the built-in tiny model, for scale."""
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from replicas.sources import load_source as load_model

    loaded = load_model("builtin:tiny")
    prompt = loaded.tokenizer.encode("Once upon a time")
    sampler = make_sampler(temp=0.0)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter_ns()
        count = sum(1 for _ in mlx_lm.stream_generate(loaded.model, loaded.tokenizer, prompt,
                                                      max_tokens=tokens, sampler=sampler))
        best = min(best, (time.perf_counter_ns() - start) / count)
    return best


if __name__ == "__main__":
    main()
