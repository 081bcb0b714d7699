"""The embedding queue (`replicas.embedding_queue`): the oldest job's inputs go first, later
jobs fill the room left within the rows and padded-bytes bounds, a dropped job's inputs
never come out. `tests/integration/test_embeddings_replica.py` drives the same through
the real model."""

from __future__ import annotations

from replicas.embedding_queue import EmbeddingQueue, Queued


def ids(length: int) -> tuple[int, ...]:
    return (7,) * length


def jobs(taken: list[Queued[str]]) -> list[tuple[str, int]]:
    return [(q.job, q.index) for q in taken]


def test_a_long_input_is_not_overtaken_by_a_stream_of_short_ones() -> None:
    # Sorted by length across jobs, the short ones would fill every forward while more kept
    # coming; the old job's input leads the next forward whatever arrives after it.
    queue: EmbeddingQueue[str] = EmbeddingQueue(bytes_per_token=1, max_rows=4, max_bytes=1000)
    queue.add("old", [ids(500)])
    for i in range(8):
        queue.add(f"new{i}", [ids(2)])
    # One short input fits beside it (2 rows x 500 bytes); the rest follow in arrival order.
    assert jobs(queue.take()) == [("old", 0), ("new0", 0)]
    assert jobs(queue.take()) == [("new1", 0), ("new2", 0), ("new3", 0), ("new4", 0)]


def test_arrival_order_across_jobs_and_shortest_first_within_one() -> None:
    queue: EmbeddingQueue[str] = EmbeddingQueue(bytes_per_token=1, max_rows=3, max_bytes=10**6)
    queue.add("a", [ids(30), ids(10), ids(20), ids(5)])
    queue.add("b", [ids(1)])
    assert jobs(queue.take()) == [("a", 3), ("a", 1), ("a", 2)]
    assert jobs(queue.take()) == [("a", 0), ("b", 0)]
    assert queue.take() == [] and len(queue) == 0


def test_later_jobs_fill_the_room_the_oldest_leaves() -> None:
    # 100 bytes: the old job's 40-token input and one more row of up to 50 fit, not 60.
    queue: EmbeddingQueue[str] = EmbeddingQueue(bytes_per_token=1, max_rows=8, max_bytes=100)
    queue.add("old", [ids(40), ids(60)])
    queue.add("mid", [ids(50)])
    queue.add("new", [ids(3)])
    # old's 40 (then its 60 would make 2 x 60 > 100: kept), mid's 50 (2 x 50), not new's
    # (3 x 50 > 100).
    assert jobs(queue.take()) == [("old", 0), ("mid", 0)]
    assert jobs(queue.take()) == [("old", 1)]  # 60 + 3 padded to 2 x 60 > 100: alone
    assert jobs(queue.take()) == [("new", 0)]


def test_an_input_past_the_bytes_bound_still_gets_a_forward_alone() -> None:
    queue: EmbeddingQueue[str] = EmbeddingQueue(bytes_per_token=4, max_rows=8, max_bytes=100)
    queue.add("huge", [ids(1000)])
    queue.add("small", [ids(1)])
    assert jobs(queue.take()) == [("huge", 0)]
    assert jobs(queue.take()) == [("small", 0)]


def test_rows_bound_a_forward() -> None:
    queue: EmbeddingQueue[str] = EmbeddingQueue(bytes_per_token=1, max_rows=64)
    for i in range(130):
        queue.add(f"j{i}", [ids(5)])
    assert [len(queue.take()) for _ in range(4)] == [64, 64, 2, 0]


def test_a_dropped_job_leaves_nothing_behind() -> None:
    queue: EmbeddingQueue[str] = EmbeddingQueue(bytes_per_token=1, max_rows=2)
    queue.add("gone", [ids(3), ids(4), ids(5)])
    queue.add("kept", [ids(3)])
    assert jobs(queue.take()) == [("gone", 0), ("gone", 1)]
    assert queue.drop("gone") == 1  # the input still queued
    assert queue.drop("gone") == 0
    assert jobs(queue.take()) == [("kept", 0)]
    assert len(queue) == 0


def test_clear_answers_the_jobs_in_arrival_order() -> None:
    queue: EmbeddingQueue[str] = EmbeddingQueue(bytes_per_token=1)
    queue.add("a", [ids(9), ids(1)])
    queue.add("b", [ids(2)])
    assert queue.clear() == ["a", "b"] and len(queue) == 0 and queue.take() == []
