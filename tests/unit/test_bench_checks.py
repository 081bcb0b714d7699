"""`load.serving.vs_mlx_server`'s like-for-like checks, without servers: a failed or short
request is work not done, and differing prompt token counts void the comparison."""

from __future__ import annotations

from load.harness.results import Level, Sample, problems


def sample(prompt: str, tokens: int = 4, prompt_tokens: int = 10,
           error: str | None = None) -> Sample:
    return Sample(prompt, error=error, ttft=0.1, tokens=tokens, e2e=0.5,
                  prompt_tokens=prompt_tokens)


def test_failed_requests_add_no_tokens_but_keep_their_time() -> None:
    level = Level("orchard x1", 2, 2.0, [sample("a"), sample("b", error="HTTP 500")])
    summary = level.summary()
    assert summary["tokens"] == 4 and summary["tokens_per_s"] == 2.0  # 4 tokens over 2 s
    assert (summary["requests"], summary["errors"]) == (2, 1)


def test_like_for_like_runs_have_no_problems() -> None:
    results = {"mlx_lm.server": [Level("mlx_lm.server", 1, 1.0, [sample("a"), sample("b")])],
               "orchard x1": [Level("orchard x1", 1, 1.0, [sample("b"), sample("a")])]}
    assert problems(results, 4) == []


def test_failed_or_short_requests_are_reported() -> None:
    results = {"orchard x1": [Level("orchard x1", 8, 1.0, [
        sample("a"), sample("b", tokens=2, error="short: 2 of 4 tokens (finish stop)")])]}
    [problem] = problems(results, 4)
    assert problem.startswith("orchard x1 c=8: 1/2 requests failed or did not produce 4 tokens")


def test_differing_prompt_token_counts_are_reported() -> None:
    results = {"mlx_lm.server": [Level("mlx_lm.server", 1, 1.0, [sample("a", prompt_tokens=11)])],
               "orchard x1": [Level("orchard x1", 1, 1.0, [sample("a", prompt_tokens=10)])]}
    [problem] = problems(results, 4)
    assert "prompt token counts differ between servers for 1 prompts" in problem
