"""RayModelClient.embed over fake handles (no Ray instance): the deployment's "accepted"
marker bounds the wait for a replica, not the forwards after it; a replica's refusal keeps
its kind; Ray's failures become the taxonomy's. The real thing is
`tests/e2e/test_embeddings_http.py`."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from deployments.model_clients import RayModelClient
from ingress.client import ModelCard
from replicas.contract import EmbeddingRequest, EmbeddingResult, ErrorKind, Failed
from replicas.errors import InternalError, InvalidRequestError, OverloadedError
from tests.fakes import ScriptedCall

pytestmark = pytest.mark.cluster

REQUEST = EmbeddingRequest("e1", "m", ("hi",))
RESULT = EmbeddingResult(((0.6, 0.8),), 2)


class Handle:
    def __init__(self, script: list[Any]) -> None:
        self.call = ScriptedCall(script)
        self.embed = self

    def options(self, **_: Any) -> "Handle":
        return self

    def remote(self, request: EmbeddingRequest) -> ScriptedCall:
        return self.call


def embed(script: list[Any], wait_s: float = 0.5) -> tuple[Any, ScriptedCall]:
    handle = Handle(script)
    client = RayModelClient([ModelCard("m")], {"m": handle},  # type: ignore[dict-item]
                            replica_wait_s=wait_s)

    async def one() -> Any:
        try:
            return await client.embed(REQUEST)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            return exc

    return asyncio.run(asyncio.wait_for(one(), 10)), handle.call


def test_the_result_after_the_accepted_marker() -> None:
    result, call = embed([None, RESULT])
    assert result == RESULT and not call.cancelled


def test_a_slow_forward_is_not_a_slow_replica() -> None:
    # Accepted at once; the vectors take longer than the wait for a replica.
    result, _ = embed([None, 1.0, RESULT], wait_s=0.2)
    assert result == RESULT


def test_no_replica_in_time_is_overloaded_and_cancelled() -> None:
    result, call = embed([1.0, None, RESULT], wait_s=0.2)
    assert isinstance(result, OverloadedError) and "within 0.2 s" in result.message
    assert call.cancelled


def test_the_replica_s_refusal_keeps_its_kind() -> None:
    refused = Failed(ErrorKind.INVALID_REQUEST, "no embeddings here", param="model")
    result, _ = embed([None, refused])
    assert isinstance(result, InvalidRequestError) and result.param == "model"


@pytest.mark.parametrize(("error", "kind"), [(BackPressureError(num_queued_requests=1,
                                                                max_queued_requests=1),
                                              OverloadedError),
                                             (RayActorError(), InternalError)])
def test_ray_failures_become_the_taxonomy_s(error: Exception, kind: type) -> None:
    result, _ = embed([None, error])
    assert isinstance(result, kind)
