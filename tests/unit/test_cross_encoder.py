"""`replicas.cross_encoder` on an XLM-RoBERTa cross-encoder checkpoint written here as
transformers saves one (`roberta.` encoder weights, `classifier.dense` and
`classifier.out_proj`, pad id 1): its scores in one padded forward equal mlx-embeddings'
own `xlm_roberta.Model` on each pair alone under the head as transformers defines it.
(The BERT head is checked through a replica: tests/integration/test_rerank_replica.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_embeddings.models import xlm_roberta

from replicas.cross_encoder import load_sequence_classifier
from replicas.engine.model.loading import _context_length
from replicas.rerank_scores import classifier_scores

HIDDEN = 32
CONFIG: dict[str, Any] = {
    "architectures": ["XLMRobertaForSequenceClassification"], "model_type": "xlm-roberta",
    "vocab_size": 60, "hidden_size": HIDDEN, "num_hidden_layers": 2,
    "num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 40,
    "pad_token_id": 1, "type_vocab_size": 1, "layer_norm_eps": 1e-5,
    "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0},
}
ROWS = [[0, 5, 9, 2, 2, 17, 30, 2], [0, 44, 2], [0, 7, 7, 7, 2, 2, 50, 51, 52, 53, 2]]


def checkpoint(tmp: Path, config: dict[str, Any]) -> dict[str, mx.array]:
    mx.random.seed(7)
    encoder = xlm_roberta.Model(xlm_roberta.ModelArgs.from_dict(
        {**config, "add_pooling_layer": False}))
    weights = {f"roberta.{k}": v for k, v in tree_flatten(encoder.parameters())}
    scale = 2.0 / HIDDEN**0.5
    weights.update({
        "classifier.dense.weight": mx.random.normal((HIDDEN, HIDDEN)) * scale,
        "classifier.dense.bias": mx.random.normal((HIDDEN,)) * 0.1,
        "classifier.out_proj.weight": mx.random.normal((1, HIDDEN)) * scale * 2,
        "classifier.out_proj.bias": mx.array([0.1]),
    })
    mx.save_safetensors(str(tmp / "model.safetensors"), weights)
    (tmp / "config.json").write_text(json.dumps(config))
    return weights


def reference(weights: dict[str, mx.array], row: list[int]) -> float:
    """mlx-embeddings' encoder on one pair, then transformers' RobertaClassificationHead."""
    encoder = xlm_roberta.Model(xlm_roberta.ModelArgs.from_dict(
        {**CONFIG, "add_pooling_layer": False}))
    encoder.load_weights([(k.removeprefix("roberta."), v) for k, v in weights.items()
                          if k.startswith("roberta.")])
    encoder.eval()
    first = encoder(mx.array([row])).last_hidden_state[:, 0]
    x = mx.tanh(first @ weights["classifier.dense.weight"].T + weights["classifier.dense.bias"])
    logit = x @ weights["classifier.out_proj.weight"].T + weights["classifier.out_proj.bias"]
    return float(mx.sigmoid(logit)[0, 0].item())


def test_batched_scores_equal_the_library_encoder_under_the_head(tmp_path: Path) -> None:
    weights = checkpoint(tmp_path, CONFIG)
    model = load_sequence_classifier(tmp_path, CONFIG)
    got = classifier_scores(model, ROWS, pad=1)  # one forward, padded with the pad id
    want = [reference(weights, row) for row in ROWS]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-5
    assert len({round(s, 4) for s in got}) == len(ROWS)


def test_a_head_of_two_labels_is_refused(tmp_path: Path) -> None:
    config = {**CONFIG, "id2label": {"0": "no", "1": "yes"}}
    checkpoint(tmp_path, config)
    with pytest.raises(ValueError, match="2 labels"):
        load_sequence_classifier(tmp_path, config)


def test_a_weight_the_head_does_not_have_fails_the_load(tmp_path: Path) -> None:
    weights = checkpoint(tmp_path, CONFIG)
    weights["classifier.extra"] = mx.zeros((1,))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    with pytest.raises(ValueError):
        load_sequence_classifier(tmp_path, CONFIG)


def test_the_input_limit_is_the_positions_past_the_pad_offset(tmp_path: Path) -> None:
    """RoBERTa numbers positions from pad + 1: a table of 40 holds 38 tokens. A row that
    long runs through the library's encoder; one token more indexes past the table."""
    limit = _context_length(CONFIG)
    assert limit == CONFIG["max_position_embeddings"] - CONFIG["pad_token_id"] - 1 == 38
    assert _context_length({**CONFIG, "model_type": "bert"}) == 40  # BERT counts from 0
    encoder = xlm_roberta.Model(xlm_roberta.ModelArgs.from_dict(
        {**CONFIG, "add_pooling_layer": False}))
    longest = encoder.embeddings.create_position_ids_from_input_ids(
        mx.array([[5] * limit]), CONFIG["pad_token_id"])
    assert int(mx.max(longest).item()) == CONFIG["max_position_embeddings"] - 1
