"""The cache-aware router's choices (`deployments.prefix_router`), on fake replicas: which
keys a request has, which replica a conversation's next turn prefers, the fall back to the
least-loaded replica, the bounded key table, and what reaches Serve's ranks."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

from deployments.config import ModelSettings
from deployments.prefix_router import (
    TEXT_BLOCK_CHARS,
    Affinity,
    PrefixAffinityRouter,
    routing_keys,
)
from replicas.contract import (
    ChatMessage,
    ChatPrompt,
    GenerationRequest,
    TextPrompt,
    TokenPrompt,
    ToolSpec,
)

SYSTEM = ChatMessage("system", "You are an agent. " * 50)


def chat(*contents: str, session: str | None = None,
         tools: tuple[ToolSpec, ...] = ()) -> GenerationRequest:
    roles = ("user", "assistant")
    messages = (SYSTEM, *(ChatMessage(roles[i % 2], c) for i, c in enumerate(contents)))
    return GenerationRequest("r", "m", ChatPrompt(messages), tools=tools, session_key=session)


def route(affinity: Affinity, request: GenerationRequest,
          loads: dict[str, int | None]) -> str:
    """The replica Serve would take: the least loaded of the first rank (power-of-two's
    random pair is stood in for by the least-loaded replica)."""
    keys = routing_keys(request, "prefix")
    ranks = affinity.rank(keys, loads) or [sorted(loads)]
    chosen = min(ranks[0], key=lambda r: loads[r] or 0)
    if keys is not None:
        affinity.record(keys, chosen)
    return chosen


def test_a_conversations_next_turns_follow_its_first_replica() -> None:
    affinity = Affinity(max_keys=100, max_imbalance=8)
    # Turn 1 of A lands on r2 (power-of-two); every later turn of A prefers r2.
    assert affinity.rank(routing_keys(chat("a1"), "prefix"), {"r1": 0, "r2": 0}) == []
    affinity.record(routing_keys(chat("a1"), "prefix"), "r2")  # type: ignore[arg-type]
    turn2 = chat("a1", "reply", "a2")
    assert route(affinity, turn2, {"r1": 0, "r2": 1}) == "r2"
    assert route(affinity, chat("a1", "reply", "a2", "reply", "a3"), {"r1": 0, "r2": 1}) == "r2"
    # A retry with an edited last message still shares all before it.
    assert route(affinity, chat("a1", "reply", "a2", "reply", "a3 edited"),
                 {"r1": 0, "r2": 1}) == "r2"


def test_a_new_conversation_with_the_same_system_prompt_is_not_pinned() -> None:
    affinity = Affinity(max_keys=100, max_imbalance=8)
    route(affinity, chat("a1"), {"r1": 0, "r2": 0})
    route(affinity, chat("a1", "reply", "a2"), {"r1": 0, "r2": 0})
    # Only the system prompt is shared: no preference, so load decides.
    assert affinity.rank(routing_keys(chat("b1"), "prefix"), {"r1": 0, "r2": 0}) == []
    assert affinity.rank(routing_keys(chat("b1", "x", "b2"), "prefix"), {"r1": 0, "r2": 0}) == []


def test_tools_are_part_of_the_prefix() -> None:
    tool = ToolSpec("search")
    plain, with_tool = (routing_keys(chat("a1"), "prefix"),
                        routing_keys(chat("a1", tools=(tool,)), "prefix"))
    assert plain is not None and with_tool is not None
    assert set(plain.chain).isdisjoint(with_tool.chain)


def test_an_uneven_load_sends_the_turn_to_the_least_loaded_replica() -> None:
    affinity = Affinity(max_keys=100, max_imbalance=2)
    assert route(affinity, chat("a1"), {"r1": 5, "r2": 0}) == "r2"
    turn2 = routing_keys(chat("a1", "reply", "a2"), "prefix")
    assert affinity.rank(turn2, {"r1": 0, "r2": 2}) == [["r2"], ["r1"]]  # within the margin
    assert affinity.rank(turn2, {"r1": 0, "r2": 3}) == [["r1"], ["r2"]]  # past it
    assert affinity.rank(turn2, {"r1": 0, "r2": None}) == [["r2"], ["r1"]]  # unknown: idle


def test_a_session_key_routes_unrelated_prompts_together_and_alike_everywhere() -> None:
    first, second = chat("x", session="s-1"), chat("entirely different", session="s-1")
    loads: dict[str, int | None] = {"r1": 0, "r2": 0, "r3": 0}
    # Two ingress replicas with empty tables agree on a new session's replica.
    a, b = Affinity(100, 8), Affinity(100, 8)
    assert route(a, first, loads) == route(b, second, loads)
    picks = {route(a, chat(str(i), session="s-1"), loads) for i in range(5)}
    assert len(picks) == 1
    # Different sessions spread over the replicas.
    spread = {route(Affinity(100, 8), chat("x", session=f"s{i}"), loads) for i in range(40)}
    assert len(spread) == 3


def test_the_session_policy_steers_only_requests_with_a_key() -> None:
    assert routing_keys(chat("a1"), "session") is None
    keys = routing_keys(chat("a1", session="k"), "session")
    assert keys is not None and keys.session


def test_text_and_token_prompts_chain_by_blocks() -> None:
    text = "t" * (TEXT_BLOCK_CHARS * 3)
    request = GenerationRequest("r", "m", TextPrompt(text))
    longer = replace(request, prompt=TextPrompt(text + "more text" * 200))
    keys, next_keys = routing_keys(request, "prefix"), routing_keys(longer, "prefix")
    assert keys is not None and next_keys is not None
    assert keys.record[0] in next_keys.chain  # a continuation finds the earlier prompt
    short = GenerationRequest("r", "m", TextPrompt("hi"))
    assert routing_keys(short, "prefix") is None  # under one block: nothing to share
    tokens = GenerationRequest("r", "m", TokenPrompt(tuple(range(300))))
    more = replace(tokens, prompt=TokenPrompt(tuple(range(600))))
    token_keys, more_keys = routing_keys(tokens, "prefix"), routing_keys(more, "prefix")
    assert token_keys is not None and more_keys is not None
    assert token_keys.record[0] in more_keys.chain


def test_the_key_table_is_bounded_and_forgets_departed_replicas() -> None:
    affinity = Affinity(max_keys=10, max_imbalance=8)
    for i in range(50):
        route(affinity, chat(f"c{i}", "reply", f"d{i}"), {"r1": 0, "r2": 0})
    assert len(affinity) == 10
    route(affinity, chat("z1"), {"r1": 0, "r2": 10})
    assert affinity.rank(routing_keys(chat("z1", "reply", "z2"), "prefix"),
                         {"r2": 0, "r3": 0}) == []  # r1 left: no preference
    assert len(affinity) == 9


def test_routing_is_on_by_default_only_when_a_model_may_scale() -> None:
    def policy(**extra: Any) -> str:
        return ModelSettings(id="m", source="s", **extra).routing_policy

    assert policy() == "none"
    assert policy(num_replicas=2) == "prefix"
    assert policy(num_replicas="auto") == "prefix"
    assert policy(autoscaling_config={"min_replicas": 1, "max_replicas": 2}) == "prefix"
    assert policy(num_replicas=2, routing={"policy": "none"}) == "none"
    assert policy(routing={"policy": "session"}) == "session"


# ---- the Ray glue, with fake replicas -------------------------------------------------


@dataclass(frozen=True)
class FakeId:
    name: str

    def to_full_id_str(self) -> str:
        return self.name


@dataclass(frozen=True)
class FakeReplica:
    replica_id: FakeId
    max_ongoing_requests: int = 64


@dataclass(frozen=True)
class FakeMetadata:
    call_method: str


@dataclass(frozen=True)
class FakePending:
    args: list[Any]
    metadata: FakeMetadata


class FakeQueueLens:
    def __init__(self, loads: dict[str, int]) -> None:
        self.loads = loads

    def get(self, replica_id: FakeId) -> int | None:
        return self.loads.get(replica_id.name)


def router(loads: dict[str, int]) -> PrefixAffinityRouter:
    r = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # Serve's constructor needs a loop
    r.initialize_state(policy="prefix", max_keys=100, max_imbalance=4)
    r._replica_queue_len_cache = FakeQueueLens(loads)  # type: ignore[assignment]
    return r


def choose(r: PrefixAffinityRouter, replicas: list[FakeReplica], pending: FakePending) -> Any:
    return asyncio.run(r.choose_replicas(replicas, pending))  # type: ignore[arg-type]


def test_the_router_ranks_the_replica_that_served_the_conversation_first() -> None:
    replicas = [FakeReplica(FakeId("r1")), FakeReplica(FakeId("r2")), FakeReplica(FakeId("r3"))]
    r = router({"r1": 1, "r2": 0, "r3": 0})
    turn1 = FakePending([chat("a1")], FakeMetadata("stream"))
    first = choose(r, replicas, turn1)
    assert len(first) == 1 and len(first[0]) == 2  # no preference: power-of-two's pair
    r.on_request_routed(turn1, FakeId("r1"), None)  # type: ignore[arg-type]
    turn2 = FakePending([chat("a1", "reply", "a2")], FakeMetadata("stream"))
    ranks = choose(r, replicas, turn2)
    assert [[x.replica_id.name for x in rank] for rank in ranks] == [["r1"], ["r2", "r3"]]
    # Token counting neither follows nor records affinity; foreign arguments are tolerated.
    counted = choose(r, replicas, FakePending([chat("a1", "reply", "a2")],
                                              FakeMetadata("count_tokens")))
    assert len(counted[0]) == 2
    assert len(choose(r, replicas, FakePending(["not a request"], FakeMetadata("stream")))[0]) == 2


def test_each_api_carries_the_clients_session_key_into_the_request() -> None:
    from ingress.anthropic.convert import to_generation_request
    from ingress.anthropic.models import MessagesRequest
    from ingress.client import ModelCard
    from ingress.openai.convert import chat_request
    from ingress.openai.models import ChatCompletionRequest
    from ingress.responses.convert import to_plan
    from ingress.responses.models import ResponsesRequest

    messages = [{"role": "user", "content": "hi"}]
    chat_body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": messages, "prompt_cache_key": "k1"})
    assert chat_request(chat_body, "m").session_key == "k1"
    plain = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    assert chat_request(plain, "m").session_key is None
    anthropic = MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 8, "messages": messages, "metadata": {"user_id": "u1"}})
    assert to_generation_request(anthropic, ModelCard("m")).session_key == "u1"
    responses = ResponsesRequest.model_validate(
        {"model": "m", "input": "hi", "prompt_cache_key": "k2"})
    assert to_plan(responses, ModelCard("m")).generation.session_key == "k2"
