"""Paged admission counts a prefix cache hit's shared blocks once (`KvBudget`, `Waiting`;
issue 58): rows sharing one prefix reserve it once between them, a row's growth keeps what
it shares, a release gives its blocks back only when no other row shares them, the padded
batch ignores sharing altogether, and a row that turns out to share less than admission
looked up (an entry evicted in between) is settled before the step, preempting the
youngest where the pool would be passed. The engine-level check on the tiny model is
tests/integration/test_paged_admission.py."""

from __future__ import annotations

from typing import Any, Sequence

from replicas.contract import SamplingParams
from replicas.engine.config import EngineConfig
from replicas.engine.kv.blocks import BLOCK_SIZE
from replicas.engine.kv.budget import KvBudget, Paging
from replicas.engine.kv.layout import KvLayout
from replicas.engine.kv.shared_blocks import NO_BLOCKS
from replicas.engine.request import EngineRequest, Submitted
from replicas.engine.scheduling import Active, Waiting

LAYOUT = KvLayout(per_token=100)
PREFIX = frozenset(range(40))  # a hit's 40 full blocks (1,280 tokens)
PROMPT = 40 * BLOCK_SIZE + 10  # the prefix and a 10-token tail: 41 blocks


def _paged(blocks: int) -> KvBudget:
    paging = Paging(BLOCK_SIZE, BLOCK_SIZE * LAYOUT.per_token, blocks, 1, 1 << 40, 0)
    return KvBudget(1 << 30, LAYOUT, max_waiting=64, paging=paging)


def _bound(_: int) -> None:
    pass


def test_rows_sharing_a_prefix_reserve_it_once() -> None:
    kv = _paged(50)
    for i in range(6):  # 40 shared + 6 x 1 own = 46 blocks
        assert kv.reserve(i, PROMPT + 2, _bound, PREFIX), i
    assert kv.projected == 46 * kv.paging.block_bytes  # type: ignore[union-attr]
    # A seventh that shares nothing needs 41 blocks of its own: it waits.
    assert not kv.reserve("cold", PROMPT + 2, _bound, NO_BLOCKS)
    # Growth keeps what a row shares: row 0 reaches a second block of its own.
    assert kv.reserve(0, PROMPT + 2 + BLOCK_SIZE, _bound)
    assert kv.projected == 47 * kv.paging.block_bytes  # type: ignore[union-attr]
    # Five leave: the prefix stays counted, once, for the last.
    for i in range(1, 6):
        kv.release(i)
    assert kv.projected == 42 * kv.paging.block_bytes  # type: ignore[union-attr]
    kv.release(0)
    assert kv.projected == 0 and not kv.over


def test_unshared_rows_do_not_fit_where_shared_ones_do() -> None:
    kv = _paged(50)
    assert kv.reserve(0, PROMPT + 2, _bound, NO_BLOCKS)
    assert not kv.reserve(1, PROMPT + 2, _bound, NO_BLOCKS)  # 82 blocks > 50
    # Overlapping hits (a longer entry sharing the shorter's blocks) count the union.
    kv = _paged(50)
    assert kv.reserve(0, PROMPT + 2, _bound, PREFIX)
    assert kv.reserve(1, PROMPT + 64 + 2, _bound, frozenset(range(42)))
    assert kv.projected == (42 + 1 + 1) * kv.paging.block_bytes  # type: ignore[union-attr]


def test_the_padded_batch_ignores_sharing() -> None:
    with_shares, without = (KvBudget(6 * 1536 * LAYOUT.per_token, LAYOUT, 64)
                            for _ in range(2))
    got = [with_shares.reserve(i, PROMPT + 2, _bound, PREFIX) for i in range(8)]
    want = [without.reserve(i, PROMPT + 2, _bound) for i in range(8)]
    assert got == want and got.count(True) == 6  # six 1,536-token padded rows fit
    assert with_shares.projected == without.projected and not with_shares.over


class _Shares:
    """What a paged batch would tell admission: every prompt hits the prefix; the rows'
    truth is set by the test."""

    def __init__(self) -> None:
        self.by_uid: dict[int, frozenset[int]] = {}

    def would_share(self, tokens: Sequence[int], adapter: str | None) -> frozenset[int]:
        return PREFIX

    def shared_by(self, uid: int) -> frozenset[int] | None:
        return self.by_uid.get(uid)


class _Output:
    sink: Any = None


def _submitted(i: int) -> Submitted:
    return Submitted(EngineRequest(f"r{i}", tuple(range(3, 3 + PROMPT)), 20,
                                   SamplingParams(temperature=0.0), frozenset()),
                     _Output())  # type: ignore[arg-type]


def test_a_row_sharing_less_than_admission_thought_is_settled_and_preempts() -> None:
    kv = _paged(50)
    kv.shares = shares = _Shares()
    waiting = Waiting(kv, EngineConfig(prompt_cache_bytes=0))
    admitted = waiting.admit([_submitted(i) for i in range(6)], lambda _: False, _bound)
    assert len(admitted) == 6 and len(waiting) == 0
    active = {i: Active(i, q.sub, None, 0, i + 1) for i, q in enumerate(admitted)}
    for uid in active:
        shares.by_uid[uid] = PREFIX
    shares.by_uid[5] = NO_BLOCKS  # its entry was evicted before it joined: 41 blocks alone
    gone: list[int] = []

    def preempt(row: Active) -> None:  # as the engine does: out of the batch, released
        gone.append(row.uid)
        del active[row.uid]
        kv.release(row.request_id)

    waiting.grow(active, _bound, preempt)
    # 40 + 5 x 1 + 41 = 86 blocks > 50: the youngest (row 5 itself) leaves and waits first.
    assert gone == [5] and len(active) == 5 and waiting.queue[0].request_id == "r5"
    assert not kv.over and kv.preempted == 1
