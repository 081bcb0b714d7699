"""`/v1/rerank` in a real `ModelReplica` without Ray, on the two kinds of reranker:
`builtin:rerank` (a Qwen3-Reranker-style decoder, `kind: rerank`) against mlx-lm's own
model call on Qwen3-Reranker's template written out here, and `builtin:cross-encoder`
(mlx-embeddings' ModernBERT with its classification head) against mlx-embeddings' own
forward on the tokenizer's pair encoding. Batched scores equal one-at-a-time scores; the
refusals are 400s; the colocated client serves the route over HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import mlx.core as mx
import pytest
from fastapi.testclient import TestClient

from deployments.model_clients import LocalModelClient
from ingress.app import create_app
from ingress.client import ModelCard
from replicas.contract import ErrorKind, Failed, RerankRequest, RerankResult
from replicas.engine.model.loading import load_model
from replicas.replica import ModelReplica, ReplicaOptions
from replicas.reranker import NotReranker, RerankUnsupported, rerank_kind
from replicas.sources import resolve_source

# Max abs difference between a score in a batch and the library's forward of the pair alone.
TOLERANCE = 1e-5
QUERY = "What is the weather in Paris?"
DOCS = ("The weather in Paris is sunny.", "hi",
        "Tokyo, Delhi and Shanghai are large cities with many people living in them, and "
        "this document is the longest of the lot.", "Paris", "It is raining in Rome today.")
# Qwen3-Reranker's model card, written out (not imported) so the test checks the template.
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on "
          "the Query and the Instruct provided. Note that the answer can only be \"yes\" or "
          "\"no\".<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def rerank(replica: ModelReplica, *docs: str, query: str = QUERY, **options: Any
           ) -> RerankResult | Failed:
    result: RerankResult | Failed = asyncio.run(replica.rerank(
        RerankRequest("r1", replica.options.model_id, query, tuple(docs), **options)))
    return result


def scores(replica: ModelReplica, *docs: str, **options: Any) -> tuple[float, ...]:
    result = rerank(replica, *docs, **options)
    assert isinstance(result, RerankResult), result
    return result.scores


@pytest.fixture(scope="module")
def decoder() -> Iterator[ModelReplica]:
    rep = ModelReplica(ReplicaOptions(model_id="orchard-rerank", source="builtin:rerank",
                                      kind="rerank"))
    rep.start()
    yield rep
    rep.shutdown()


@pytest.fixture(scope="module")
def bert_cross() -> Iterator[ModelReplica]:
    rep = ModelReplica(ReplicaOptions(model_id="orchard-bert-cross",
                                      source="builtin:cross-encoder-bert"))
    rep.start()
    yield rep
    rep.shutdown()


@pytest.fixture(scope="module")
def cross() -> Iterator[ModelReplica]:
    rep = ModelReplica(ReplicaOptions(model_id="orchard-cross", source="builtin:cross-encoder"))
    rep.start()
    yield rep
    rep.shutdown()


def decoder_reference(replica: ModelReplica, docs: tuple[str, ...],
                      instruction: str = INSTRUCTION) -> list[float]:
    """mlx-lm's model call on each pair alone: softmax over the "no" and "yes" logits."""
    model = replica.model
    tok = model.hf_tokenizer
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    rows = [tok.encode(PREFIX, add_special_tokens=False)
            + tok.encode(f"<Instruct>: {instruction}\n<Query>: {QUERY}\n<Document>: {d}",
                         add_special_tokens=False)
            + tok.encode(SUFFIX, add_special_tokens=False) for d in docs]

    def run() -> list[float]:  # on the engine thread, which owns MLX
        out = []
        for row in rows:
            logits = model.model(mx.array([row]))[0, -1].astype(mx.float32)
            out.append(mx.softmax(mx.stack([logits[no], logits[yes]]))[1].item())
        return out

    return replica._engine.call(run).result(timeout=120)  # type: ignore[no-any-return]


def test_decoder_scores_are_mlx_lm_yes_no(decoder: ModelReplica) -> None:
    got = scores(decoder, *DOCS)
    want = decoder_reference(decoder, DOCS)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= TOLERANCE
    assert len({round(s, 4) for s in got}) == len(DOCS)  # random weights, distinct scores
    assert all(0.0 < s < 1.0 for s in got)


def test_decoder_batch_is_one_forward_and_equals_alone(decoder: ModelReplica) -> None:
    before = decoder.reranker.forwards
    batched = scores(decoder, *DOCS)
    assert decoder.reranker.forwards == before + 1  # every pair in one padded forward
    alone = [scores(decoder, d)[0] for d in DOCS]
    assert max(abs(a - b) for a, b in zip(batched, alone, strict=True)) <= TOLERANCE


def test_decoder_instruction_and_usage(decoder: ModelReplica) -> None:
    result = rerank(decoder, *DOCS[:2], instruction="Find weather reports")
    assert isinstance(result, RerankResult)
    want = decoder_reference(decoder, DOCS[:2], "Find weather reports")
    assert max(abs(a - b) for a, b in zip(result.scores, want)) <= TOLERANCE
    pairs = decoder.reranker.pairs(RerankRequest("r", "m", QUERY, DOCS[:2],
                                                 instruction="Find weather reports"))
    assert result.prompt_tokens == sum(len(p.ids) for p in pairs)


def test_max_tokens_per_doc_scores_the_cut_document(decoder: ModelReplica) -> None:
    tok = decoder.model.hf_tokenizer
    doc = DOCS[2]
    ids = tok.encode(doc, add_special_tokens=False)
    assert len(ids) > 5
    cut = tok.decode(ids[:5])
    (got,) = scores(decoder, doc, max_tokens_per_doc=5)
    (want,) = decoder_reference(decoder, (cut,))
    assert abs(got - want) <= TOLERANCE
    assert scores(decoder, "hi", max_tokens_per_doc=5) == scores(decoder, "hi")


def test_decoder_refusals(decoder: ModelReplica) -> None:
    long = rerank(decoder, "ok", "word " * 5000)
    assert isinstance(long, Failed) and long.kind == ErrorKind.CONTEXT_LENGTH
    assert long.param == "documents" and "documents[1]" in long.message
    assert isinstance(rerank(decoder, "ok", "word " * 5000, max_tokens_per_doc=100),
                      RerankResult)
    # the same model without `kind: rerank` is no reranker; the replica keeps serving
    plain = rerank_kind(replace(decoder.options, kind="auto"), decoder.model, False)
    assert isinstance(plain, NotReranker) and "kind: rerank" in plain.reason
    assert isinstance(rerank(decoder, "ok"), RerankResult)


def test_kind_rerank_needs_yes_and_no_tokens() -> None:
    model = load_model("builtin:embed", resolve_source("builtin:embed"))
    with pytest.raises(RerankUnsupported, match="no token yes, no"):
        rerank_kind(ReplicaOptions(model_id="e", source="builtin:embed", kind="rerank"),
                    model, False)


def test_cross_encoder_scores_are_mlx_embeddings_head(cross: ModelReplica) -> None:
    from transformers import AutoTokenizer

    got = scores(cross, *DOCS)
    tok = AutoTokenizer.from_pretrained(str(cross.model.path))
    rows = tok([QUERY] * len(DOCS), list(DOCS))["input_ids"]
    assert rows[0][0] == tok.convert_tokens_to_ids("<|im_start|>")  # [CLS] query [SEP] doc
    encoder = cross.model.model.model.encoder  # mlx-embeddings' ModernBERT with its head

    def run() -> list[float]:
        return [encoder(mx.array([r])).pooler_output[0, 0].item() for r in rows]

    want = cross._engine.call(run).result(timeout=120)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= TOLERANCE
    assert len({round(s, 4) for s in got}) == len(DOCS)
    alone = [scores(cross, d)[0] for d in DOCS]
    assert max(abs(a - b) for a, b in zip(got, alone, strict=True)) <= TOLERANCE


def test_cross_encoder_refuses_chat(cross: ModelReplica) -> None:
    from replicas.contract import GenerationRequest, SamplingParams, TextPrompt
    from tests.streams import collect

    events = asyncio.run(collect(cross.stream(GenerationRequest(
        "g1", "orchard-cross", TextPrompt("hi"), SamplingParams(max_tokens=2)))))
    assert isinstance(events[0], Failed) and events[0].kind == ErrorKind.INVALID_REQUEST
    assert "cross-encoder: it serves /v1/rerank only" in events[0].message


def test_cross_encoder_refuses_a_pair_past_its_positions(cross: ModelReplica) -> None:
    assert cross.reranker.serves
    long = rerank(cross, "ok", "word " * 600)  # 512 positions
    assert isinstance(long, Failed) and long.kind == ErrorKind.CONTEXT_LENGTH
    assert "documents[1]" in long.message
    assert isinstance(rerank(cross, "ok", "word " * 600, max_tokens_per_doc=400), RerankResult)


def test_the_colocated_client_over_http(decoder: ModelReplica) -> None:
    card = ModelCard("orchard-rerank", capabilities=("text", "rerank"))
    http = TestClient(create_app(LocalModelClient(decoder, card, max_ongoing=4)))
    want = scores(decoder, *DOCS)
    body = http.post("/v1/rerank", json={"model": "orchard-rerank", "query": QUERY,
                                         "documents": list(DOCS), "top_n": 3}).json()
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])[:3]
    assert [r["index"] for r in body["results"]] == order
    assert [r["document"]["text"] for r in body["results"]] == [DOCS[i] for i in order]
    for r in body["results"]:
        assert abs(r["relevance_score"] - want[r["index"]]) <= TOLERANCE
    too_long = http.post("/v1/rerank", json={"model": "orchard-rerank", "query": QUERY,
                                             "documents": ["word " * 5000]})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "documents"
    again = http.post("/v1/rerank", json={"model": "orchard-rerank", "query": QUERY,
                                          "documents": ["hi"]})
    assert again.status_code == 200


def test_bert_cross_encoder_is_mlx_embeddings_bert_under_the_hf_head(
        bert_cross: ModelReplica) -> None:
    """The checkpoint's `bert.` weights in mlx-embeddings' own `bert.Model`, its pooler
    output through the `classifier` weights and a sigmoid, with the tokenizer's token type
    ids (1 for the document): what transformers' BertForSequenceClassification computes."""
    from mlx_embeddings.models import bert
    from transformers import AutoTokenizer

    got = scores(bert_cross, *DOCS)
    path = bert_cross.model.path
    tok = AutoTokenizer.from_pretrained(str(path))
    encoded = tok([QUERY] * len(DOCS), list(DOCS), return_token_type_ids=True)
    assert set(encoded["token_type_ids"][0]) == {0, 1}  # the document's segment is 1

    def run() -> list[float]:  # on the engine thread, which owns MLX
        weights: dict[str, mx.array] = {}
        for file in path.glob("*.safetensors"):
            weights.update(mx.load(str(file)))  # type: ignore[arg-type]
        encoder = bert.Model(bert.ModelArgs.from_dict(bert_cross.model.config))
        encoder.load_weights([(k.removeprefix("bert."), v) for k, v in weights.items()
                              if k.startswith("bert.")])
        encoder.eval()  # no dropout (mlx modules start in training mode)
        out = []
        for ids, types in zip(encoded["input_ids"], encoded["token_type_ids"]):
            pooled = encoder(mx.array([ids]), token_type_ids=mx.array([types])).pooler_output
            logit = pooled @ weights["classifier.weight"].T + weights["classifier.bias"]
            out.append(mx.sigmoid(logit)[0, 0].item())
        return out

    want = bert_cross._engine.call(run).result(timeout=120)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= TOLERANCE
    assert len({round(s, 4) for s in got}) == len(DOCS)
    alone = [scores(bert_cross, d)[0] for d in DOCS]
    assert max(abs(a - b) for a, b in zip(got, alone, strict=True)) <= TOLERANCE
