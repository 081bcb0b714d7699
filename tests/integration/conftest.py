"""The real tiny model in a ModelReplica, loaded by the production code, one per module."""

from __future__ import annotations

from typing import Iterator

import pytest

from replicas.replica import ModelReplica, ReplicaOptions


@pytest.fixture(scope="module")
def replica() -> Iterator[ModelReplica]:
    rep = ModelReplica(ReplicaOptions(model_id="tiny", source="builtin:tiny"))
    rep.start()
    yield rep
    rep.shutdown()
