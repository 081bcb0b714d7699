"""KV memory: each rank's budget, and admission by what the batch really holds.

A Mac has no swap worth the name for a GPU working set: one long request, or many agent
sessions growing together, can take the node down with every stream on it. So a replica
knows what its model's cache costs (`replicas.engine.kv.layout`, measured at load on
every rank) and its budget, and admits by what the batch holds:

- mlx-lm's batch cache pads every row to the longest and grows in steps of 256 tokens, so
  a batch of `n` rows holds `n x bytes_for(longest, rounded up to a step)`;
- a request reserves its prompt plus one step, not its whole `max_tokens`, and grows its
  reservation a step at a time as it decodes. When growing would pass the budget, the
  engine preempts the youngest request (vLLM's recompute preemption, `core.py`);
- the prefix cache holds at most what the reservations leave (`Bound`): it is evicted
  before a reservation grows, and a save evicts before it adds, so reservations plus cache
  never pass the budget, not even inside a step;
- paged (`Paging`, `replicas.engine.kv.paged`): a batch holds the sum of its rows' blocks,
  and the view each layer gathers for attention (rows x longest, one layer's K+V) must fit
  the gather reserve; the budget is split between the rows' blocks, the gather, the
  prefix cache's share of the pool and the room a pool's growth needs for a moment
  (`paging_plan`, in `kv/pool_plan.py`). A row reserves the blocks it will own
  (its unshared tokens, the partial block it copies on write, its growth); the full blocks
  of a prefix cache hit it shares count once however many rows hold them (`shared_blocks`), and
  the prefix cache counts only the blocks no row holds.

MLX's own memory limit is set from the same numbers on every rank, so a wrong figure
slows allocation down rather than aborting the process. The limit is the process's, not a
replica's: it covers every replica planned in the process (`process_limit`), or a small
budget's limit would throttle a neighbour's evaluation (MLX waits on each evaluation while
active memory is past it: twice the CPU a round in `load/micro/small_budget.py`).

Engine thread only, except the pure arithmetic (`default_budget`, `tightest`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence, TypeVar

import mlx.core as mx
from mlx.utils import tree_flatten

from replicas.engine.kv.blocks import PoolStats
from replicas.engine.kv.layout import CACHE_STEP, KvLayout, measure_kv
from replicas.engine.kv.pool_plan import GATHER_FLOOR as GATHER_FLOOR  # re-exported
from replicas.engine.kv.pool_plan import GATHER_SHARE as GATHER_SHARE
from replicas.engine.kv.pool_plan import Paging as Paging
from replicas.engine.kv.pool_plan import paging_plan as paging_plan
from replicas.engine.kv.shared_blocks import NO_BLOCKS, SharedBlocks, Shares

log = logging.getLogger(__name__)

# Where the machine's figure is plain RAM (not a Mac's GPU working set, which macOS has
# already discounted), the share of it weights plus KV may use: the rest is the OS.
HOST_SHARE = 0.75
# Kept out of the KV budget for activations and temporaries (a prefill chunk's attention,
# the logits): this share of the usable memory, and at least MIN_RESERVE, which holds the
# paged gather's floor twice over (`pool_plan`).
RESERVE_SHARE = 0.05
MIN_RESERVE = 2 * GATHER_FLOOR
# MLX's limit allows this much over weights plus budget, and the activation reserve besides
# (a prefill chunk's attention, the logits: never part of the KV budget), before
# allocation waits.
LIMIT_SLACK = 1.1


class MemoryTooSmall(RuntimeError):
    """The weights leave no room for even one token of KV."""


@dataclass(frozen=True)
class Machine:
    bytes: int
    gpu_working_set: bool  # a Mac's recommended working set (already a share of RAM)


def machine() -> Machine:
    """A Mac's recommended GPU working set (what mlx-lm raises the wired limit to);
    elsewhere physical RAM."""
    recommended = mx.device_info().get("max_recommended_working_set_size")
    if isinstance(recommended, int) and recommended > 0:
        return Machine(recommended, True)
    return Machine(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), False)


def default_budget(host: Machine, weights: int) -> int:
    """KV bytes for running requests plus the prefix cache: the machine discounted once
    (a Mac's working set as macOS gives it, else `HOST_SHARE` of RAM), less the weights
    and the activation reserve. docs/architecture.md works it through for 64 and 192 GB."""
    usable = host.bytes if host.gpu_working_set else int(host.bytes * HOST_SHARE)
    reserve = max(MIN_RESERVE, int(usable * RESERVE_SHARE))
    return usable - weights - reserve


def weights_bytes(model: Any) -> int:
    flat = tree_flatten(model.parameters())
    assert isinstance(flat, list)  # tree_flatten returns a dict only when asked to
    return sum(v.nbytes for _, v in flat if isinstance(v, mx.array))


@dataclass(frozen=True)
class RankMemory:
    """One process's part of a replica: its KV budget, its cache's layout, its weights."""

    budget: int
    layout: KvLayout
    weights: int

    @property
    def limit(self) -> int:
        """MLX's memory limit on this rank: weights, the budget with slack over it, and the
        least activation reserve."""
        return int(self.weights + self.budget * LIMIT_SLACK) + MIN_RESERVE


def plan_memory(model: Any, configured: int | None, label: str = "replica",
                other_weights: int = 0,
                make_cache: Callable[[Any], list[Any]] | None = None,
                draft: Any = None) -> RankMemory:
    """Measure this process's KV layout, fix its budget and set MLX's memory limit;
    `other_weights`: bytes of weights beside the language model's (a vision tower);
    `make_cache`: how the batch makes a row's cache (None: mlx-lm's own); `draft`: a
    draft model, whose weights and per-row cache count too (every row drafts)."""
    weights = weights_bytes(model) + other_weights
    layout = measure_kv(model, make_cache) if make_cache else measure_kv(model)
    if draft is not None:
        weights += weights_bytes(draft)
        layout = layout.plus(measure_kv(draft))
    host = machine()
    budget = configured if configured is not None else default_budget(host, weights)
    if budget < layout.bytes_for(CACHE_STEP):
        where = "the configured memory.budget_bytes" if configured is not None else (
            f"{host.bytes} bytes of {'GPU working set' if host.gpu_working_set else 'RAM'} "
            f"less {weights} bytes of weights and the activation reserve")
        raise MemoryTooSmall(
            f"{label}: no room for KV: {where} leave {budget} bytes, and one sequence of "
            f"{CACHE_STEP} tokens takes {layout.bytes_for(CACHE_STEP)} ({layout.describe()})")
    mine = RankMemory(budget, layout, weights)
    limit = process_limit(mine)
    log.info("%s KV memory: budget %d bytes, weights %d bytes, MLX limit %d bytes (%d for "
             "this process); the cache holds %s", label, budget, weights, mine.limit, limit,
             layout.describe())
    return mine


# The ranks planned in this process that are still held (by their engines): MLX's memory
# limit must cover them all.
_PLANNED: weakref.WeakValueDictionary[int, RankMemory] = weakref.WeakValueDictionary()
_PLANS = itertools.count()


def process_limit(mine: RankMemory) -> int:
    """Set MLX's memory limit, which is the whole process's, to the sum of the limits of
    `mine` and of every rank planned here before it and still held: a second replica in the
    process (a test's, a benchmark's baseline) must not lower the first one's. Returns it."""
    _PLANNED[next(_PLANS)] = mine
    limit = sum(r.limit for r in list(_PLANNED.values()))
    mx.set_memory_limit(limit)
    return limit


def tightest(ranks: Sequence[RankMemory], reference: int) -> int:
    """Rank 0's budget, shrunk so that every rank stays within its own: a rank whose
    budget holds fewer `reference`-token sequences than rank 0's bounds the replica.
    Exact for tensor shards (equal layouts); for pipeline stages it compares each at
    `reference` tokens."""
    first = ranks[0].layout.bytes_for(reference)
    return min(r.budget if r.layout.bytes_for(reference) == 0 else
               r.budget * first // r.layout.bytes_for(reference) for r in ranks)


def round_up(tokens: int) -> int:
    return -(-tokens // CACHE_STEP) * CACHE_STEP


Item = TypeVar("Item")
# Tells the prefix cache the most bytes it may hold from now on (it evicts down to that).
Bound = Callable[[int], None]


@dataclass(frozen=True)
class MemoryStats:
    budget_bytes: int
    projected_bytes: int  # what the running requests' reservations hold
    waiting: int  # requests waiting for memory
    refused: int  # requests refused because too many waited for memory
    preempted: int = 0  # requests preempted (and resumed) when memory ran out
    layout: KvLayout = KvLayout(0)  # what one sequence's cache costs, measured at load
    # Each rank's own budget and MLX memory limit, by rank (one entry for a whole model).
    ranks: tuple[tuple[int, int], ...] = ()
    blocks: PoolStats | None = None  # the paged batch's block pool; None: padded


class KvBudget:
    """Reservations of the running requests, by key, in tokens (whole cache steps)."""

    def __init__(self, budget_bytes: int, layout: KvLayout, max_waiting: int,
                 ranks: tuple[RankMemory, ...] = (), paging: Paging | None = None) -> None:
        self.budget_bytes = budget_bytes
        self.paging = paging  # None: mlx-lm's padded batch
        self.blocks: Callable[[], PoolStats] | None = None  # the paged batch's pool, read
        self.shares: Shares | None = None  # the paged batch's prefix hits (`Shares`)
        self.ranks = ranks
        self.layout = layout
        self.max_waiting = max_waiting
        self._reserved: dict[Hashable, int] = {}
        # Paged: the blocks each reservation shares (a prefix hit's full blocks), each
        # counted once in `_held_blocks`.
        self._shared = SharedBlocks()
        self._told: int | None = None  # the prefix cache's bound, as last told
        self._weighed = 0  # weights added at run time (`weigh`)
        self._paged_blocks: int | None = None  # the pool's blocks before any of them
        self.refused = 0
        self.preempted = 0

    @property
    def max_tokens(self) -> int:
        """The most tokens one request may reach: all of the budget, cache evicted."""
        if (p := self.paging) is not None:
            return min(p.blocks * p.block_size, p.gather_bytes // p.gather_per_token)
        return self.layout.tokens_within(self.budget_bytes) // CACHE_STEP * CACHE_STEP

    def held(self, rows: int, longest: int) -> int:
        return rows * self.layout.bytes_for(longest) if rows else 0

    @property
    def projected(self) -> int:
        if (p := self.paging) is not None:  # and a hybrid's fixed cost a row (`Paging`)
            return self._held_blocks(p) * p.block_bytes + len(self._reserved) * p.row_bytes
        held = list(self._reserved.values())  # one read: `stats` runs on another thread
        return self.held(len(held), max(held, default=0))

    def _held_blocks(self, p: Paging) -> int:
        """The blocks the reservations hold: each its own, and each shared block once."""
        shared = dict(self._shared.by_key)  # copies: `stats` reads this from another thread
        own = sum(p.blocks_for(t) - len(shared.get(k, NO_BLOCKS))
                  for k, t in list(self._reserved.items()))
        return own + len(self._shared)

    def settle(self, key: Hashable, shares: frozenset[int]) -> None:
        """`key`'s row shares `shares`, as the batch holds it (a hit may differ from what
        admission looked up: an entry evicted in between); the reservation follows."""
        old = self._shared.of(key)
        if key not in self._reserved or old is shares:
            return
        if old != shares:
            self._shared.set(key, shares)
        elif shares:
            self._shared.by_key[key] = shares  # the batch's own set: the next check is `is`

    @property
    def over(self) -> bool:
        """Paged: the reservations hold more blocks than the rows' share of the pool (after
        `settle`); the padded batch never is."""
        p = self.paging
        return p is not None and self._held_blocks(p) > p.blocks

    def reserve(self, key: Hashable, tokens: int, bound: Bound,
                shares: frozenset[int] | None = None) -> bool:
        """Hold `tokens` (rounded up to a step) for `key`, a new request or a growing one,
        if the batch with it fits; the prefix cache is bound (`bound`) to what is left
        before the reservation takes it. Paged: `shares`, the prefix cache's blocks the
        request will share (None: as reserved before), count once among all holders."""
        others = [t for k, t in self._reserved.items() if k != key]
        if (p := self.paging) is not None:
            new = self._shared.of(key) if shares is None else shares
            if not p.fits([tokens, *others], self._shared.twice(key, new)):
                return False
            self._bound(p.cache_bytes, bound)
            self._reserved[key] = tokens
            self._shared.set(key, new)
            return True
        want = round_up(tokens)
        room = self.budget_bytes - self.held(len(others) + 1, max([want, *others]))
        if room < 0:
            return False
        self._bound(room, bound)
        self._reserved[key] = want
        return True

    def weigh(self, nbytes: int) -> None:
        """Weights grew by `nbytes` at run time (a LoRA adapter; negative: one unloaded):
        the budget gives them up, or takes them back. `MemoryTooSmall` where one sequence
        of a cache step would no longer fit; a paged batch loses (or regains) blocks."""
        budget = self.budget_bytes - nbytes
        weighed = self._weighed + nbytes
        paging = self.paging
        if paging is not None:
            base = self._paged_blocks if self._paged_blocks is not None else paging.blocks
            self._paged_blocks = base
            blocks = base - (max(0, weighed) + paging.block_bytes - 1) // paging.block_bytes
            paging = dataclasses.replace(paging, blocks=blocks)
        if nbytes > 0 and (budget < self.layout.bytes_for(CACHE_STEP)
                           or (paging is not None and paging.blocks < 1)):
            raise MemoryTooSmall(f"{nbytes} bytes of weights would leave {budget} bytes of "
                                 f"KV, less than one sequence of {CACHE_STEP} tokens")
        self.budget_bytes, self._weighed, self.paging = budget, weighed, paging

    def reserved(self, key: Hashable) -> int:
        return self._reserved.get(key, 0)

    def release(self, key: Hashable) -> None:
        self._reserved.pop(key, None)
        self._shared.drop(key)

    def take(self, pending: Sequence[Item], key: Callable[[Item], Hashable],
             tokens: Callable[[Item], int], bound: Bound,
             keep: Callable[[Item], bool] = lambda _: False,
             shares: Callable[[Item], frozenset[int]] | None = None
             ) -> tuple[list[Item], deque[Item], list[Item]]:
        """Admit `pending` in order while each fits (first come, first served: one that does
        not fit holds back the ones behind it). Returns (admitted, still waiting, refused:
        the newest past `max_waiting`, never one that `keep` holds). `shares`: paged, the
        prefix cache's blocks an item would share."""
        admitted: list[Item] = []
        waiting: deque[Item] = deque()
        for item in pending:
            if not waiting and self.reserve(key(item), tokens(item), bound,
                                            shares(item) if shares is not None else None):
                admitted.append(item)
            else:
                waiting.append(item)
        refused: list[Item] = []
        while len(waiting) > self.max_waiting and not keep(waiting[-1]):
            refused.append(waiting.pop())
        self.refused += len(refused)
        return admitted, waiting, refused

    def fit_cache(self, bound: Bound) -> None:
        """Bound the prefix cache to what the reservations leave now: after a release, the
        room it may grow back into (a finished request's KV is saved into it)."""
        if self.paging is not None:  # its own share, beside the pool
            self._bound(self.paging.cache_bytes, bound)
            return
        self._bound(max(0, self.budget_bytes - self.projected), bound)

    def _bound(self, room: int, bound: Bound) -> None:
        if room != self._told:  # a sharded replica replicates each bound to its ranks
            self._told = room
            bound(room)

    def stats(self, waiting: int) -> MemoryStats:
        return MemoryStats(self.budget_bytes, self.projected, waiting, self.refused,
                           self.preempted, self.layout,
                           tuple((r.budget, r.limit) for r in self.ranks),
                           self.blocks() if self.blocks is not None else None)
