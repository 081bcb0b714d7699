"""Loading and unloading LoRA adapters at run time: `GET /v1/adapters` (every adapter
served, configured or loaded here), `POST /v1/adapters` (load one onto every replica of a
model) and `DELETE /v1/adapters/{BASE:NAME}` (unload one loaded here).

Behind the API keys like every route but `/health`; with tenants configured, an admin
tenant's only (as `GET /v1/usage`). The work is the deployments' (`AdapterControl`, given
to `create_app`): they read and check the adapter on a replica, tell every replica of the
model, and teach the ingress its name. An app built without one answers a 404. Errors are
OpenAI's shape: a model not served 404; a bad adapter 400 naming why; a name (or alias)
already served 409.

Unloading lets the rows on the adapter finish: the name leaves routing at once (a new
request for it is a 400), and each replica frees it when its last row ends. The DELETE
answers 200 once every replica has, or 202 with how many still hold it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Protocol, Sequence

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from ingress.client import ModelClient
from ingress.errors import OPENAI_ERRORS, error_response
from ingress.tenancy.seat import current_seat
from ingress.wire_json import JSONBody
from replicas.contract import ErrorKind
from replicas.errors import InvalidRequestError, NotFoundError

# An adapter's name: served as `BASE:NAME`, so no colon, and nothing a URL must escape.
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_ALIAS = r"^[^:\s]{1,128}$"  # a model name of its own: not `BASE:NAME`


class LoadAdapter(BaseModel):
    """`POST /v1/adapters`'s body."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)  # the base model's id or alias
    name: str = Field(pattern=_NAME)
    path: str = Field(min_length=1)  # an mlx-lm adapter directory on the replicas' nodes
    aliases: list[Annotated[str, Field(pattern=_ALIAS)]] = Field(default_factory=list,
                                                                 max_length=16)


@dataclass(frozen=True)
class AdapterEntry:
    """One adapter as `GET /v1/adapters` lists it. `path`: None for a configured one (its
    path is the replicas' config); `replicas`: how many serve it, where known."""

    model: str
    name: str
    aliases: tuple[str, ...] = ()
    path: str | None = None
    runtime: bool = False
    replicas: int | None = None

    def body(self) -> dict[str, Any]:
        return {"id": f"{self.model}:{self.name}", "object": "adapter", "model": self.model,
                "name": self.name, "aliases": list(self.aliases), "path": self.path,
                "source": "runtime" if self.runtime else "config", "replicas": self.replicas}


@dataclass(frozen=True)
class Unloaded:
    entry: AdapterEntry
    pending: int  # replicas still holding it (rows decoding on it), which free it as they end


class AdapterConflict(Exception):
    """A name already taken (409), with OpenAI's `code`."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class AdapterControl(Protocol):
    async def adapters(self) -> Sequence[AdapterEntry]:
        """Every adapter served now, configured ones first."""
        ...

    async def load(self, model: str, name: str, path: str,
                   aliases: tuple[str, ...]) -> AdapterEntry:
        """Load `name` onto every replica of `model` (its id; the name checked free), and
        route `model:name` and the aliases to it. `InvalidRequestError`: a bad adapter."""
        ...

    async def unload(self, model: str, name: str) -> Unloaded:
        """Stop routing to run-time adapter `name`; its replicas free it as its rows end."""
        ...


router = APIRouter()


@router.get("/v1/adapters")
async def list_adapters(request: Request) -> Any:
    control = _control(request)
    if isinstance(control, JSONBody):
        return control
    return JSONBody({"object": "list", "data": [e.body() for e in await control.adapters()]})


@router.post("/v1/adapters")
async def load_adapter(body: LoadAdapter, request: Request) -> Any:
    control = _control(request)
    if isinstance(control, JSONBody):
        return control
    client: ModelClient = request.app.state.client
    card = client.resolve(body.model)
    if card is None:
        raise NotFoundError(f"model '{body.model}' is not served", param="model")
    taken = _served_names(client)
    for alias in body.aliases:
        if alias in taken:
            return _conflict(f"alias '{alias}' is already a served model name",
                             "adapter_exists", "aliases")
    if body.name in card.adapters:
        return _conflict(f"model '{card.id}' already serves adapter '{body.name}'; unload it "
                         "first", "adapter_exists", "name")
    if len(set(body.aliases)) < len(body.aliases):
        raise InvalidRequestError("aliases repeat a name", param="aliases")
    try:
        entry = await control.load(card.id, body.name, body.path, tuple(body.aliases))
    except AdapterConflict as exc:  # another admin call took the name meanwhile
        return _conflict(str(exc), exc.code, "name")
    return JSONBody(entry.body())


@router.delete("/v1/adapters/{adapter_id:path}")
async def unload_adapter(adapter_id: str, request: Request) -> Any:
    control = _control(request)
    if isinstance(control, JSONBody):
        return control
    client: ModelClient = request.app.state.client
    base, colon, name = adapter_id.rpartition(":")
    card = client.resolve(base) if colon else None
    if card is None or name not in card.adapters:
        raise NotFoundError(f"no adapter '{adapter_id}' is served (name one as BASE:NAME, as "
                            "GET /v1/adapters lists them)")
    entries = {(e.model, e.name): e for e in await control.adapters()}
    entry = entries.get((card.id, name))
    if entry is not None and not entry.runtime:
        raise InvalidRequestError(f"adapter '{card.id}:{name}' is configured: remove it from "
                                  "the model's `adapters` in the config instead")
    unloaded = await control.unload(card.id, name)
    return JSONBody({**unloaded.entry.body(), "deleted": True, "pending": unloaded.pending},
                    status_code=202 if unloaded.pending else 200)


def _control(request: Request) -> AdapterControl | JSONBody:
    """The deployments' control, or the answer to give instead: the admin check first."""
    if request.app.state.tenants:
        seat = current_seat()
        if seat is None or not seat.policy.admin:
            return error_response(ErrorKind.UNAUTHORIZED, f"{request.method} /v1/adapters "
                                  "needs an admin tenant's key", OPENAI_ERRORS, status=403)
    control: AdapterControl | None = request.app.state.adapter_control
    if control is None:
        return error_response(ErrorKind.NOT_FOUND, "this server cannot load adapters at run "
                              "time (it runs outside Ray Serve)", OPENAI_ERRORS)
    return control


def _served_names(client: ModelClient) -> set[str]:
    return {n for card in client.models()
            for n in (card.id, *card.aliases, *card.adapter_names())}


def _conflict(message: str, code: str, param: str) -> JSONBody:
    return error_response(ErrorKind.INVALID_REQUEST, message, OPENAI_ERRORS, param=param,
                          code=code, status=409)
