"""`/v1/embeddings` in a real `ModelReplica` without Ray: `builtin:embed` (an embedding
checkpoint found by its sentence-transformers files) and the chat model `builtin:tiny`
(refused, or opted in by config), the engine's `call` mechanism the forwards run through,
and the colocated client over the replica, driven by the official `openai` SDK."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import mlx.core as mx
import openai
import pytest
from fastapi.testclient import TestClient

from deployments.model_clients import LocalModelClient
from ingress.app import create_app
from ingress.client import ModelCard
from replicas.contract import (
    EmbeddingRequest,
    EmbeddingResult,
    ErrorKind,
    Failed,
    Finished,
    FinishReason,
    SamplingParams,
    TextDelta,
    TextPrompt,
    GenerationRequest,
)
from replicas import embedder as embedder_module
from replicas.embedder import Embedder
from replicas.engine.core import EngineDead
from replicas.engine.model.embedding import MAX_ROWS
from replicas.replica import ModelReplica, ReplicaOptions
from replicas.timings import Timings
from tests.streams import collect

# Max abs difference between a vector embedded in a batch and the same input alone.
TOLERANCE = 1e-4
TEXTS = ("The weather in Paris is sunny.", "hi", "Tokyo, Delhi and Shanghai are large cities "
         "with many people living in them, and this sentence is the longest of the lot.")
WIDTH = 256  # builtin:embed's hidden size
MAX_TOKENS = 2048  # its sentence_bert_config.json's max_seq_length


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def embed(replica: ModelReplica, *inputs: Any, dimensions: int | None = None
          ) -> EmbeddingResult | Failed:
    result: EmbeddingResult | Failed = run(replica.embed(
        EmbeddingRequest("e1", "orchard-embed", tuple(inputs), dimensions)))
    return result


def vectors(replica: ModelReplica, *inputs: Any, dimensions: int | None = None
            ) -> tuple[tuple[float, ...], ...]:
    result = embed(replica, *inputs, dimensions=dimensions)
    assert isinstance(result, EmbeddingResult), result
    return result.vectors


def max_diff(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def embedder() -> Iterator[ModelReplica]:
    rep = ModelReplica(ReplicaOptions(model_id="orchard-embed", source="builtin:embed",
                                      embedding_dimensions=True))
    rep.start()
    yield rep
    rep.shutdown()


def test_vectors_are_the_reference_pooling(embedder: ModelReplica) -> None:
    got = vectors(embedder, *TEXTS)
    model = embedder.model
    ids = [model.hf_tokenizer.encode(t, add_special_tokens=True) for t in TEXTS]
    eos = model.hf_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert all(row[-1] == eos for row in ids)  # the tokenizer appends the pooled token

    def reference() -> list[list[float]]:  # on the engine thread, which owns MLX
        out = []
        for row in ids:
            last = model.model.model(mx.array([row]))[0, -1].astype(mx.float32)
            out.append((last / mx.linalg.norm(last)).tolist())
        return out

    want = embedder._engine.call(reference).result(timeout=60)
    for vector, expected in zip(got, want, strict=True):
        assert len(vector) == WIDTH
        assert max_diff(vector, tuple(expected)) <= TOLERANCE
        assert math.isclose(math.fsum(x * x for x in vector), 1.0, rel_tol=1e-5)


def test_the_same_text_alone_and_in_a_batch(embedder: ModelReplica) -> None:
    batch = vectors(embedder, *TEXTS)
    for text, batched in zip(TEXTS, batch):
        (alone,) = vectors(embedder, text)
        assert max_diff(alone, batched) <= TOLERANCE


def test_token_ids_embed_as_the_text_they_encode(embedder: ModelReplica) -> None:
    ids = tuple(embedder.model.hf_tokenizer.encode(TEXTS[0], add_special_tokens=True))
    from_ids, from_text = vectors(embedder, ids, TEXTS[0])
    assert max_diff(from_ids, from_text) <= TOLERANCE
    result = embed(embedder, ids, TEXTS[0])
    assert isinstance(result, EmbeddingResult) and result.prompt_tokens == 2 * len(ids)


def test_dimensions_truncate_and_renormalize(embedder: ModelReplica) -> None:
    (full,), (short,) = vectors(embedder, TEXTS[0]), vectors(embedder, TEXTS[0], dimensions=32)
    assert len(short) == 32
    norm = math.sqrt(math.fsum(x * x for x in full[:32]))
    assert max_diff(short, tuple(x / norm for x in full[:32])) <= TOLERANCE


@pytest.mark.parametrize(("inputs", "dimensions", "kind", "param", "says"), [
    (((1,) * (MAX_TOKENS + 1),), None, ErrorKind.CONTEXT_LENGTH, "input",
     f"at most {MAX_TOKENS}"),
    (("ok", (3, 10**6)), None, ErrorKind.INVALID_REQUEST, "input", "input[1]: token id"),
    (("ok",), WIDTH + 1, ErrorKind.INVALID_REQUEST, "dimensions", f"between 1 and {WIDTH}"),
])
def test_refusals(embedder: ModelReplica, inputs: tuple[Any, ...], dimensions: int | None,
                  kind: ErrorKind, param: str, says: str) -> None:
    result = embed(embedder, *inputs, dimensions=dimensions)
    assert isinstance(result, Failed) and result.kind is kind and result.param == param
    assert says in result.message and not result.replica_fault


def test_embeddings_are_counted_for_metrics(embedder: ModelReplica) -> None:
    embedder.drain_timings()
    vectors(embedder, *TEXTS)
    (counted,) = embedder.drain_timings().embeddings
    assert counted[0] == len(TEXTS) and counted[1] > len(TEXTS)


def test_embeddings_run_between_the_steps_of_a_generation(embedder: ModelReplica) -> None:
    # builtin:embed has a head too (random), so it can generate: a long greedy completion
    # with embeddings arriving meanwhile ends as it does alone, and every embedding too.
    request = GenerationRequest("g1", "orchard-embed", TextPrompt("Once upon a time"),
                                SamplingParams(max_tokens=96, temperature=0.0))

    async def together() -> tuple[list[Any], list[EmbeddingResult | Failed]]:
        stream = embedder.stream(request)
        first = await anext(stream)  # the generation is in the batch now
        results = [await embedder.embed(EmbeddingRequest(f"e{i}", "orchard-embed", TEXTS))
                   for i in range(4)]
        return first + await collect(stream), results

    def answer(events: list[Any]) -> str:
        return "".join(e.text for e in events if isinstance(e, TextDelta))

    alone = run(collect(embedder.stream(request)))
    events, results = run(together())
    assert answer(events) == answer(alone) != ""
    assert isinstance(events[-1], Finished) and events[-1].reason is FinishReason.LENGTH
    batch = vectors(embedder, *TEXTS)
    for result in results:
        assert isinstance(result, EmbeddingResult)
        assert all(max_diff(a, b) <= TOLERANCE for a, b in zip(result.vectors, batch))


def test_the_call_mechanism_runs_on_the_engine_thread_and_fails_cleanly() -> None:
    replica = ModelReplica(ReplicaOptions(model_id="orchard-embed", source="builtin:embed"))
    replica.start()
    engine = replica._engine
    try:
        assert engine.call(lambda: threading.current_thread().name).result(60) == \
            "orchard-engine"
        with pytest.raises(ZeroDivisionError):  # the caller's exception, the engine runs on
            engine.call(lambda: 1 // 0).result(60)
        assert engine.call(lambda: 2 + 2).result(60) == 4
        # One call holds the engine thread; the next waits in the queue when it dies.
        holding, release = threading.Event(), threading.Event()
        first = engine.call(lambda: holding.set() or release.wait(60))
        assert holding.wait(60)
        queued: Future[int] = engine.call(lambda: 1)
        replica.abort("a shard was lost")
        with pytest.raises(EngineDead, match="a shard was lost"):
            queued.result(60)
        release.set()
        assert first.result(60) is True  # the running one still finishes
        with pytest.raises(EngineDead):
            engine.call(lambda: 1)
        failed = embed(replica, "hello")
        assert isinstance(failed, Failed) and failed.replica_fault
        assert failed.kind is ErrorKind.INTERNAL
    finally:
        release.set()
        replica.shutdown()


@pytest.fixture(scope="module")
def tiny_mean() -> Iterator[ModelReplica]:
    rep = ModelReplica(ReplicaOptions(model_id="orchard-tiny-mean", source="builtin:tiny",
                                      embeddings="mean"))
    rep.start()
    yield rep
    rep.shutdown()


def test_a_chat_model_without_opt_in_answers_400(replica: ModelReplica) -> None:
    result = run(replica.embed(EmbeddingRequest("e1", "orchard-tiny", ("hello",))))
    assert isinstance(result, Failed) and result.kind is ErrorKind.INVALID_REQUEST
    assert result.param == "model" and "does not serve embeddings" in result.message
    assert "embeddings: last_token" in result.message


def test_a_chat_model_opted_in_pools_the_mean(tiny_mean: ModelReplica) -> None:
    (vector,) = vectors(tiny_mean, "hello there")
    ids = tiny_mean.model.hf_tokenizer.encode("hello there", add_special_tokens=True)

    def reference() -> list[float]:
        mean = tiny_mean.model.model.model(mx.array([ids]))[0].astype(mx.float32).mean(axis=0)
        return (mean / mx.linalg.norm(mean)).tolist()

    want = tiny_mean._engine.call(reference).result(timeout=60)
    assert len(vector) == 128 and max_diff(vector, tuple(want)) <= TOLERANCE
    refused = embed(tiny_mean, "x", dimensions=8)  # no `embedding_dimensions` for it
    assert isinstance(refused, Failed) and refused.param == "dimensions"


def test_the_colocated_client_through_the_sdk(embedder: ModelReplica) -> None:
    card = ModelCard("orchard-embed", capabilities=("embeddings",))
    http = TestClient(create_app(LocalModelClient(embedder, card, max_ongoing=4)))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                           max_retries=0)
    batch = vectors(embedder, *TEXTS)
    for encoding in ("float", None):  # None: the SDK asks for base64 and decodes it
        extra = {} if encoding is None else {"encoding_format": encoding}
        result = client.embeddings.create(model="orchard-embed", input=list(TEXTS), **extra)
        assert [d.index for d in result.data] == [0, 1, 2]
        for item, want in zip(result.data, batch):
            assert max_diff(tuple(item.embedding), want) <= TOLERANCE
    with pytest.raises(openai.BadRequestError, match="at most 2048"):
        client.embeddings.create(model="orchard-embed", input=[[1] * (MAX_TOKENS + 1)])


def test_requests_at_once_share_forwards(embedder: ModelReplica) -> None:
    """Sixteen one-input requests arriving together (half of them truncated by
    `dimensions`) take fewer forwards than requests, and each vector is as alone."""
    asks = [(TEXTS[i % len(TEXTS)], 64 if i % 2 else None) for i in range(16)]
    alone = [vectors(embedder, text, dimensions=dims)[0] for text, dims in asks]
    before = embedder.embedder.forwards

    async def together() -> list[EmbeddingResult | Failed]:
        return list(await asyncio.gather(*(embedder.embed(EmbeddingRequest(
            f"s{i}", "orchard-embed", (text,), dims)) for i, (text, dims) in enumerate(asks))))

    results = run(together())
    forwards = embedder.embedder.forwards - before
    assert 1 <= forwards < len(asks)
    for result, expected in zip(results, alone):
        assert isinstance(result, EmbeddingResult)
        assert max_diff(result.vectors[0], expected) <= TOLERANCE


class Gate:
    """An `Engine.call` the test steps: each call waits here until `step` runs it on the
    replica's engine thread, so the test decides what is queued before each forward."""

    def __init__(self, replica: ModelReplica) -> None:
        self._engine = replica._engine
        self.pending: list[tuple[Any, Future[Any]]] = []  # appended from the engine thread too

    def __call__(self, fn: Any) -> Future[Any]:
        done: Future[Any] = Future()
        self.pending.append((fn, done))
        return done

    async def step(self) -> None:
        fn, done = self.pending.pop(0)
        done.set_result(await asyncio.wrap_future(self._engine.call(fn)))


async def until(check: Any, timeout_s: float = 10.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def gated_embedder(replica: ModelReplica, gate: Gate) -> Embedder:
    return Embedder.open(replica.options, replica.model, replica.context_length, gate,
                         Timings())


def test_the_oldest_request_leads_the_next_forward(embedder: ModelReplica) -> None:
    """A long input, then a full forward's worth of one-token requests before every forward:
    sorted by length, the short ones would take every forward while they keep coming."""
    long_ids = (11,) * 40  # longer than the others; 64 rows of it fit one forward's bytes
    (alone,) = vectors(embedder, long_ids)
    short_alone = vectors(embedder, "hi")[0]

    async def scenario() -> tuple[int, list[EmbeddingResult]]:
        gate = Gate(embedder)
        gated = gated_embedder(embedder, gate)
        old = asyncio.create_task(gated.embed(EmbeddingRequest("old", "e", (long_ids,))))
        assert await until(lambda: len(gate.pending) == 1)
        shorts: list[asyncio.Task[EmbeddingResult]] = []
        forwards = 0
        while not old.done() and forwards < 4:
            before = len(gate.pending)  # each request queues one call once it is queued
            shorts += [asyncio.create_task(gated.embed(EmbeddingRequest(
                f"s{forwards}.{i}", "e", ("hi",)))) for i in range(MAX_ROWS)]
            assert await until(lambda: len(gate.pending) == before + MAX_ROWS)
            await gate.step()
            forwards += 1
            await until(old.done, timeout_s=1.0)
        assert old.done(), "the first request's input waited behind later short ones"
        while gate.pending:  # the rest, to check them too
            await gate.step()
        return forwards, [await old, *[await t for t in shorts]]

    forwards, results = run(scenario())
    assert forwards == 1
    assert max_diff(results[0].vectors[0], alone) <= TOLERANCE
    assert all(max_diff(r.vectors[0], short_alone) <= TOLERANCE for r in results[1:])


def test_a_cancelled_request_leaves_the_queue(embedder: ModelReplica,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    forwarded: list[int] = []  # rows per forward
    real = embedder_module.embed_rows

    def counting(model: Any, rows: Any, *args: Any) -> Any:
        forwarded.append(len(rows))
        return real(model, rows, *args)

    monkeypatch.setattr(embedder_module, "embed_rows", counting)

    async def scenario() -> EmbeddingResult:
        gate = Gate(embedder)
        gated = gated_embedder(embedder, gate)
        left = asyncio.create_task(gated.embed(EmbeddingRequest("left", "e", TEXTS * 30)))
        assert await until(lambda: len(gate.pending) == 1)
        stays = asyncio.create_task(gated.embed(EmbeddingRequest("stays", "e", TEXTS[:1])))
        assert await until(lambda: len(gate.pending) == 2)
        left.cancel()  # as Serve cancels the call when the client disconnects
        with pytest.raises(asyncio.CancelledError):
            await left
        while gate.pending:
            await gate.step()
        return await stays

    result = run(scenario())
    assert forwarded == [1]  # the cancelled request's 90 inputs never ran
    assert max_diff(result.vectors[0], vectors(embedder, TEXTS[0])[0]) <= TOLERANCE


def test_a_client_leaving_through_the_replica_stops_its_forwards(
        embedder: ModelReplica, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real path: `ModelReplica.embed` on its engine thread, the caller's task cancelled
    while its inputs wait behind a running forward (a held engine thread here)."""
    forwarded: list[int] = []
    real = embedder_module.embed_rows

    def counting(model: Any, rows: Any, *args: Any) -> Any:
        forwarded.append(len(rows))
        return real(model, rows, *args)

    monkeypatch.setattr(embedder_module, "embed_rows", counting)
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(60)

    async def scenario() -> EmbeddingResult | Failed:
        held = embedder._engine.call(hold)
        assert holding.wait(60)
        left = asyncio.create_task(embedder.embed(EmbeddingRequest("left", "e", TEXTS * 50)))
        await asyncio.sleep(0.5)  # tokenized and queued behind the held engine
        left.cancel()
        with pytest.raises(asyncio.CancelledError):
            await left
        stays = asyncio.create_task(embedder.embed(EmbeddingRequest("stays", "e", TEXTS)))
        await asyncio.sleep(0.5)
        release.set()
        await asyncio.wrap_future(held)
        return await stays

    try:
        result = run(scenario())
    finally:
        release.set()
    assert isinstance(result, EmbeddingResult) and len(result.vectors) == len(TEXTS)
    assert forwarded == [len(TEXTS)]  # 150 inputs would have been 3 forwards of 64 first
