"""One token's path through a constrained request: the controller (inside the batch step)
and the decoder (after it) both read every token, and the request's `ChannelTracker`
detokenizes and routes each one once for both (issue 31)."""

from __future__ import annotations

from typing import Any

import pytest

from replicas.contract import Finished, GuidedSpec, ReasoningSpec, ToolChoice
from replicas.pipeline.control import RequestController
from replicas.pipeline.decoding import RequestDecoder
from replicas.pipeline.detokenizer import Detokenizer
from replicas.replica import ModelReplica
from tests.integration.test_replica import request_for, run, terminal
from tests.scripted import script_request
from tests.streams import collect


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often any detokenizer was fed a token, any controller read one, and any
    decoder was given a text token (every token but an ending EOS or stop id)."""
    counts = {"detokenized": 0, "controller": 0, "decoder": 0}
    feed, on_token, decode = Detokenizer.feed, RequestController._on_token, RequestDecoder.feed

    def counting_feed(self: Detokenizer, token_id: int) -> str:
        counts["detokenized"] += 1
        return feed(self, token_id)

    def counting_on_token(self: RequestController, token: int) -> None:
        counts["controller"] += 1
        on_token(self, token)

    def counting_decode(self: RequestDecoder, token_id: int) -> list[Any]:
        counts["decoder"] += 1
        return decode(self, token_id)

    monkeypatch.setattr(Detokenizer, "feed", counting_feed)
    monkeypatch.setattr(RequestDecoder, "feed", counting_decode)
    monkeypatch.setattr(RequestController, "_on_token", counting_on_token)
    return counts


@pytest.mark.parametrize("case", ["choice after reasoning", "forced tool call", "budget"])
def test_a_constrained_request_detokenizes_each_token_once(
        replica: ModelReplica, counted: dict[str, int], case: str) -> None:
    if case == "choice after reasoning":
        request = request_for("riddle-think", guided=GuidedSpec("choice", ("yes", "no")))
    elif case == "forced tool call":
        request = script_request("tool-one", tool_choice=ToolChoice("required"))
    else:
        request = request_for("feathers-think", reasoning=ReasoningSpec(budget_tokens=12))
    events = run(collect(replica.stream(request)))
    end = terminal(events)
    assert isinstance(end, Finished), end
    text_tokens = counted["decoder"]
    assert end.usage.completion_tokens - 1 <= text_tokens <= end.usage.completion_tokens
    assert text_tokens > 5
    # Both readers saw the tokens (the controller is a step early, so it may also have seen
    # the ending one) ...
    assert counted["controller"] >= text_tokens
    # ... and each was detokenized once, where each reader had its own detokenizer before.
    assert counted["detokenized"] == text_tokens, (counted, end.usage)

