"""A LoRA adapter loaded at run time takes its weights from KV admission's budget, and
unloading gives them back (`replicas/replica_adapters.py`, `KvBudget.weigh`); one that the
budget cannot hold is refused, and nothing changes. The bytes expected are the adapter
tables' own, measured by loading the same adapters into a fresh copy of the model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from replicas.engine.config import EngineConfig
from replicas.engine.kv.layout import CACHE_STEP
from replicas.engine.model.adapters import AdapterTable, read_adapter
from replicas.engine.model.loading import load_model
from replicas.errors import InvalidRequestError
from replicas.replica import ModelReplica, ReplicaOptions
from replicas.sources import resolve_source
from tests.integration.test_adapters import SOURCE, adapter_specs


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return adapter_specs(tmp_path_factory.mktemp("adapters"))


def table_bytes(adapters: dict[str, Path], steps: list[tuple[str, str]]) -> list[int]:
    """The tables' bytes after each (op, name) step, on a fresh model."""
    model = load_model(SOURCE, resolve_source(SOURCE)).model
    table = AdapterTable(model)
    sizes = []
    for op, name in steps:
        if op == "load":
            table.load([read_adapter(model, name, adapters[name])])
        else:
            table.unload(name)
        sizes.append(table.nbytes)
    return sizes


def budget(replica: ModelReplica) -> int:
    memory = replica.stats().memory
    assert memory is not None
    return memory.budget_bytes


def test_runtime_adapters_are_counted_by_admission(adapters: dict[str, Path]) -> None:
    steps = [("load", "alpha"), ("load", "gamma"), ("unload", "alpha"), ("unload", "gamma")]
    sizes = table_bytes(adapters, steps)
    # gamma (rank 8) pads alpha's rows too; all unloaded, each wrapped layer keeps only the
    # base's zero row at rank 1.
    assert sizes[1] > sizes[0] > 0 and sizes[3] < sizes[0] // 4
    replica = ModelReplica(ReplicaOptions(model_id="tiny", source=SOURCE))
    replica.start()
    try:
        start = budget(replica)
        seen = []
        for op, name in steps:
            if op == "load":
                asyncio.run(replica.load_adapter(name, str(adapters[name])))
            else:
                asyncio.run(replica.unload_adapter(name))
            seen.append(start - budget(replica))
        assert seen == sizes  # the budget gives up exactly what the tables hold
        assert replica.adapter_names() == ()
    finally:
        replica.shutdown()


def test_an_adapter_the_budget_cannot_hold_is_refused(adapters: dict[str, Path]) -> None:
    probe = ModelReplica(ReplicaOptions(model_id="tiny", source=SOURCE))
    probe.start()
    memory = probe.stats().memory
    probe.shutdown()
    assert memory is not None
    one_sequence = memory.layout.bytes_for(CACHE_STEP)
    tight = one_sequence + 1024  # room for one sequence, not for alpha's tables
    replica = ModelReplica(ReplicaOptions(model_id="tiny", source=SOURCE,
                                          engine=EngineConfig(kv_budget_bytes=tight)))
    replica.start()
    try:
        with pytest.raises(InvalidRequestError, match="no memory"):
            asyncio.run(replica.load_adapter("alpha", str(adapters["alpha"])))
        assert replica.adapter_names() == ()
        assert budget(replica) == tight
    finally:
        replica.shutdown()
