"""Sharded replicas on a real two-node Ray cluster on this machine: both nodes advertise the
Apple Silicon resource, so a `shards: 2` replica puts one rank on each (STRICT_SPREAD), and
the ranks talk over MLX's ring backend on loopback.

One application serves the float32 built-in models whole (the reference) and sharded two
ways (`tiny`: tensor; `pipe`: tensor and pipeline, the latter twice: evenly, and over nodes
configured with unequal memory, `pipe-u2`, whose stages hold 3 and 1 of its 4 layers),
whose greedy output must be identical, and `bench` (bfloat16) sharded by tensor. Tensor
parallelism sums each layer's partial products in another order; in bfloat16 that moves a
logit by a rounding step, which flips the random-weight bench model's near-ties within a
few dozen tokens, so bench is checked for self-consistency and used where only a long
stream matters (a lost shard). `tiny-s2` speculates (rank 0 drafts with a draft model, both ranks verify),
and `tiny-pd2` is a split model whose prefill and decode replicas are both sharded, so its
KV moves rank to rank. Test-only failpoints (`replicas.engine.failpoints`) are on in
this cluster: a test arms one to make a step fail where it chooses.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from replicas.builtin import ensure_builtin
from replicas.engine.failpoints import ENV
from tests.cluster.conftest import LocalCluster
from tests.sharded.driver import Driver

# (reference id, sharded id, sharding): greedy text must match.
PAIRS = [("tiny", "tiny-x2", "tensor"), ("pipe", "pipe-x2", "pipeline"),
         ("pipe", "pipe-t2", "tensor"), ("pipe", "pipe-u2", "pipeline")]
# Both nodes are this machine: configured memory makes them differ (rank 0 first), so the
# pipeline's stages are sized 3 and 1 layers (rank 0 runs the last three).
NODE_MEMORY = {"pipe-u2": [3 << 30, 1 << 30]}
# `tiny-m2` (tiny by tensor) has this KV budget on each Mac: 512 bytes a token per rank (one
# of tiny's two KV heads), so one sequence may reach 512 tokens, and two run at once only
# while both are under 256.
SMALL_BUDGET_TOKENS = 600
SMALL_BUDGET = SMALL_BUDGET_TOKENS * 512
SOURCES = {"tiny": "builtin:tiny", "pipe": "builtin:pipe", "bench": "builtin:bench",
           "mtp-agree": "builtin:mtp-agree"}
HEARTBEAT_TIMEOUT_S = 5.0
# The replica the fault tests fail (test_sharded.py), and Serve's health-check period for it:
# Serve replaces a replica after three failed checks in a row, 30 s at its default 10 s
# period, 6 s at this one, which is what each fault test waits out (four of them).
FAULTED = "bench-x2"
FAULTED_HEALTH_PERIOD_S = 2.0
QUANTIZED = {"kv_bits": 8, "kv_group_size": 32}  # tiny's head_dim is 32, mla's rope key too
RESUME_WAIT_S = 300.0
SPLIT, SPLIT_MIN_TOKENS = "tiny-pd2", 64
SPECULATING = "tiny-s2"
MTP_SHARDED = "mla-mtp-x2"
# Sharded replicas: each takes one unit of apple_silicon on each node, and a replaced one
# briefly two.
SHARDED_REPLICAS = 11


def app_args() -> dict[str, Any]:
    def sharded(model_id: str, source: str, how: str) -> dict[str, Any]:
        return {"id": model_id, "source": source, "shards": 2, "sharding": how,
                # Loopback: the ranks of this test never leave the machine.
                "distributed": {"host": "127.0.0.1", "collective_timeout_s": 60,
                                "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
                                "node_memory_bytes": NODE_MEMORY.get(model_id)}}

    models = [{"id": w, "source": SOURCES[w], "placement": {"pin": False}} for w in ("tiny", "pipe")]
    models += [sharded(s, SOURCES[w], how) for w, s, how in PAIRS]
    models.append(sharded(FAULTED, SOURCES["bench"], "tensor"))
    models.append({**sharded("tiny-m2", SOURCES["tiny"], "tensor"), "max_model_len": 4096,
                   "memory": {"budget_bytes": SMALL_BUDGET}})
    # An 8-bit KV cache, whole and by tensor (each rank quantizes its own KV heads).
    models.append({"id": "tiny-q8", "source": SOURCES["tiny"], "placement": {"pin": False},
                   "engine": QUANTIZED})
    models.append({**sharded("tiny-q8-x2", SOURCES["tiny"], "tensor"), "engine": QUANTIZED})
    # Speculative decoding on a sharded replica: rank 0 drafts (with tiny itself as the
    # draft model, loaded on rank 0 alone), every rank verifies.
    models.append({**sharded(SPECULATING, SOURCES["tiny"], "tensor"), "speculative": {
        "method": "draft", "draft_model": SOURCES["tiny"], "num_speculative_tokens": 4,
        "disable_when_slower": False}})
    # The checkpoint's MTP layer on a sharded replica: rank 0 reads the model's hidden
    # states (whole after the tensor-parallel sums) and drafts; DeepSeek V3 (MLA, MoE), its
    # KV quantized, which each rank's MLA attention reads packed (a latent 64 wide and a
    # rope key 32 wide: groups of 32 fit).
    models.append({"id": "mla", "source": SOURCES["mtp-agree"], "placement": {"pin": False},
                   "engine": QUANTIZED})
    models.append({**sharded(MTP_SHARDED, SOURCES["mtp-agree"], "tensor"), "speculative": {
        "method": "mtp", "num_speculative_tokens": 3, "disable_when_slower": False},
        "engine": QUANTIZED})
    # Prefill and decode roles, both sharded by tensor: KV moves rank to rank between them.
    models += [{**sharded(SPLIT, SOURCES["tiny"], "tensor"), "role": "decode",
                "prefill_min_tokens": SPLIT_MIN_TOKENS},
               {**sharded(SPLIT, SOURCES["tiny"], "tensor"), "role": "prefill"}]
    # A lost shard's streams resume on the replacement, which loads in a minute or two here.
    return {"cluster": {"placement": {"pin": True, "require_metal": False}}, "models": models,
            "ingress": {"resume_wait_s": RESUME_WAIT_S}}


@pytest.fixture(scope="package")
def sharded_cluster() -> Iterator[LocalCluster]:
    for name in SOURCES:
        ensure_builtin(name)  # once here, not in every replica
    root = Path(tempfile.mkdtemp(prefix="orc-", dir="/tmp"))
    # Test-only fault injection (`replicas.engine.failpoints`): on in this cluster alone.
    (root / "failpoints").mkdir()
    slots = SHARDED_REPLICAS + 1
    local = LocalCluster(root, head_slots=slots, worker_slots=slots,
                         env={ENV: str(root / "failpoints")})
    try:
        local.start()
        local.deploy(app_args(), deployments=[
            {"name": f"model:{FAULTED}", "health_check_period_s": FAULTED_HEALTH_PERIOD_S}])
        local.wait_status("RUNNING", timeout_s=420)
        yield local
    finally:
        local.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="package")
def driver(sharded_cluster: LocalCluster) -> Iterator[Driver]:
    """The package's one Ray driver (`driver.py`): the deployments' stats, the ranks' limits."""
    started = Driver(sharded_cluster, sharded_cluster.logs / "driver.log")
    try:
        yield started
    finally:
        started.close()
