"""Colocated serving without Ray: the config rule and the in-process client's admission."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import pytest
from pydantic import ValidationError

from deployments.model_clients import LocalModelClient
from deployments.config import AppArgs
from ingress.client import ModelCard
from replicas.contract import (
    Channel,
    ChatMessage,
    ChatPrompt,
    ErrorKind,
    Failed,
    FinishReason,
    Finished,
    GenerationRequest,
    OutputEvent,
    TextDelta,
    TokenizerInfo,
    Usage,
)
from replicas.errors import InvalidRequestError


class GatedReplica:
    """Streams one delta, then holds the stream open until `release` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.closed = 0

    async def stream(self, request: GenerationRequest) -> AsyncIterator[list[OutputEvent]]:
        try:
            yield [TextDelta(Channel.ANSWER, "hi")]
            await self.release.wait()
            yield [Finished(FinishReason.EOS, Usage(3, 1))]
        finally:
            self.closed += 1

    async def tokenize(self, request: GenerationRequest,
                       add_special_tokens: bool = True) -> tuple[int, ...] | Failed:
        if request.model == "bad":
            return Failed(ErrorKind.INVALID_REQUEST, "the prompt cannot be rendered", "messages")
        return (1,) * 7 if add_special_tokens else (1,) * 6

    async def detokenize(self, token_ids: tuple[int, ...]) -> str | Failed:
        if any(t < 0 for t in token_ids):
            return Failed(ErrorKind.INVALID_REQUEST, "outside the vocabulary", "tokens")
        return "x" * len(token_ids)

    def tokenizer_info(self) -> TokenizerInfo:
        return TokenizerInfo("T", "</s>", None, None, None, 128, 10)


def request(model: str = "m") -> GenerationRequest:
    return GenerationRequest("r", model, ChatPrompt((ChatMessage("user", "hi"),)))


def test_colocate_serves_exactly_one_model() -> None:
    one = {"id": "a", "source": "builtin:tiny"}
    assert AppArgs.model_validate({"models": [one], "ingress": {"colocate": True}}).ingress.colocate
    with pytest.raises(ValidationError, match="exactly one model"):
        AppArgs.model_validate({"models": [one, {**one, "id": "b"}], "ingress": {"colocate": True}})


@pytest.mark.parametrize(("models", "colocate", "expected"), [
    ([{}], "auto", True),  # the default config: one model, one replica
    ([{"num_replicas": 2}], "auto", False),  # the ingress routes by cached prefix
    ([{"num_replicas": "auto"}], "auto", False),
    ([{"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}], "auto", False),
    ([{}, {"id": "b"}], "auto", False),  # the ingress dispatches by model
    ([{"num_replicas": 2}], True, True),
    ([{}], False, False),
])
def test_which_layouts_are_colocated(models: list[dict[str, object]], colocate: object,
                                     expected: bool) -> None:
    one = {"id": "a", "source": "builtin:tiny"}
    args = AppArgs.model_validate({"models": [{**one, **m} for m in models],
                                   "ingress": {"colocate": colocate}})
    assert args.colocated is expected
    assert AppArgs.model_validate({"models": [one]}).colocated  # unset is `auto`
    scaled_ingress = {"models": [one], "ingress": {"num_replicas": 2}}
    assert not AppArgs.model_validate(scaled_ingress).colocated  # asked for: two-hop


def test_names_resolve_to_the_one_card() -> None:
    card = ModelCard("m", aliases=("alias",))
    client = LocalModelClient(GatedReplica(), card, max_ongoing=1)
    assert client.models() == [card]
    assert client.resolve("m") is card and client.resolve("alias") is card
    assert client.resolve("other") is None


def test_streams_past_the_limit_get_overloaded_and_room_comes_back() -> None:
    async def scenario() -> None:
        replica = GatedReplica()
        client = LocalModelClient(replica, ModelCard("m"), max_ongoing=1)
        first = client.stream(request())
        assert await anext(first) == [TextDelta(Channel.ANSWER, "hi")]
        assert client.live == 1
        refused = [batch async for batch in client.stream(request())]
        assert refused == [[Failed(ErrorKind.OVERLOADED, "the model 'm' is at capacity; retry later")]]
        assert replica.closed == 0  # a refused request never reached the replica
        replica.release.set()
        assert [batch async for batch in first][-1][0].__class__ is Finished
        assert client.live == 0
        # A client that leaves mid-stream frees its place too.
        replica.release.clear()
        leaving = client.stream(request())
        await anext(leaving)
        await leaving.aclose()
        assert client.live == 0 and replica.closed == 2
        admitted = client.stream(request())
        assert await anext(admitted) == [TextDelta(Channel.ANSWER, "hi")]
        await admitted.aclose()

    asyncio.run(scenario())


def test_tokenizer_calls_raise_the_replicas_error() -> None:
    client = LocalModelClient(GatedReplica(), ModelCard("m"), max_ongoing=1)
    assert len(asyncio.run(client.tokenize(request()))) == 7
    assert len(asyncio.run(client.tokenize(request(), add_special_tokens=False))) == 6
    with pytest.raises(InvalidRequestError) as err:
        asyncio.run(client.tokenize(request("bad")))
    assert err.value.param == "messages"
    assert asyncio.run(client.detokenize("m", (1, 2))) == "xx"
    with pytest.raises(InvalidRequestError):
        asyncio.run(client.detokenize("m", (-1,)))
    assert asyncio.run(client.tokenizer_info("m")).eos_token == "</s>"
