"""LoRA with a slot per row: one linear layer serving every adapter of a batch at once.

`SlotLoRA` wraps a base linear layer (plain or quantized) and holds the A and B matrices
of every loaded adapter stacked into tables, slot 0 being "no adapter" (zeros). Before a
forward, the batch says which slot each of its rows uses (`Slots.rows`); the layer then
computes `base(x) + (x @ A[s]) @ (scale[s] * B[s])` per row with `mx.gather_mm` (Punica's
batched gather), so rows with different adapters, or none, share one pass and no weights
are swapped between steps. DoRA (mlx-lm's `DoRALinear`) adds a per-slot column factor
`m / ||W + scale * B^T A^T||`, fixed once the adapter is loaded.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn


class Slots:
    """The slot of each row of the forward being built; None: every row is the base model
    (the adapted layers then cost nothing). Engine thread only."""

    def __init__(self) -> None:
        self.current: mx.array | None = None
        self.by_uid: dict[int, int] = {}  # the batch's rows that use an adapter: their slot

    def of(self, uids: Sequence[int]) -> AbstractContextManager[None]:
        """`rows` for the batch's rows by uid (rows not in `by_uid` are the base)."""
        by_uid = self.by_uid
        return self.rows([by_uid.get(u, 0) for u in uids] if by_uid else ())

    @contextmanager
    def rows(self, slots: Sequence[int]) -> Iterator[None]:
        """While a forward over rows with these slots is built (MLX is lazy: the slot
        vector is captured in the graph, so it may be reset right after)."""
        previous = self.current
        self.current = mx.array(list(slots), dtype=mx.uint32) if any(slots) else None
        try:
            yield
        finally:
            self.current = previous


@dataclass(frozen=True)
class LayerAdapter:
    """One adapter's weights for one layer: mlx-lm's `lora_a` (in, r), `lora_b` (r, out),
    `scale`, and DoRA's magnitude `m` (out,) or None."""

    a: mx.array
    b: mx.array
    scale: float
    m: mx.array | None = None


class SlotLoRA(nn.Module):
    """A base linear layer plus every loaded adapter's low-rank update, chosen per row."""

    def __init__(self, base: nn.Module, slots: Slots) -> None:
        super().__init__()
        self.base = base
        self._slots = slots  # shared by every layer of the model (not a parameter)
        self.load([])

    def _set_tables(self, a: mx.array, b: mx.array, dora: mx.array | None) -> None:
        # Frozen arrays, not parameters anyone trains: underscore names keep them out of
        # `parameters()` (and so out of weight loading), but they count as memory.
        self._a, self._b, self._dora = a, b, dora

    @property
    def nbytes(self) -> int:
        arrays = [self._a, self._b] + ([self._dora] if self._dora is not None else [])
        return sum(x.nbytes for x in arrays)

    def dense_weight(self) -> mx.array:
        """The base weight, dequantized where quantized (DoRA's norm reads it)."""
        base = self.base
        if isinstance(base, nn.QuantizedLinear):
            return mx.dequantize(base.weight, base.scales, base.biases,
                                 group_size=base.group_size, bits=base.bits, mode=base.mode)
        return base.weight

    def load(self, per_slot: Sequence[LayerAdapter | None]) -> None:
        """The tables for slots 1..n (`per_slot[i]` is slot i+1's, None where that adapter
        leaves this layer alone); slot 0 stays the base."""
        weight = self.dense_weight()
        out_dims, in_dims = weight.shape
        rank = max([p.a.shape[1] for p in per_slot if p is not None] or [1])
        dtype = next((p.a.dtype for p in per_slot if p is not None), mx.float32)
        a_rows = [mx.zeros((in_dims, rank), dtype=dtype)]
        b_rows = [mx.zeros((rank, out_dims), dtype=dtype)]
        factors = [mx.ones((out_dims,), dtype=mx.float32)]
        any_dora = False
        for p in per_slot:
            if p is None:
                a_rows.append(a_rows[0])
                b_rows.append(b_rows[0])
                factors.append(factors[0])
                continue
            r = p.a.shape[1]
            a_rows.append(mx.pad(p.a.astype(dtype), [(0, 0), (0, rank - r)]))
            # The scale folded into B: three ops a layer fewer per pass (a gather, a
            # reshape, a multiply), for a rounding difference in the last bit.
            b_rows.append(mx.pad((p.scale * p.b).astype(dtype), [(0, rank - r), (0, 0)]))
            if p.m is None:
                factors.append(factors[0])
            else:  # mlx-lm's DoRALinear: m over the adapted weight's row norms
                any_dora = True
                adapted = weight + (p.scale * p.b.T) @ p.a.T
                factors.append((p.m / mx.linalg.norm(adapted, axis=1)).astype(mx.float32))
        dora = mx.stack(factors) if any_dora else None
        tables = (mx.stack(a_rows), mx.stack(b_rows))
        mx.eval(*tables, *([dora] if dora is not None else []))  # all or nothing
        self._set_tables(*tables, dora)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        slots = self._slots.current
        if slots is None:
            return y
        if x.ndim != 3 or x.shape[0] != slots.shape[0]:
            raise ValueError(f"adapter slots for {slots.shape[0]} rows, input {x.shape}")
        h = mx.gather_mm(x if x.dtype == self._a.dtype else x.astype(self._a.dtype), self._a,
                         rhs_indices=slots)
        z = mx.gather_mm(h, self._b, rhs_indices=slots)  # (rows, positions, out), scaled
        lora = z if z.dtype == x.dtype else z.astype(x.dtype)
        if self._dora is None:
            return y + lora
        bias = self.base.bias if "bias" in self.base else None
        plain = y - bias if bias is not None else y
        out = self._dora[slots][:, None, :].astype(x.dtype) * (plain + lora)
        return out + bias if bias is not None else out
