"""What one benchmark run measured, and whether two servers did the same work: the
samples and levels `load/serving/vs_mlx_server.py` collects, their summary, and its like-for-like
checks (kept apart so the checks are unit-tested without starting a server)."""

from __future__ import annotations

from dataclasses import dataclass, field

from load.harness.stats import nearest_rank


@dataclass
class Sample:
    """One streamed request as the client saw it; times in seconds."""

    prompt: str = ""
    error: str | None = None
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)  # between text-carrying chunks
    tokens: int = 0
    e2e: float = 0.0
    cached: int = 0
    text: str = ""
    prompt_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass
class Level:
    target: str
    concurrency: int
    seconds: float
    samples: list[Sample]

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.error is None]

    def summary(self) -> dict[str, float]:
        ok = self.ok
        ms = [1e3 * g for s in ok for g in s.gaps]
        tpot = [1e3 * t for s in ok if (t := s.tpot) is not None]
        ttft = [1e3 * s.ttft for s in ok]
        # Over every request sent: a failed one adds no tokens, but the wall time it took
        # stays in `seconds`, so failing fast never looks like serving fast.
        tokens = sum(s.tokens if s.error is None else 0 for s in self.samples)
        return {
            "requests": len(self.samples), "errors": len(self.samples) - len(ok),
            "tokens": tokens, "seconds": self.seconds,
            "tokens_per_s": tokens / self.seconds,
            "ttft_p50_ms": nearest_rank(ttft, 0.5), "ttft_p99_ms": nearest_rank(ttft, 0.99),
            "itl_p50_ms": nearest_rank(ms, 0.5), "itl_p99_ms": nearest_rank(ms, 0.99),
            "tpot_p50_ms": nearest_rank(tpot, 0.5), "tpot_p99_ms": nearest_rank(tpot, 0.99),
            "cached_prompt_tokens": sum(s.cached for s in ok),
        }


def by_prompt(level: Level) -> dict[str, str]:
    return {s.prompt: s.text for s in level.ok}


def problems(results: dict[str, list[Level]], max_tokens: int) -> list[str]:
    """Why the comparison is not like for like: failed or short requests, or servers that
    counted a prompt's tokens differently. Empty when every request did the same work."""
    out = []
    for label, levels in results.items():
        for level in levels:
            bad = [s.error for s in level.samples if s.error is not None]
            if bad:
                out.append(f"{label} c={level.concurrency}: {len(bad)}/{len(level.samples)} "
                           f"requests failed or did not produce {max_tokens} tokens "
                           f"(first: {bad[0]})")
    counts: dict[str, dict[str, int]] = {}
    for label, levels in results.items():
        for level in levels:
            for s in level.ok:
                counts.setdefault(s.prompt, {})[label] = s.prompt_tokens
    differing = {p: c for p, c in counts.items() if len(set(c.values())) > 1}
    if differing:
        prompt, seen = next(iter(differing.items()))
        out.append(f"prompt token counts differ between servers for {len(differing)} prompts "
                   f"(e.g. {prompt[:30]!r}: {seen})")
    return out
