"""Whether each configured model is serving yet, as Serve's controller sees it.

A model whose deployment has no replica RUNNING (all still loading, or not placed yet) is
`loading`: `/v1/models` lists it with that state, and its requests wait for it within the
replica wait, then get the protocol's overloaded answer with `Retry-After`
(`ingress.errors.ModelLoadingError`). A rolling update that restarts a model's only
replica is `loading` for a moment too, which is why requests wait rather than bounce. Serve's `serve.status()` counts each deployment's
replicas by state; it is one controller call, made on a worker thread and kept for
`ttl_s`, so a burst of requests costs one. Where the controller does not answer, every
model counts as ready: requests then wait for a replica as before (`replica_wait_s`).
A model with no replica running whose deployment Serve marks failed (its replicas failed to
start, or their health checks) is `failed`: its requests are refused at once, with a longer
`Retry-After`, and the ingress logs Serve's reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Mapping

from ray import serve
from ray.serve.schema import DeploymentStatus, ReplicaState

from ingress.client import ModelState

log = logging.getLogger(__name__)

_TTL_S = 1.0
# A controller busy with a deploy or a replacement can take many seconds to answer: requests
# wait this long for it, then go on with the states last known (the call runs on).
_STATUS_WAIT_S = 2.0
# Serve's word for a deployment whose replicas failed to start its threshold of times
# (3 per replica), or failed their health checks: it retries them with a growing backoff.
_GAVE_UP = (DeploymentStatus.DEPLOY_FAILED, DeploymentStatus.UNHEALTHY)


class ServeModelStates:
    """`deployments`: each served model id and its deployment's name (`model:ID`)."""

    def __init__(self, app: str, deployments: Mapping[str, str],
                 status: Callable[[], Any] = serve.status, ttl_s: float = _TTL_S,
                 wait_s: float = _STATUS_WAIT_S) -> None:
        self._app = app
        self._deployments = dict(deployments)
        self._status = status
        self._ttl_s = ttl_s
        self._wait_s = wait_s
        self._states: dict[str, ModelState] = {}
        self._at = -float("inf")
        self._lock = asyncio.Lock()
        self._asking: asyncio.Future[Any] | None = None  # the controller call in flight

    async def states(self) -> Mapping[str, ModelState]:
        """Each model's state; a model missing from the answer counts as ready."""
        async with self._lock:  # one controller call for every request waiting on it
            if time.monotonic() - self._at > self._ttl_s:
                self._states = await self._ask()
                self._at = time.monotonic()
            return self._states

    async def state(self, model: str) -> ModelState:
        return (await self.states()).get(model, "ready")

    async def _ask(self) -> dict[str, ModelState]:
        if self._asking is None or self._asking.done():  # one call at a time, however slow
            self._asking = asyncio.ensure_future(asyncio.to_thread(self._status))
        try:
            status = await asyncio.wait_for(asyncio.shield(self._asking), self._wait_s)
        except TimeoutError:
            log.debug("serve.status() slower than %.0f s: states as last known", self._wait_s)
            return self._states
        except Exception:  # noqa: BLE001 - no answer: route as if ready, Serve's wait decides
            log.debug("serve.status() failed", exc_info=True)
            return {}
        app = status.applications.get(self._app)
        if app is None:
            return {}
        states: dict[str, ModelState] = {}
        for model, name in self._deployments.items():
            deployment = app.deployments.get(name)
            if deployment is None:
                states[model] = "loading"
            elif deployment.replica_states.get(ReplicaState.RUNNING, 0):
                states[model] = "ready"
            elif deployment.status in _GAVE_UP:
                states[model] = "failed"
                if self._states.get(model) != "failed":  # once per failure, not per ask
                    log.warning("model %s: no replica runs, Serve says %s: %s", model,
                                deployment.status.value, deployment.message[-500:])
            else:
                states[model] = "loading"
        return states
