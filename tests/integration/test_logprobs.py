"""Token logprobs from the real tiny model: they are the distribution the token was sampled
from (post-processor, post-temperature), checked against a direct forward pass."""

from __future__ import annotations

import asyncio
import math

import mlx.core as mx
import pytest

from replicas.contract import (
    Channel,
    ChatMessage,
    ChatPrompt,
    Finished,
    GenerationRequest,
    OutputEvent,
    SamplingParams,
    TextDelta,
    TextPrompt,
    TokenLogprob,
)
from replicas.errors import InvalidRequestError
from replicas.replica import ModelReplica
from tests.streams import collect, stream_events

PROMPT = "The quick brown fox"


def request(rid: str, **sampling: object) -> GenerationRequest:
    return GenerationRequest(rid, "tiny", TextPrompt(PROMPT),
                             sampling=SamplingParams(**sampling))  # type: ignore[arg-type]


def entries(events: list[OutputEvent]) -> list[TokenLogprob]:
    return [e for ev in events if isinstance(ev, TextDelta) for e in ev.logprobs]


def text(events: list[OutputEvent]) -> str:
    return "".join(ev.text for ev in events if isinstance(ev, TextDelta))


def finished(events: list[OutputEvent]) -> Finished:
    end = events[-1]
    assert isinstance(end, Finished), end
    return end


def first_token_logprobs(replica: ModelReplica) -> mx.array:
    """log_softmax of the model's logits for the token after the prompt, computed here."""
    loaded = replica._engine.wait_ready(1)
    ids = replica.inputs.render(request("x")).token_ids
    logits = loaded.model(mx.array([list(ids)]))[0, -1].astype(mx.float32)
    return logits - mx.logsumexp(logits)


def test_greedy_logprobs_are_the_models_distribution(replica: ModelReplica) -> None:
    events = stream_events(replica, request("g", temperature=0.0, max_tokens=8, logprobs=5))
    got = entries(events)
    assert len(got) == finished(events).usage.completion_tokens - (
        1 if finished(events).reason.value in ("eos", "stop_token") else 0)
    assert "".join(e.token for e in got) == text(events)
    for entry in got:
        assert len(entry.top) == 5
        values = [lp for _, lp in entry.top]
        assert values == sorted(values, reverse=True)
        # greedy: the chosen token is the argmax, so it heads its own top list
        assert entry.top[0] == (entry.token, entry.logprob)
        assert entry.logprob <= 0
        assert sum(math.exp(v) for v in values) <= 1 + 1e-4
    reference = first_token_logprobs(replica)
    first = got[0]
    assert first.token_id == int(mx.argmax(reference).item())
    assert first.logprob == pytest.approx(reference[first.token_id].item(), abs=2e-3)
    top_ids = mx.argsort(-reference)[:5].tolist()
    assert [lp for _, lp in first.top] == pytest.approx(
        [reference[i].item() for i in top_ids], abs=2e-3)


def test_logprobs_are_after_temperature(replica: ModelReplica) -> None:
    reference = first_token_logprobs(replica)
    for temperature in (0.5, 1.0):
        events = stream_events(replica, request(f"t{temperature}", temperature=temperature,
                                                max_tokens=1, logprobs=3, seed=7))
        first = entries(events)[0]
        tempered = reference / temperature
        tempered = tempered - mx.logsumexp(tempered)
        assert first.logprob == pytest.approx(tempered[first.token_id].item(), abs=2e-3)
        top_ids = mx.argsort(-tempered)[:3].tolist()
        assert [lp for _, lp in first.top] == pytest.approx(
            [tempered[i].item() for i in top_ids], abs=2e-3)
    # a sharper distribution: the most likely token is likelier at 0.5 than at 1.0
    half = stream_events(replica, request("h", temperature=0.5, max_tokens=1, logprobs=1, seed=1))
    one = stream_events(replica, request("o", temperature=1.0, max_tokens=1, logprobs=1, seed=1))
    assert entries(half)[0].top[0][1] > entries(one)[0].top[0][1]


def test_no_logprobs_unless_asked(replica: ModelReplica) -> None:
    events = stream_events(replica, request("n", temperature=0.0, max_tokens=6))
    assert text(events) and not entries(events)


def test_chat_logprobs_cover_every_text_token(replica: ModelReplica) -> None:
    chat = GenerationRequest("c", "tiny", ChatPrompt((ChatMessage("user", "Say hi"),)),
                             sampling=SamplingParams(temperature=0.0, max_tokens=12,
                                                     logprobs=0))
    events = stream_events(replica, chat)
    got = entries(events)
    assert got and all(e.top == () for e in got)
    end = finished(events)
    stops = 1 if end.reason.value in ("eos", "stop_token") else 0
    assert len(got) == end.usage.completion_tokens - stops
    assert all(d.channel is Channel.ANSWER or d.channel is Channel.REASONING
               for d in events if isinstance(d, TextDelta))


def test_rows_with_and_without_logprobs_share_a_batch(replica: ModelReplica) -> None:
    async def both() -> tuple[list[OutputEvent], list[OutputEvent]]:
        a, b = await asyncio.gather(
            collect(replica.stream(request("a", temperature=0.0, max_tokens=10, logprobs=2))),
            collect(replica.stream(request("b", temperature=0.0, max_tokens=10))))
        return a, b
    a, b = asyncio.run(both())
    assert text(a) == text(b)  # logprobs do not change what is generated
    assert entries(a) and not entries(b)


def test_top_logprobs_bound(replica: ModelReplica) -> None:
    with pytest.raises(InvalidRequestError):
        replica.inputs.prepare(request("bad", logprobs=21), None)  # type: ignore[arg-type]


# ---- echo: the prompt's own logprobs ---------------------------------------------------

LONG_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)


def prompt_reference(replica: ModelReplica, prompt: str) -> tuple[list[int], mx.array]:
    """The prompt's ids and log_softmax at every position, from one direct forward pass."""
    loaded = replica._engine.wait_ready(1)
    ids = list(replica.inputs.render(GenerationRequest("r", "tiny", TextPrompt(prompt)))
               .token_ids)
    logits = loaded.model(mx.array([ids]))[0].astype(mx.float32)
    return ids, logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def echo_request(rid: str, prompt: str, **sampling: object) -> GenerationRequest:
    return GenerationRequest(rid, "tiny", TextPrompt(prompt), echo=True,
                             sampling=SamplingParams(**sampling))  # type: ignore[arg-type]


@pytest.mark.parametrize("prompt", [PROMPT, LONG_PROMPT])
def test_echo_scores_the_prompt_with_the_models_distribution(replica: ModelReplica,
                                                             prompt: str) -> None:
    ids, reference = prompt_reference(replica, prompt)
    events = stream_events(replica, echo_request("e", prompt, temperature=0.0, max_tokens=4,
                                                 logprobs=3))
    plain = stream_events(replica, request("p", temperature=0.0, max_tokens=4))
    first = events[0]
    assert isinstance(first, TextDelta) and first.text.startswith(prompt)
    got = entries(events)
    prompt_entries, generated = got[:len(ids)], got[len(ids):]
    assert [e.token_id for e in prompt_entries] == ids
    assert prompt_entries[0].logprob is None and prompt_entries[0].top == ()
    want = [reference[i - 1, t].item() for i, t in enumerate(ids) if i]
    assert [e.logprob for e in prompt_entries[1:]] == pytest.approx(want, abs=2e-3)
    for i, entry in enumerate(prompt_entries[1:], start=1):
        top_ids = mx.argsort(-reference[i - 1])[:3].tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(
            [reference[i - 1, j].item() for j in top_ids], abs=2e-3)
    # Echo changes nothing about the generation that follows it.
    assert text(events) == prompt + text(plain) if prompt == PROMPT else text(events).startswith(prompt)
    if prompt == PROMPT:
        assert [e.token_id for e in generated] == [e.token_id for e in entries(
            stream_events(replica, request("p2", temperature=0.0, max_tokens=4, logprobs=3)))]
    assert finished(events).usage.prompt_tokens == len(ids)


def test_echo_prefills_the_prompt_once(replica: ModelReplica) -> None:
    """The scoring pass leaves the prompt's KV in the prefix cache: the generation after it
    prefills one token (usage counts the rest as cached)."""
    prompt = LONG_PROMPT + " once"
    ids, _ = prompt_reference(replica, prompt)
    events = stream_events(replica, echo_request("once", prompt, temperature=0.0, max_tokens=2,
                                                 logprobs=0))
    assert finished(events).usage.cached_tokens == len(ids) - 1


def test_echo_without_logprobs_is_the_prompt_then_the_answer(replica: ModelReplica) -> None:
    events = stream_events(replica, echo_request("plain", PROMPT, temperature=0.0, max_tokens=4))
    plain = stream_events(replica, request("p3", temperature=0.0, max_tokens=4))
    assert text(events) == PROMPT + text(plain)
    assert not entries(events)


def test_scoring_in_chunks_agrees_with_one_pass(replica: ModelReplica) -> None:
    from replicas.engine.batch.scoring import score_prompt

    loaded = replica._engine.wait_ready(1)
    ids, _ = prompt_reference(replica, LONG_PROMPT)
    stream = mx.new_stream(mx.default_device())
    whole, _ = score_prompt(loaded.model, ids, 2, 4096, stream)
    for chunk in (1, 7, 64):
        pieces, cache = score_prompt(loaded.model, ids, 2, chunk, stream)
        assert [p.logprob for p in pieces] == pytest.approx([p.logprob for p in whole], abs=2e-3)
        assert [[i for i, _ in p.top] for p in pieces] == [[i for i, _ in p.top] for p in whole]
        assert cache[0].offset == len(ids)


def test_echo_is_for_completions_only(replica: ModelReplica) -> None:
    chat = GenerationRequest("c", "tiny", ChatPrompt((ChatMessage("user", "Say hi"),)), echo=True)
    with pytest.raises(InvalidRequestError):
        replica.inputs.prepare(chat, None)  # type: ignore[arg-type]
