"""Multi-token prediction (MTP) heads: the extra layer DeepSeek V3, Kimi K2 and GLM-4.5
checkpoints ship beside the model to predict the token after next.

mlx-lm 0.32.2 builds these models but drops the layer's weights in `sanitize`, and has no
module for it, so Orchard reads them itself: from the checkpoint's own files, through the
model's own `sanitize` (expert stacking, MLA's split projections, fp8 dequantizing), into
the family's own decoder-layer class. What is Orchard's is the few lines around that
layer (DeepSeek-V3 report, section 2.2):

    h' = layer(eh_proj([enorm(embed(t[i+1])), hnorm(h[i])]))
    logits = head(norm(h'))

`h[i]` is the model's last hidden state at position i (after its final norm, as vLLM
feeds it), `t[i+1]` the token that followed: so the head predicts t[i+2]. Chained, each
draft's `h'` stands in for `h` at the next position (`replicas.engine.spec.mtp`).
Quantized conversions (mlx-community's) were written by that `sanitize`, so they hold no
MTP weights: MTP needs the checkpoint as its makers published it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from replicas.engine.model.mla import absorb_short_passes

# mlx-lm's model modules whose checkpoints carry DeepSeek-style MTP layers, at
# `model.layers.{num_hidden_layers + k}`.
FAMILIES = frozenset({"mlx_lm.models.deepseek_v3", "mlx_lm.models.glm4_moe",
                      "mlx_lm.models.glm4_moe_lite"})
# The layer's own parts, beside the decoder layer's; `shared_head.head` and `embed_tokens`
# repeat the model's head and embeddings in the files, and the model's own are used.
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
_SHARED = ("shared_head.head.", "embed_tokens.")
# `NextN.norm` is the checkpoint's `shared_head.norm`; `NextN.layer`'s weights sit at the
# top of `model.layers.{N}`, beside the layer's own parts.
_NORM, _FILE_NORM = "norm.weight", "shared_head.norm.weight"


def file_key(param: str) -> str:
    """A `NextN` parameter's name under `model.layers.{N}.` in a checkpoint."""
    return _FILE_NORM if param == _NORM else param.removeprefix("layer.")


class NextN(nn.Module):
    """One MTP layer, run beside its model (which lends it the embeddings and the head)."""

    def __init__(self, model: nn.Module, layer: nn.Module) -> None:
        super().__init__()
        hidden = model.args.hidden_size
        eps = model.args.rms_norm_eps
        self.enorm = nn.RMSNorm(hidden, eps=eps)
        self.hnorm = nn.RMSNorm(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = layer
        self.norm = nn.RMSNorm(hidden, eps=eps)

    def __call__(self, hidden: mx.array, embeds: mx.array, cache: Any) -> mx.array:
        """The layer's output h' (B, L, H) over L (hidden state, next token's embedding)
        pairs; `norm(h')` feeds the model's head."""
        x = self.eh_proj(mx.concatenate([self.enorm(embeds), self.hnorm(hidden)], axis=-1))
        mask = create_attention_mask(x, cache, return_array=True)
        return self.layer(x, mask, cache)


class Mtp:
    """An MTP layer with its model's embeddings and head: what the drafter runs. Also
    callable as a model of one layer (token ids in, logits out, hidden states zero), so
    admission measures its cache as it measures any model's (`measure_kv`)."""

    def __init__(self, model: nn.Module, layer: NextN) -> None:
        self.model = model
        self.layer = layer

    def embed(self, tokens: mx.array) -> mx.array:
        return self.model.model.embed_tokens(tokens)

    def logits(self, out: mx.array) -> mx.array:
        """The model's head over the layer's output."""
        return self.model.lm_head(self.layer.norm(out))

    def __call__(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        embeds = self.embed(inputs)
        return self.logits(self.layer(mx.zeros_like(embeds), embeds, cache[0]))

    def make_cache(self) -> list[Any]:
        return [KVCache()]

    def parameters(self) -> dict[str, Any]:
        """The layer's own weights (admission counts them beside the model's)."""
        return self.layer.parameters()


def has_mtp(model: nn.Module, config: dict[str, Any]) -> bool:
    """Whether the model's family is one Orchard runs MTP layers for, and its config says
    the checkpoint has one."""
    return type(model).__module__ in FAMILIES and \
        int(config.get("num_nextn_predict_layers") or 0) > 0


def hidden_and_logits(model: nn.Module, inputs: mx.array, cache: Any) -> tuple[mx.array,
                                                                               mx.array]:
    """The model's forward split where MTP reads it: the last hidden states, then the
    logits (what `model(inputs, cache)` returns, for the families of `FAMILIES`)."""
    hidden = model.model(inputs, cache)
    return hidden, model.lm_head(hidden)


def load_mtp(model: nn.Module, path: Path, config: dict[str, Any]) -> Mtp:
    """The checkpoint's first MTP layer, beside `model` (loaded from `path`)."""
    if not has_mtp(model, config):
        raise ValueError("speculative.method mtp needs a checkpoint with an MTP layer "
                         "(num_nextn_predict_layers in config.json) of a family Orchard "
                         "runs them for (DeepSeek V3, Kimi K2, GLM-4.5); this model has none")
    index = model.args.num_hidden_layers
    prefix = f"model.layers.{index}."
    weights = {k[len(prefix):]: v for k, v in _read(path, prefix).items()
               if not k[len(prefix):].startswith(_SHARED)}
    if not weights:
        raise ValueError(f"speculative.method mtp: {path} has no {prefix}* weights (a "
                         "quantized conversion drops them: use the original checkpoint)")
    own = {k: v for k, v in weights.items() if k.startswith(_OWN)}
    # The model's own sanitize readies the decoder layer's weights under the name of its
    # last layer, which it does not drop (it treats a layer by the weights it holds).
    last = f"model.layers.{index - 1}."
    readied = model.sanitize({last + k: v for k, v in weights.items() if k not in own})
    layer_weights = {"layer." + k[len(last):]: v for k, v in readied.items()
                     if k.startswith(last)}
    nextn = NextN(model, type(model.model.layers[0])(model.args, index))
    if any(k.endswith(".scales") for k in layer_weights):
        quant = config.get("quantization") or {}
        nn.quantize(nextn, group_size=quant.get("group_size", 64), bits=quant.get("bits", 4),
                    class_predicate=lambda p, _: f"{p}.scales" in layer_weights)
    nextn.load_weights([*((_NORM if k == _FILE_NORM else k, v) for k, v in own.items()),
                        *layer_weights.items()])
    nextn.eval()
    absorb_short_passes(nextn)
    mx.eval(nextn.parameters())
    return Mtp(model, nextn)


def _read(path: Path, prefix: str) -> dict[str, mx.array]:
    """The tensors under `prefix`, reading only the files that hold them."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({f for k, f in json.loads(index.read_text())["weight_map"].items()
                        if k.startswith(prefix)})
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    found: dict[str, mx.array] = {}
    for name in files:
        found.update((k, v) for k, v in mx.load(str(path / name)).items()  # type: ignore
                     if k.startswith(prefix))
    return found
