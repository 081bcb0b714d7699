"""The cache-aware router's choices (`deployments.routing.prefix`), on fake replicas: which
keys a request has, which replica a conversation's next turn prefers, the fall back to the
least-loaded replica, the bounded key table, and what reaches Serve's ranks."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any

from ray.serve.exceptions import BackPressureError

from deployments.config import ModelSettings
from deployments.routing.headroom import Ledger, MemoryShed, ReplicaRoom, Room, prompt_tokens
from deployments.routing.prefix import HOLDERS, PREFIXES, Affinity, PrefixAffinityRouter
from replicas.contract import (
    ChatMessage,
    ChatPrompt,
    GenerationRequest,
    TextPrompt,
    TokenPrompt,
    ToolSpec,
)
from replicas.engine.kv.transfer import PrefixPull
from replicas.routing_keys import TEXT_BLOCK_CHARS, routing_keys

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
    routing_stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FakeMetadata:
    call_method: str
    internal_request_id: str = "internal-1"


@dataclass
class FakePending:
    args: list[Any]
    metadata: FakeMetadata
    kwargs: dict[str, Any] = field(default_factory=dict)
    # Only the memory-aware router's shedding touches it (set_exception).
    future: asyncio.Future[Any] = field(
        default_factory=lambda: asyncio.Future(loop=asyncio.new_event_loop()))


class FakeQueueLens:
    def __init__(self, loads: dict[str, int]) -> None:
        self.loads = loads

    def get(self, replica_id: FakeId) -> int | None:
        return self.loads.get(replica_id.name)


def router(loads: dict[str, int], replicas: list[FakeReplica] | None = None
           ) -> PrefixAffinityRouter:
    r = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # Serve's constructor needs a loop
    r.initialize_state(policy="prefix", max_keys=100, max_imbalance=4)
    r._replica_queue_len_cache = FakeQueueLens(loads)  # type: ignore[assignment]
    r._replicas = {x.replica_id: x for x in replicas or []}  # type: ignore[misc]
    r._pending_requests_by_id = {}
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
    # The others in one rank, in any order: Serve takes the less loaded of them.
    assert [sorted(x.replica_id.name for x in rank) for rank in ranks] == [["r1"], ["r2", "r3"]]
    # Token counting neither follows nor records affinity; foreign arguments are tolerated.
    counted = choose(r, replicas, FakePending([chat("a1", "reply", "a2")],
                                              FakeMetadata("count_tokens")))
    assert len(counted[0]) == 2
    assert len(choose(r, replicas, FakePending(["not a request"], FakeMetadata("stream")))[0]) == 2


def test_a_router_that_never_saw_the_conversation_follows_the_directory() -> None:
    """Another ingress (or this one after a restart) routed turn 1: only the replicas'
    reports, the cluster prefix directory, know where its prefix lives."""
    turn1 = routing_keys(chat("a1"), "prefix")
    assert turn1 is not None
    held = {PREFIXES: frozenset(turn1.record)}
    replicas = [FakeReplica(FakeId("r1")), FakeReplica(FakeId("r2"), routing_stats=held),
                FakeReplica(FakeId("r3"))]
    r = router({"r1": 0, "r2": 1, "r3": 0})
    turn2 = FakePending([chat("a1", "reply", "a2")], FakeMetadata("stream"))
    ranks = choose(r, replicas, turn2)
    assert [sorted(x.replica_id.name for x in rank) for rank in ranks] == [["r2"], ["r1", "r3"]]
    # The call carries the holders, so a replica Serve picks instead can pull from them.
    assert turn2.kwargs == {HOLDERS: ("r2",)}
    fresh = FakePending([chat("new")], FakeMetadata("stream"))
    choose(r, replicas, fresh)
    assert fresh.kwargs == {}  # no replica holds it: nothing to pull


def test_a_pull_goes_to_the_replica_it_names_or_to_any_once_that_one_left() -> None:
    replicas = [FakeReplica(FakeId("r1")), FakeReplica(FakeId("r2")), FakeReplica(FakeId("r3"))]
    r = router({"r1": 0, "r2": 5, "r3": 0})
    pull = PrefixPull((1, 2, 3), 2, "r2")
    ranks = choose(r, replicas, FakePending([pull], FakeMetadata("export_prefix")))
    assert [[x.replica_id.name for x in rank] for rank in ranks] == [["r2"]]
    gone = PrefixPull((1, 2, 3), 2, "r9")
    ranks = choose(r, replicas, FakePending([gone], FakeMetadata("export_prefix")))
    assert len(ranks) == 1 and len(ranks[0]) == 2  # power-of-two's pair


def test_what_a_replica_holds_beats_where_a_key_was_sent() -> None:
    affinity = Affinity(max_keys=100, max_imbalance=8)
    turn1 = routing_keys(chat("a1"), "prefix")
    assert turn1 is not None
    affinity.record(turn1, "r1")
    turn2 = routing_keys(chat("a1", "reply", "a2"), "prefix")
    loads: dict[str, int | None] = {"r1": 0, "r2": 0}
    # r1 evicted it since, and r2 holds it (another router sent the conversation there).
    assert affinity.rank(turn2, loads, directory={"r2": set(turn1.record)})[0] == ["r2"]
    # Where both hold it, the one this router sent it to stays first.
    both = {"r1": set(turn1.record), "r2": set(turn1.record)}
    assert affinity.rank(turn2, loads, directory=both)[0] == ["r1"]
    # A deeper key this router recorded beats a shallower one a replica reports.
    affinity.record(turn2, "r1")  # type: ignore[arg-type]
    turn3 = routing_keys(chat("a1", "reply", "a2", "reply", "a3"), "prefix")
    assert affinity.rank(turn3, loads, directory={"r2": set(turn1.record)})[0] == ["r1"]
    # Nobody reports, nobody recorded: no preference.
    assert affinity.rank(routing_keys(chat("new"), "prefix"), loads, directory={}) == []


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


# ---- memory-aware routing (deployments.routing.headroom) ---------------------------------------


def room(free: int, budget: int = 1000, waiting: int = 0, max_waiting: int = 4,
         report: int = 0) -> ReplicaRoom:
    return ReplicaRoom(free, budget, waiting, max_waiting, report)


def test_the_cache_holder_keeps_the_turn_only_where_it_fits() -> None:
    affinity = Affinity(max_keys=100, max_imbalance=8)
    affinity.record(routing_keys(chat("a1"), "prefix"), "r1")  # type: ignore[arg-type]
    turn2 = routing_keys(chat("a1", "reply", "a2"), "prefix")
    loads: dict[str, int | None] = {"r1": 1, "r2": 0, "r3": 0}
    roomy = Room({"r1": room(500), "r2": room(900), "r3": room(300)}, tokens=400)
    assert affinity.rank(turn2, loads, roomy) == [["r1"], ["r2"], ["r3"]]
    # r1 holds the prefix but not the request's KV: the roomiest that fits goes first, r1
    # last, r3 (no room either) before it by room.
    tight = Room({"r1": room(100), "r2": room(900), "r3": room(300)}, tokens=400)
    assert affinity.rank(turn2, loads, tight) == [["r2"], ["r3"], ["r1"]]
    # A full queue of requests waiting for memory refuses as surely as no room.
    queued = Room({"r1": room(900, waiting=4), "r2": room(500), "r3": room(500)}, tokens=400)
    assert affinity.rank(turn2, loads, queued)[-1] == ["r1"]


def test_without_a_prefix_the_roomiest_replica_goes_first_unless_rooms_are_even() -> None:
    affinity = Affinity(max_keys=100, max_imbalance=8)
    fresh = routing_keys(chat("new"), "prefix")
    loads: dict[str, int | None] = {"r1": 0, "r2": 0, "r3": 0}
    uneven = Room({"r1": room(200), "r2": room(950), "r3": room(900)}, tokens=100)
    ranks = affinity.rank(fresh, loads, uneven)
    assert sorted(ranks[0]) == ["r2", "r3"] and ranks[1:] == [["r1"]]  # within 10%: a tie
    even = Room({"r1": room(900), "r2": room(950), "r3": room(880)}, tokens=100)
    assert affinity.rank(fresh, loads, even) == []  # power-of-two, by load
    assert Room({r: None for r in loads}, tokens=100).even(list(loads))  # none reported
    # One not reported yet (just started) is taken as the roomiest.
    fresh_replica = Room({"r1": room(900), "r2": room(950), "r3": None}, tokens=100)
    assert affinity.rank(fresh, loads, fresh_replica)[0] == ["r3"]
    assert affinity.rank(None, loads, uneven)[1:] == [["r1"]]  # no keys at all: the same


def test_shed_only_when_every_replica_reported_and_each_would_refuse() -> None:
    full = {"waiting": 4}  # room(...)'s max_waiting is 4: the queue for memory is full
    assert Room({"r1": room(100, **full), "r2": room(300, **full)}, tokens=400).shed
    # A replica without room but with place in its queue takes it: it waits there.
    assert not Room({"r1": room(100, **full), "r2": room(100)}, tokens=400).shed
    assert not Room({"r1": room(100, **full), "r2": room(500, **full)}, tokens=400).shed
    assert not Room({"r1": room(100, **full), "r2": None}, tokens=400).shed  # not reported
    # Past every whole budget: the replica's 400 (prompt too long), not an overload.
    assert not Room({"r1": room(100, **full), "r2": room(100, **full)}, tokens=4000).shed
    # max_waiting 0: nothing waits, so only room decides.
    assert Room({"r1": room(100, max_waiting=0)}, tokens=400).shed
    assert not Room({"r1": room(900, max_waiting=0)}, tokens=400).shed


def test_what_a_request_needs() -> None:
    assert prompt_tokens(GenerationRequest("r", "m", TokenPrompt(tuple(range(300))))) == 300
    assert prompt_tokens(GenerationRequest("r", "m", TextPrompt("x" * 400))) == 100
    resumed = GenerationRequest("r", "m", TextPrompt("x" * 400), resume=(1, 2, 3))
    assert prompt_tokens(resumed) == 103
    tools = (ToolSpec("search", "find things", '{"type": "object"}'),)
    assert prompt_tokens(chat("a" * 40, tools=tools)) > prompt_tokens(chat("a" * 40))


def test_a_replica_reports_its_room_in_tokens() -> None:
    from replicas.engine.kv.layout import KvLayout
    from replicas.engine.kv.budget import MemoryStats

    memory = MemoryStats(budget_bytes=1024 * 1000, projected_bytes=1024 * 600, waiting=2,
                         refused=0, layout=KvLayout(per_token=1024))
    stats = ReplicaRoom.of(memory, max_waiting=4, report=7).stats()
    assert ReplicaRoom.read(stats) == ReplicaRoom(400, 1000, 2, 4, 7)
    assert ReplicaRoom.read({}) is None


def test_the_ledger_counts_what_was_sent_until_a_report_can_have_counted_it() -> None:
    now = [100.0]
    ledger = Ledger(clock=lambda: now[0])
    ledger.sent("r1", 300)
    now[0] = 100.5
    ledger.sent("r1", 200)
    stale = room(900, report=100_200).stats()  # made 0.2 s after the first send: too soon
    assert ledger.room("r1", stale) == room(400, report=100_200)
    # A report ADMIT_LAG_S after the first send counts it; the second is still ours.
    assert ledger.room("r1", room(600, report=101_100).stats()) == room(400, report=101_100)
    assert ledger.room("r1", room(600, report=101_600).stats()) == room(600, report=101_600)
    ledger.sent("r2", 50)
    ledger.forget({"r1"})
    assert ledger.room("r2", room(90, report=0).stats()) == room(90, report=0)


def test_the_router_sheds_with_the_overload_error_and_prefers_room() -> None:
    stats = {"r1": room(100, max_waiting=0).stats(), "r2": room(100, max_waiting=0).stats()}
    replicas = [FakeReplica(FakeId(r), routing_stats=s) for r, s in stats.items()]
    r = router({"r1": 0, "r2": 0}, replicas)

    async def shed() -> BaseException | None:
        pending = FakePending([GenerationRequest("big", "m", TokenPrompt(tuple(range(400))))],
                              FakeMetadata("stream"))
        index: dict[str, Any] = r._pending_requests_by_id  # Serve's index of pending requests
        index[pending.metadata.internal_request_id] = pending
        ranks = await r.choose_replicas(replicas, pending)  # type: ignore[arg-type]
        assert ranks == [replicas]  # something, so Serve sees the future done and stops
        assert not r._pending_requests_by_id  # dropped from Serve's index, as if cancelled
        return pending.future.exception()

    error = asyncio.run(shed())
    assert isinstance(error, MemoryShed) and isinstance(error, BackPressureError)
    assert "no replica of the model 'm' has KV memory" in str(error)
    # A small request still fits: routed, to the roomier replica once r2 has room.
    replicas[1] = FakeReplica(FakeId("r2"), routing_stats=room(900, max_waiting=0).stats())
    small = FakePending([GenerationRequest("s", "m", TokenPrompt(tuple(range(50))))],
                        FakeMetadata("stream"))
    ranks = choose(r, replicas, small)
    assert [[x.replica_id.name for x in rank] for rank in ranks] == [["r2"], ["r1"]]
    # What the router sent r2 counts against it until a report of r2's can count it.
    r.on_request_routed(small, FakeId("r2"), None)  # type: ignore[arg-type]
    big = FakePending([GenerationRequest("b", "m", TokenPrompt(tuple(range(870))))],
                      FakeMetadata("stream"))
    ranks = choose(r, replicas, big)
    assert big.future.exception() is not None  # 900 - 50 left on r2: not enough for 870
