"""BERT and XLM-RoBERTa cross-encoders (ms-marco MiniLM, bge-reranker): mlx-embeddings'
own encoder classes with Hugging Face's sequence-classification head on top.

mlx-embeddings 0.1.0 implements a classification head for ModernBERT only; its `bert` and
`xlm_roberta` models are the bare encoders (and its loader, strict, refuses the `bert.` /
`roberta.` prefixed weights and the `classifier.*` ones a `*ForSequenceClassification`
checkpoint holds). So here: the library's encoder class, the checkpoint's weights under it,
and the head as transformers defines it, minimal:
- `BertForSequenceClassification`: `classifier` (a Linear) over the pooler output
  (tanh(dense(first token)), the library's `BertPooler`);
- `XLMRobertaForSequenceClassification`: `classifier.dense`, tanh, `classifier.out_proj`
  over the first token's hidden state (no pooler: `add_pooling_layer=False`).
One label, scored through a sigmoid, as sentence-transformers' `CrossEncoder` does by default
(and Cohere's scores, 0..1).
"""

from __future__ import annotations

import glob
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# architecture -> (mlx-embeddings module, the encoder's weight prefix in the checkpoint)
SEQUENCE_CLASSIFIERS: dict[str, tuple[str, str]] = {
    "BertForSequenceClassification": ("bert", "bert."),
    "XLMRobertaForSequenceClassification": ("xlm_roberta", "roberta."),
}


def classifier_architecture(config: dict[str, Any]) -> str | None:
    """The architecture this module loads, if the config names one."""
    return next((a for a in config.get("architectures") or () if a in SEQUENCE_CLASSIFIERS),
                None)


def labels(config: dict[str, Any]) -> int:
    """The head's outputs (transformers: `id2label`'s size, else `num_labels`, else 2)."""
    id2label = config.get("id2label")
    return len(id2label) if isinstance(id2label, dict) and id2label else \
        int(config.get("num_labels", 2))


@dataclass
class ClassifierOutput:
    """What `replicas.rerank_scores` and the embedding body read of an encoder's output."""

    last_hidden_state: mx.array
    pooler_output: mx.array  # (rows, 1): the score, through the sigmoid


class _RobertaHead(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, 1)

    def __call__(self, first: mx.array) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(first)))  # type: ignore[no-any-return]


class SequenceClassifier(nn.Module):
    def __init__(self, architecture: str, encoder: nn.Module, hidden: int) -> None:
        super().__init__()
        self.bert = architecture == "BertForSequenceClassification"
        self.encoder = encoder
        self.classifier = nn.Linear(hidden, 1) if self.bert else _RobertaHead(hidden)

    def __call__(self, ids: mx.array, attention_mask: mx.array | None = None,
                 token_type_ids: mx.array | None = None) -> ClassifierOutput:
        out = self.encoder(ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        hidden = out.last_hidden_state
        logits = self.classifier(out.pooler_output if self.bert else hidden[:, 0])
        return ClassifierOutput(hidden, mx.sigmoid(logits))


def load_sequence_classifier(path: Path, config: dict[str, Any]) -> SequenceClassifier:
    """The checkpoint in `path` (safetensors, as Hugging Face saves it) as a
    `SequenceClassifier`; a head of more than one label is refused."""
    architecture = classifier_architecture(config)
    assert architecture is not None
    if labels(config) != 1:
        raise ValueError(f"{architecture} with {labels(config)} labels: a reranker scores one "
                         "(relevance) label")
    module_name, prefix = SEQUENCE_CLASSIFIERS[architecture]
    module = importlib.import_module(f"mlx_embeddings.models.{module_name}")
    args = module.ModelArgs.from_dict({**config, "add_pooling_layer": module_name == "bert"})
    model = SequenceClassifier(architecture, module.Model(args), int(config["hidden_size"]))
    weights: dict[str, mx.array] = {}
    for file in sorted(glob.glob(str(path / "*.safetensors"))):
        loaded = mx.load(file)
        assert isinstance(loaded, dict)
        weights.update(loaded)
    renamed = {("encoder." + k.removeprefix(prefix) if k.startswith(prefix) else k): v
               for k, v in weights.items() if "position_ids" not in k}
    model.load_weights(list(renamed.items()))  # strict: a missing or extra weight fails
    mx.eval(model.parameters())
    model.eval()
    return model
