"""Token logprobs in OpenAI's two shapes: the entries of chat's `logprobs.content` (also
Responses' `output_text.logprobs`) and the legacy completions' parallel lists."""

from __future__ import annotations

from typing import Any, Sequence

from replicas.contract import TokenLogprob


def _bytes(text: str) -> list[int]:
    # surrogatepass: a lone surrogate in a token's text still has bytes to report.
    return list(text.encode("utf-8", "surrogatepass"))


def chat_content(entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """`choices[i].logprobs.content` (and a Responses text's `logprobs`): one entry per
    token, its top alternatives inside."""
    return [{
        "token": e.token,
        "logprob": e.logprob,
        "bytes": _bytes(e.token),
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": _bytes(t)} for t, lp in e.top],
    } for e in entries]


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {"content": chat_content(entries), "refusal": None}


class CompletionLogprobs:
    """Completions' `logprobs` object, piece by piece for a stream: `text_offset` runs on
    across pieces (each token's offset is the length of the tokens' text before it)."""

    def __init__(self) -> None:
        self._offset = 0

    def render(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        offsets = []
        for entry in entries:
            offsets.append(self._offset)
            self._offset += len(entry.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [_top(e) for e in entries],
            "text_offset": offsets,
        }


def _top(entry: TokenLogprob) -> dict[str, float] | None:
    if entry.logprob is None:
        return None  # an echoed prompt's first token: nothing predicts it
    # As OpenAI: the sampled token is always there, so up to k + 1 entries.
    top = dict(entry.top)
    top.setdefault(entry.token, entry.logprob)
    return top
