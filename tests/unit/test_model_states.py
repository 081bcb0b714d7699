"""A configured model that is still loading (`deployments.model_states`): its state from
Serve's status (Ray's own status types, no Ray instance), its requests waiting for it
within `replica_wait_s` (a rolling update's restart is served, not bounced), then the
protocol's overloaded answer with `Retry-After` in each API's shape, never queued in Serve;
`/v1/models` listing it with its state, an unknown model still a 404. The real thing, a
`serve run` with a model held loading, is `tests/e2e/test_model_loading_http.py`."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient
from ray.serve.schema import (
    ApplicationStatus,
    ApplicationStatusOverview,
    DeploymentStatus,
    DeploymentStatusOverview,
    DeploymentStatusTrigger,
    ReplicaState,
    ServeStatus,
)

from deployments.model_clients import RayModelClient
from deployments.model_states import ServeModelStates
from ingress.app import create_app
from ingress.client import ModelCard
from ingress.errors import FAILED_RETRY_AFTER_S, LOADING_RETRY_AFTER_S
from replicas.contract import Channel, Finished, FinishReason, TextDelta, Usage
from tests.fakes import ScriptedCall

DEPLOYMENTS = {"fast": "model:fast", "slow": "model:slow"}


def status(replicas: dict[str, dict[ReplicaState, int]], app: str = "orchard",
           failed: str = "") -> ServeStatus:
    """Serve's status: each deployment's replicas by state; `failed`: the deployment Serve
    marks DEPLOY_FAILED, as after its replicas' third failed start."""
    return ServeStatus(applications={app: ApplicationStatusOverview(
        ApplicationStatus.DEPLOYING, "", 0.0, {
            name: DeploymentStatusOverview(
                DeploymentStatus.DEPLOY_FAILED if name == failed else DeploymentStatus.UPDATING,
                DeploymentStatusTrigger.REPLICA_STARTUP_FAILED if name == failed
                else DeploymentStatusTrigger.CONFIG_UPDATE_STARTED,
                states, "FileNotFoundError: no model at /nowhere" if name == failed else "")
            for name, states in replicas.items()})})


LOADING = status({"model:fast": {ReplicaState.RUNNING: 1},
                  "model:slow": {ReplicaState.STARTING: 1}})


class Counted:
    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.calls = 0

    def __call__(self) -> Any:
        self.calls += 1
        answer = self.answers[min(self.calls, len(self.answers)) - 1]
        if isinstance(answer, BaseException):
            raise answer
        return answer


def states_of(fn: Counted, ttl_s: float = 60.0) -> dict[str, str]:
    return dict(asyncio.run(ServeModelStates("orchard", DEPLOYMENTS, fn, ttl_s).states()))


def test_a_deployment_with_no_replica_running_is_loading() -> None:
    assert states_of(Counted(LOADING)) == {"fast": "ready", "slow": "loading"}
    # Not deployed yet at all (the controller has not created it): loading too.
    assert states_of(Counted(status({"model:fast": {ReplicaState.RUNNING: 2}}))) == \
        {"fast": "ready", "slow": "loading"}
    # One replica of two running: it serves.
    assert states_of(Counted(status({
        "model:fast": {ReplicaState.RUNNING: 1},
        "model:slow": {ReplicaState.RUNNING: 1, ReplicaState.STARTING: 1}}))) == \
        {"fast": "ready", "slow": "ready"}


def test_a_deployment_serve_gave_up_on_is_failed_until_a_replica_runs() -> None:
    failed = status({"model:fast": {ReplicaState.RUNNING: 1},
                     "model:slow": {ReplicaState.STARTING: 1}}, failed="model:slow")
    assert states_of(Counted(failed)) == {"fast": "ready", "slow": "failed"}
    # Serve's retry brought one up: it serves, whatever the deployment's status still says.
    recovered = status({"model:fast": {ReplicaState.RUNNING: 1},
                        "model:slow": {ReplicaState.RUNNING: 1}}, failed="model:slow")
    assert states_of(Counted(recovered)) == {"fast": "ready", "slow": "ready"}


def test_a_failed_model_is_refused_at_once_and_listed_failed() -> None:
    failed = status({"model:fast": {ReplicaState.RUNNING: 1}, "model:slow": {}},
                    failed="model:slow")
    states = ServeModelStates("orchard", DEPLOYMENTS, Counted(failed))
    handles = {"fast": Handle(), "slow": Handle()}
    # A replica wait far past the test: a failed model is not waited for.
    client = RayModelClient([ModelCard("fast"), ModelCard("slow")], handles,  # type: ignore[arg-type]
                            replica_wait_s=600.0, states=states)
    http = TestClient(create_app(client, model_states=states))
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                        max_retries=0)
    ant = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=http,
                              max_retries=0)
    listed = {m.id: (m.model_extra or {}).get("state") for m in oai.models.list()}
    assert listed == {"fast": "ready", "slow": "failed"}
    with pytest.raises(openai.InternalServerError) as raised:
        oai.chat.completions.create(model="slow", max_tokens=4,
                                    messages=[{"role": "user", "content": "hi"}])
    response = raised.value.response
    assert response.status_code == 503
    assert response.headers["retry-after"] == str(int(FAILED_RETRY_AFTER_S))
    assert "failed to start" in response.json()["error"]["message"]
    with pytest.raises(anthropic.OverloadedError) as refused:
        ant.messages.create(model="slow", max_tokens=4,
                            messages=[{"role": "user", "content": "hi"}])
    assert refused.value.response.status_code == 529
    assert handles["slow"].calls == 0


def test_no_answer_from_the_controller_counts_as_ready() -> None:
    # Unknown is not "loading": requests then wait for a replica as they always did.
    assert states_of(Counted(RuntimeError("controller gone"))) == {}
    assert states_of(Counted(status({}, app="another"))) == {}


def test_one_status_call_serves_requests_within_the_ttl() -> None:
    fn = Counted(LOADING, status({"model:slow": {ReplicaState.RUNNING: 1},
                                  "model:fast": {ReplicaState.RUNNING: 1}}))

    async def ask() -> list[str]:
        states = ServeModelStates("orchard", DEPLOYMENTS, fn, ttl_s=0.2)
        first = await asyncio.gather(*(states.state("slow") for _ in range(20)))
        assert fn.calls == 1
        await asyncio.sleep(0.3)
        return [*set(first), await states.state("slow")]

    assert asyncio.run(ask()) == ["loading", "ready"]
    assert fn.calls == 2


class Handle:
    """A deployment handle whose calls would answer; a loading model's must never be made."""

    def __init__(self) -> None:
        self.calls = 0
        self.stream = self.embed = self

    def options(self, **_: Any) -> "Handle":
        return self

    def remote(self, *_: Any) -> ScriptedCall:
        self.calls += 1
        return ScriptedCall([[], [TextDelta(Channel.ANSWER, "hi"),
                                  Finished(FinishReason.EOS, Usage(1, 1))]])


@pytest.fixture
def served() -> tuple[TestClient, dict[str, Handle]]:
    cards = [ModelCard("fast"), ModelCard("slow", aliases=("slow-alias",))]
    handles = {"fast": Handle(), "slow": Handle()}
    states = ServeModelStates("orchard", DEPLOYMENTS, Counted(LOADING))
    client = RayModelClient(cards, handles, replica_wait_s=0.3,  # type: ignore[arg-type]
                            states=states)
    return TestClient(create_app(client, model_states=states)), handles


def test_a_model_still_loading_past_the_wait_is_overloaded_with_retry_after_in_each_shape(
        served: tuple[TestClient, dict[str, Handle]]) -> None:
    http, handles = served
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                        max_retries=0)
    ant = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=http,
                              max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as raised:
            oai.chat.completions.create(model="slow-alias", stream=stream, max_tokens=4,
                                        messages=[{"role": "user", "content": "hi"}])
        response = raised.value.response
        assert response.status_code == 503
        assert response.headers["retry-after"] == str(int(LOADING_RETRY_AFTER_S))
        error = response.json()["error"]
        assert error["type"] == "overloaded_error" and "still loading" in error["message"]
    with pytest.raises(anthropic.OverloadedError) as refused:
        ant.messages.create(model="slow", max_tokens=4,
                            messages=[{"role": "user", "content": "hi"}])
    response = refused.value.response
    assert response.status_code == 529 and response.headers["retry-after"] == "2"
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"
    embedding = http.post("/v1/embeddings", json={"model": "slow", "input": "hi"})
    assert embedding.status_code == 503 and "retry-after" in embedding.headers
    tokens = http.post("/tokenize", json={"model": "slow", "prompt": "hi"})
    assert tokens.status_code == 503
    assert handles["slow"].calls == 0  # answered by the ingress, never queued in Serve
    # The ready model serves; an unknown one is still a 404.
    done = oai.chat.completions.create(model="fast", max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
    assert done.choices[0].message.content == "hi" and handles["fast"].calls == 1
    with pytest.raises(openai.NotFoundError, match="not served here"):
        oai.chat.completions.create(model="nope", max_tokens=4,
                                    messages=[{"role": "user", "content": "hi"}])


def test_the_model_list_names_each_model_with_its_state(
        served: tuple[TestClient, dict[str, Handle]]) -> None:
    http, _ = served
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                        max_retries=0)
    listed = {m.id: (m.model_extra or {}).get("state") for m in oai.models.list()}
    assert listed == {"fast": "ready", "slow": "loading", "slow-alias": "loading"}
    assert (oai.models.retrieve("slow").model_extra or {}).get("state") == "loading"


def test_without_states_every_model_is_ready() -> None:
    client = RayModelClient([ModelCard("m")], {"m": Handle()})  # type: ignore[dict-item]
    http = TestClient(create_app(client))
    assert [m["state"] for m in http.get("/v1/models").json()["data"]] == ["ready"]


def test_a_model_that_comes_up_within_the_wait_is_served() -> None:
    """A rolling update restarts a model's only replica: for a moment none runs. Its
    requests wait for the new one and are answered, not refused."""
    ready = status({"model:fast": {ReplicaState.RUNNING: 1},
                    "model:slow": {ReplicaState.RUNNING: 1}})
    states = ServeModelStates("orchard", DEPLOYMENTS, Counted(LOADING, LOADING, ready),
                              ttl_s=0.0)
    handles = {"fast": Handle(), "slow": Handle()}
    client = RayModelClient([ModelCard("fast"), ModelCard("slow")], handles,  # type: ignore[arg-type]
                            replica_wait_s=30.0, states=states)
    http = TestClient(create_app(client, model_states=states))
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                        max_retries=0)
    done = oai.chat.completions.create(model="slow", max_tokens=4,
                                       messages=[{"role": "user", "content": "hi"}])
    assert done.choices[0].message.content == "hi" and handles["slow"].calls == 1


def test_a_slow_controller_holds_no_request_past_the_wait() -> None:
    """serve.status() stuck (a controller busy deploying): requests go on with the states
    last known after `wait_s`, and the stuck call is not started again meanwhile."""
    release = threading.Event()
    calls = Counted(LOADING)

    def stuck() -> Any:
        answer = calls()
        if calls.calls > 1:
            release.wait(30)
        return answer

    async def ask() -> list[str]:
        states = ServeModelStates("orchard", DEPLOYMENTS, stuck, ttl_s=0.0, wait_s=0.05)
        first = await states.state("slow")  # answered at once
        later = [await states.state("slow") for _ in range(3)]  # the second call hangs
        release.set()
        return [first, *later]

    assert asyncio.run(ask()) == ["loading"] * 4
    assert calls.calls == 2
