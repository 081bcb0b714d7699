"""Seeing the cluster: `GET /v1/cluster` (one JSON snapshot of nodes, replicas, shards,
per-model totals and recent faults) and `/dashboard` (one self-contained page over it, with
a chat playground). Both are behind the API keys, like every route but `/health`.

The snapshot is the deployments' (`deployments/board.py`): the ingress only hands it out,
through the `ClusterView` that `create_app` is given, so no Ray here. With tenants
configured, the snapshot is an admin tenant's (as `GET /v1/usage` is); the page is any
key's, and shows a non-admin key the snapshot's 403 beside a working playground.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from ingress.errors import OPENAI_ERRORS, error_response
from ingress.tenancy.seat import current_seat
from replicas.contract import ErrorKind
from replicas.errors import NotFoundError

_PAGE = Path(__file__).with_name("dashboard.html")


class ClusterView(Protocol):
    async def snapshot(self) -> dict[str, Any]:
        """The cluster now: `{"at", "nodes", "models", "faults"}` (deployments/snapshot.py)."""
        ...


router = APIRouter()


@router.get("/v1/cluster")
async def cluster(request: Request) -> Any:
    if request.app.state.tenants:
        seat = current_seat()
        if seat is None or not seat.policy.admin:
            return error_response(ErrorKind.UNAUTHORIZED, "GET /v1/cluster needs an admin "
                                  "tenant's key", OPENAI_ERRORS, status=403)
    view: ClusterView | None = request.app.state.cluster
    if view is None:  # an app built without deployments (tests, embedding the ingress)
        raise NotFoundError("this server has no cluster view (it runs outside Ray Serve)")
    return await view.snapshot()


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    # No caching: the page is small, and a stale copy after an upgrade would misread the JSON.
    return HTMLResponse(_page(), headers={"Cache-Control": "no-store"})


@lru_cache(maxsize=1)
def _page() -> str:
    return _PAGE.read_text(encoding="utf-8")
