"""A model's LoRA adapters, in mlx-lm's format, served side by side (`lora.py`'s layers).

An adapter is a directory as `mlx_lm.lora` writes it: `adapter_config.json`
(`fine_tune_type` lora or dora, `num_layers`, `lora_parameters` with `rank`, `scale` and
optional `keys`) and `adapters.safetensors` (`<module path>.lora_a`, `.lora_b`, DoRA's
`.m`). The layers it adapts are those mlx-lm's `linear_to_lora_layers` would convert; each
is wrapped once in a `SlotLoRA`, whose tables hold every adapter's weights by slot. Slot 0
is the base model; an adapter's slot lasts as long as it is loaded.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from replicas.engine.model.lora import LayerAdapter, SlotLoRA, Slots

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
_LEAVES = ("lora_a", "lora_b", "m")


class AdapterError(ValueError):
    """An adapter that cannot be served on this model, the message naming it and why."""


@dataclass(frozen=True)
class AdapterFiles:
    """One adapter read from disk and checked against the model."""

    name: str
    path: Path
    dora: bool
    layers: dict[str, LayerAdapter]  # module path -> its weights
    namespace: int  # the prefix cache's key space (`replicas.engine.kv.namespace`)

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes + (p.m.nbytes if p.m is not None else 0)
                   for p in self.layers.values())


def read_adapter(model: nn.Module, name: str, path: str | Path) -> AdapterFiles:
    """`path`'s adapter, checked against `model`; an `AdapterError` names what is wrong."""
    where = Path(path).expanduser()
    config_file, weights_file = where / CONFIG_FILE, where / WEIGHTS_FILE
    for f in (config_file, weights_file):
        if not f.is_file():
            raise AdapterError(f"adapter '{name}': {f} does not exist (an mlx-lm adapter "
                               f"directory holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise AdapterError(f"adapter '{name}': {config_file} is not JSON: {exc}") from exc
    kind = config.get("fine_tune_type", "lora")
    if kind not in ("lora", "dora"):
        raise AdapterError(f"adapter '{name}': fine_tune_type '{kind}' is not served (lora "
                           "and dora are; a full fine-tune is a model of its own)")
    params = config.get("lora_parameters")
    if not isinstance(params, dict) or "scale" not in params:
        raise AdapterError(f"adapter '{name}': {CONFIG_FILE} has no lora_parameters.scale")
    targets = _targets(model, int(config.get("num_layers", -1)), params.get("keys"))
    try:
        weights = mx.load(str(weights_file))
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same answer
        raise AdapterError(f"adapter '{name}': {weights_file} cannot be read: {exc}") from exc
    assert isinstance(weights, dict)
    mx.eval(list(weights.values()))  # read here: it may be a worker thread, not the engine's
    grouped: dict[str, dict[str, mx.array]] = {}
    for key, value in weights.items():
        module, _, leaf = key.rpartition(".")
        if leaf not in _LEAVES or module not in targets:
            raise AdapterError(f"adapter '{name}': {key} is not an adapter parameter of this "
                               "model (wrong base model, or lora_parameters.keys/num_layers "
                               "do not match the weights)")
        grouped.setdefault(module, {})[leaf] = value
    layers = {m: _layer(name, m, targets[m], w, float(params["scale"]), kind == "dora")
              for m, w in grouped.items()}
    if not layers:
        raise AdapterError(f"adapter '{name}': {weights_file} holds no LoRA weights")
    return AdapterFiles(name, where, kind == "dora", layers, _namespace(name, weights_file))


def _layer(name: str, module: str, base: nn.Module, w: dict[str, mx.array], scale: float,
           dora: bool) -> LayerAdapter:
    if not isinstance(base, (nn.Linear, nn.QuantizedLinear)):
        raise AdapterError(f"adapter '{name}': {module} is a {type(base).__name__}; only "
                           "linear layers (plain or quantized) take adapters here")
    if "lora_a" not in w or "lora_b" not in w or dora != ("m" in w):
        raise AdapterError(f"adapter '{name}': {module} lacks lora_a, lora_b"
                           + (" or m (DoRA)" if dora else "") + " in its weights")
    out_dims, in_dims = base.weight.shape
    if isinstance(base, nn.QuantizedLinear):
        in_dims = in_dims * 32 // base.bits
    a, b = w["lora_a"], w["lora_b"]
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != in_dims or b.shape[1] != out_dims \
            or a.shape[1] != b.shape[0]:
        raise AdapterError(f"adapter '{name}': {module}'s lora_a {a.shape} and lora_b "
                           f"{b.shape} do not fit a {in_dims}->{out_dims} layer")
    return LayerAdapter(a, b, scale, w.get("m"))


def _targets(model: nn.Module, num_layers: int, keys: Sequence[str] | None
             ) -> dict[str, nn.Module]:
    """The modules mlx-lm's `linear_to_lora_layers` converts, by path, each as its base
    layer (a module already wrapped counts as the layer it wraps)."""
    named = _base_modules(model)
    blocks = list(getattr(model, "layers", []))
    block_path = {id(m): p for p, m in model.named_modules()}
    if keys is None:  # mlx-lm: every linear-like module of any block, by its path there
        keys = sorted({p[len(block_path[id(b)]) + 1:] for b in blocks
                       for p, m in named.items() if p.startswith(block_path[id(b)] + ".")
                       and _linear_like(m)})
    chosen = set(keys)
    out: dict[str, nn.Module] = {}
    for block in blocks[-max(num_layers, 0):]:
        prefix = block_path[id(block)]
        out.update((f"{prefix}.{k}", named[f"{prefix}.{k}"]) for k in chosen
                   if f"{prefix}.{k}" in named)
    out.update((k, named[k]) for k in chosen if k in named)  # top-level modules (lm_head)
    return out


def _base_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Module paths, a wrapped layer standing for its base and its insides hidden."""
    named = model.named_modules()
    wrapped = tuple(p + "." for p, m in named if isinstance(m, SlotLoRA))
    return {p: m.base if isinstance(m, SlotLoRA) else m for p, m in named
            if not p.startswith(wrapped)}


def _linear_like(module: nn.Module) -> bool:
    return hasattr(module, "to_lora") or isinstance(
        module, (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)) \
        or type(module).__name__ in ("SwitchLinear", "QuantizedSwitchLinear")


def _namespace(name: str, weights: Path) -> int:
    """A 30-bit id of the adapter's name and weights: KV computed with one adapter is never
    served to another, nor to changed weights under the same name (the disk tier outlives
    a restart; replicas with the same files agree, so pulls between them hit)."""
    digest = hashlib.blake2b(name.encode() + b"\0", digest_size=8)
    with weights.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return 1 + int.from_bytes(digest.digest(), "little") % ((1 << 30) - 1)


class AdapterTable:
    """The adapters loaded into one model, each at a slot of every `SlotLoRA`. Loading and
    unloading run on the engine thread, between steps; an adapter keeps its slot while
    loaded (an unloaded one's slot is reused), so rows of the others never move."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self.slots = Slots()
        self._loaded: list[AdapterFiles | None] = []  # slot i + 1; None: free

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self._loaded if a is not None)

    def slot(self, name: str | None) -> int:
        """`name`'s slot (0: None, the base); KeyError for an adapter not loaded."""
        if name is None:
            return 0
        for i, adapter in enumerate(self._loaded):
            if adapter is not None and adapter.name == name:
                return i + 1
        raise KeyError(f"adapter '{name}' is not loaded")

    def namespace(self, name: str | None) -> int:
        if name is None:
            return 0
        adapter = self._loaded[self.slot(name) - 1]
        assert adapter is not None
        return adapter.namespace

    def files(self, name: str) -> AdapterFiles:
        """Loaded adapter `name`'s weights (a KeyError for one not loaded)."""
        adapter = self._loaded[self.slot(name) - 1]
        assert adapter is not None
        return adapter

    def rows_using(self, name: str) -> int:
        """Rows of the batch on adapter `name` now."""
        slot = self.slot(name)
        return sum(1 for s in self.slots.by_uid.values() if s == slot)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self._layers().values())

    def load(self, adapters: Iterable[AdapterFiles]) -> None:
        """Add adapters (a name already loaded is replaced in its slot; the caller makes
        sure no row uses it)."""
        for adapter in adapters:
            if adapter.name in self.names:
                self._loaded[self.slot(adapter.name) - 1] = adapter
            elif None in self._loaded:
                self._loaded[self._loaded.index(None)] = adapter
            else:
                self._loaded.append(adapter)
        self._rebuild()

    def unload(self, name: str) -> None:
        """Drop an adapter, its slot left free (the caller makes sure no row uses it)."""
        self._loaded[self.slot(name) - 1] = None
        while self._loaded and self._loaded[-1] is None:  # free slots past the last in use
            self._loaded.pop()  # go, so their tables' rows do (no loaded slot moves)
        self._rebuild()

    def _rebuild(self) -> None:
        wrapped = self._layers()
        wanted = {m for a in self._loaded if a is not None for m in a.layers}
        new = [(m, SlotLoRA(module, self.slots)) for m, module in _base_modules(self._model)
               .items() if m in wanted and m not in wrapped]
        if new:
            self._model.update_modules(tree_unflatten(new))
            wrapped = self._layers()
        for path, layer in wrapped.items():
            layer.load([a.layers.get(path) if a is not None else None for a in self._loaded])

    def _layers(self) -> dict[str, SlotLoRA]:
        return {p: m for p, m in self._model.named_modules() if isinstance(m, SlotLoRA)}


def load_adapters(model: nn.Module, adapters: dict[str, str]) -> AdapterTable:
    """The table for `adapters` (name -> directory), every one read and checked first."""
    table = AdapterTable(model)
    if adapters:
        table.load([read_adapter(model, name, path) for name, path in adapters.items()])
    return table
