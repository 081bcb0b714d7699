"""`GET /v1/cluster` over the sharded test cluster (two Ray nodes, whole and sharded models):
every replica and shard is present, a sharded replica's rank 1 on the node other than its
rank 0's, the nodes are Ray's, a sharded model's numbers move under load, and `orchard
status` prints the same replicas and shards. The ledger and the keys:
tests/unit/test_cluster_view.py; every layout of one Mac: tests/e2e/test_cluster_http.py."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.cluster.conftest import BASE_URL, LocalCluster
from tests.cluster_view import decoding, snapshot, status_replicas
from tests.sharded.conftest import app_args

SHARDED = "tiny-x2"
WAIT_S = 60.0

pytestmark = pytest.mark.cluster


def placed(snap: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Replicas by id with the node they are on, and every shard with its node."""
    replicas = {r["id"]: {**r, "node": n["id"]} for n in snap["nodes"] for r in n["replicas"]
                if r["state"] == "running"}
    shards = [{**s, "node": n["id"]} for n in snap["nodes"] for s in n["shards"]
              if s["state"] == "running"]
    return replicas, shards


def test_every_replica_and_shard_is_on_its_node(sharded_cluster: LocalCluster) -> None:
    models = app_args()["models"]
    # Every model entry (a split model's prefill and decode replicas are two) has reported.
    deadline = time.monotonic() + WAIT_S
    while len(placed(snap := snapshot(BASE_URL))[0]) < len(models):
        assert time.monotonic() < deadline, placed(snap)[0].keys()
        time.sleep(1)
    replicas, shards = placed(snap)
    assert sorted((r["model"], r["role"]) for r in replicas.values()) == \
        sorted((m["id"], m.get("role", "both")) for m in models)
    assert {n["id"] for n in snap["nodes"]} == set(sharded_cluster.node_ids().values())
    sharded = [r for r in replicas.values() if r["ranks"] == 2]
    assert len(sharded) == sum(1 for m in models if m.get("shards", 1) == 2)
    for replica in sharded:
        (shard,) = [s for s in shards if s["replica"] == replica["id"]]
        assert shard["rank"] == 1 and shard["node"] != replica["node"]
        assert shard["kv_budget_bytes"] > 0 and replica["kv_budget_bytes"] > 0
    assert len(shards) == len(sharded)

    # One row per replica and one per shard, each naming its replica.
    assert sorted(status_replicas(BASE_URL)) == \
        sorted([*replicas, *(s["replica"] for s in shards)])


def test_a_sharded_models_numbers_move_under_load(sharded_cluster: LocalCluster) -> None:
    deadline = time.monotonic() + WAIT_S
    with decoding(BASE_URL, SHARDED):
        while True:
            model = next(m for m in snapshot(BASE_URL)["models"] if m["id"] == SHARDED)
            if model["tokens_per_s"] > 0 and model["ranks"] == 2:
                break
            assert time.monotonic() < deadline, model
            time.sleep(0.5)
