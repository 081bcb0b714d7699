"""KV memory admission: a request joins the batch only when the KV it may reach fits.

A Mac has no swap worth the name for a GPU working set: one long request, or many agent
sessions growing together, can take the node down with every stream on it. So each replica
knows its model's KV bytes per token and its budget, and admits by projection: a request
may reach `prompt + max_tokens` tokens of KV, the running requests theirs, and the prefix
cache holds what it holds (it is evicted first to make room). What does not fit waits,
in order, for running requests to finish. MLX's own memory limit is set from the same
numbers, so a wrong estimate slows allocation down rather than aborting the process.

Engine thread only, except `kv_bytes_per_token` and `default_budget` (pure).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from collections import deque
from typing import Any, Callable, Sequence, TypeVar

import mlx.core as mx
from mlx.utils import tree_flatten

log = logging.getLogger(__name__)

# Share of the machine's memory (a Mac's recommended GPU working set; elsewhere RAM) that
# weights plus KV may use by default: the rest is the OS, activations and the processes.
DEFAULT_SHARE = 0.75


def kv_bytes_per_token(model: Any, config: dict[str, Any]) -> int:
    """K and V for one token over this process's layers (a pipeline stage holds only its
    own; tensor parallel has divided each layer's `n_kv_heads`), in the model's dtype."""
    text = config.get("text_config", config)
    heads = int(text.get("num_attention_heads") or 1)
    head_dim = int(text.get("head_dim") or int(text.get("hidden_size", 0)) // heads)
    default_kv = int(text.get("num_key_value_heads") or heads)
    kv_heads = sum(int(getattr(getattr(layer, "self_attn", None), "n_kv_heads", default_kv))
                   for layer in getattr(model, "layers", []) if layer is not None)
    return 2 * kv_heads * head_dim * _activation_bytes(model)


def _arrays(model: Any) -> list[mx.array]:
    flat = tree_flatten(model.parameters())
    assert isinstance(flat, list)  # tree_flatten returns a dict only when asked to
    return [v for _, v in flat if isinstance(v, mx.array)]


def _activation_bytes(model: Any) -> int:
    floats = [v.dtype for v in _arrays(model) if v.dtype in (mx.float16, mx.bfloat16, mx.float32)]
    # Quantized models keep scales in their compute dtype; an empty list cannot happen for a
    # model that runs, but 2 bytes (half precision) is the common case if it did.
    return floats[0].size if floats else 2


def weights_bytes(model: Any) -> int:
    return sum(v.nbytes for v in _arrays(model))


def machine_bytes() -> int:
    """A Mac's recommended GPU working set; elsewhere physical RAM."""
    info = mx.device_info()
    recommended = info.get("max_recommended_working_set_size")
    if isinstance(recommended, int) and recommended > 0:
        return recommended
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_budget(weights: int) -> int:
    return max(0, int(machine_bytes() * DEFAULT_SHARE) - weights)


def open_budget(model: Any, config: dict[str, Any], budget: int | None,
                max_waiting: int) -> "KvBudget":
    """The loaded model's KV admission; also sets MLX's memory limit from it (weights plus
    1.1x the budget, a tenth for activations), so a wrong estimate makes allocation wait on
    freed memory rather than overrun the machine."""
    weights = weights_bytes(model)
    if budget is None:
        budget = default_budget(weights)
    per_token = kv_bytes_per_token(model, config)
    mx.set_memory_limit(int(weights + budget * 1.1))
    log.info("KV memory: budget %d bytes, %d bytes per token (%d tokens), weights %d bytes",
             budget, per_token, budget // max(1, per_token), weights)
    return KvBudget(budget, per_token, max_waiting)


Item = TypeVar("Item")


@dataclass(frozen=True)
class MemoryStats:
    budget_bytes: int
    projected_bytes: int  # what the running requests may reach
    waiting: int  # requests waiting for memory
    refused: int  # requests refused because too many waited for memory


class KvBudget:
    def __init__(self, budget_bytes: int, bytes_per_token: int, max_waiting: int) -> None:
        self.budget_bytes = budget_bytes
        self.bytes_per_token = max(1, bytes_per_token)
        self.max_waiting = max_waiting
        self._projected = 0
        self.refused = 0

    @property
    def max_tokens(self) -> int:
        """The most tokens one request may reach: all of the budget, cache evicted."""
        return self.budget_bytes // self.bytes_per_token

    def need(self, tokens: int) -> int:
        return tokens * self.bytes_per_token

    def admit(self, need: int, cache_bytes: int, evict_to: Callable[[int], None]) -> bool:
        """Reserve `need` bytes if they fit, evicting the prefix cache (`evict_to`) as far
        as that takes."""
        room = self.budget_bytes - self._projected - need
        if room < 0:
            return False
        if cache_bytes > room:
            evict_to(room)
        self._projected += need
        return True

    def take(self, pending: Sequence[Item], tokens: Callable[[Item], int],
             cache_bytes: Callable[[], int], evict_to: Callable[[int], None]
             ) -> tuple[list[tuple[Item, int]], deque[Item], list[Item]]:
        """Admit `pending` in order while each fits (first come, first served: one that does
        not fit holds back the ones behind it). Returns (admitted with the bytes reserved,
        still waiting, refused: the newest past `max_waiting`)."""
        admitted: list[tuple[Item, int]] = []
        waiting: deque[Item] = deque()
        for item in pending:
            need = self.need(tokens(item))
            if not waiting and self.admit(need, cache_bytes(), evict_to):
                admitted.append((item, need))
            else:
                waiting.append(item)
        refused: list[Item] = []
        while len(waiting) > self.max_waiting:
            refused.append(waiting.pop())
        self.refused += len(refused)
        return admitted, waiting, refused

    def release(self, need: int) -> None:
        self._projected -= need

    def fit_cache(self, cache_bytes: int, evict_to: Callable[[int], None]) -> None:
        """Keep the prefix cache inside what running requests leave of the budget: a save
        while they run (a message boundary's KV, a finished request's) may overshoot it."""
        room = max(0, self.budget_bytes - self._projected)
        if cache_bytes > room:
            evict_to(room)

    def stats(self, waiting: int) -> MemoryStats:
        return MemoryStats(self.budget_bytes, self._projected, waiting, self.refused)
