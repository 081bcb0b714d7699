"""What the ingress needs from the model layer: a stream of events per request.

Deployments implement it over Ray handles; tests implement it with scripted events, so
adapters are testable with FastAPI's TestClient and no model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import AsyncIterator, Literal, Mapping, Protocol, Sequence

from replicas.contract import (
    EmbeddingRequest,
    EmbeddingResult,
    GenerationRequest,
    OutputEvent,
    RerankRequest,
    RerankResult,
    TokenizerInfo,
)


@dataclass(frozen=True)
class ModelCard:
    id: str
    owned_by: str = "orchard"
    created: int = 0
    context_length: int | None = None
    aliases: tuple[str, ...] = ()
    # What `/v1/models` says the model does: `text` (chat, completions), `embeddings`,
    # `vision` (reads images in chat messages: ingress/media.py), `rerank` (/v1/rerank).
    capabilities: tuple[str, ...] = ("text",)
    # The model's LoRA adapters, each served as `ID:NAME`, and aliases of such a pair
    # (alias -> adapter name); `adapter`: the one a request named (`require_model`).
    adapters: tuple[str, ...] = ()
    adapter_aliases: tuple[tuple[str, str], ...] = ()
    adapter: str | None = None

    def adapter_names(self) -> tuple[str, ...]:
        """Every name its adapters are served under: `ID:NAME`, then the aliases."""
        return (*(f"{self.id}:{a}" for a in self.adapters), *(a for a, _ in self.adapter_aliases))


VISION = "vision"  # the capability of a model that is sent images, not placeholders

# A configured model's state: `loading` until a replica serves it (its requests wait, then
# get the overloaded answer with Retry-After, `ingress.errors.ModelLoadingError`), then `ready`;
# `failed` while none serves and Serve gave up on its starts for now (refused at once).
ModelState = Literal["loading", "ready", "failed"]


class ModelStates(Protocol):
    async def states(self) -> Mapping[str, ModelState]:
        """Each served model's state by id; a model left out is ready."""
        ...


class ModelClient(Protocol):
    def models(self) -> Sequence[ModelCard]:
        """The served models, in config order."""
        ...

    def resolve(self, model: str) -> ModelCard | None:
        """The card for a model id or alias, or None if it is not served."""
        ...

    def stream(self, request: GenerationRequest) -> AsyncIterator[list[OutputEvent]]:
        """Events for one request, in order, coalesced into lists.

        Raises `replicas.errors.ReplicaError` (or yields a `Failed` event) on failure;
        the last event is always terminal. Closing the iterator cancels the generation.
        """
        ...

    async def tokenize(self, request: GenerationRequest,
                       add_special_tokens: bool = True) -> tuple[int, ...]:
        """The prompt's token ids once rendered by the model's template, as generation would
        run them (`add_special_tokens` false: a text prompt without the tokenizer's BOS)."""
        ...

    async def detokenize(self, model: str, token_ids: tuple[int, ...]) -> str:
        """The ids' text (special tokens kept)."""
        ...

    async def tokenizer_info(self, model: str) -> TokenizerInfo:
        ...

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        """The inputs' vectors, in order; raises `replicas.errors.ReplicaError` on failure
        (a model that serves no embeddings is a 400)."""
        ...

    async def rerank(self, request: RerankRequest) -> RerankResult:
        """Each document's relevance score, in request order; raises
        `replicas.errors.ReplicaError` on failure (a model that does not rerank is a 400)."""
        ...


class WrappedClient:
    """A ModelClient around another that forwards everything; a layer at the edge (limits,
    tracing) overrides only what it adds to."""

    def __init__(self, inner: ModelClient) -> None:
        self._inner = inner

    def models(self) -> Sequence[ModelCard]:
        return self._inner.models()

    def resolve(self, model: str) -> ModelCard | None:
        return self._inner.resolve(model)

    def stream(self, request: GenerationRequest) -> AsyncIterator[list[OutputEvent]]:
        return self._inner.stream(request)

    async def tokenize(self, request: GenerationRequest,
                       add_special_tokens: bool = True) -> tuple[int, ...]:
        return await self._inner.tokenize(request, add_special_tokens)

    async def detokenize(self, model: str, token_ids: tuple[int, ...]) -> str:
        return await self._inner.detokenize(model, token_ids)

    async def tokenizer_info(self, model: str) -> TokenizerInfo:
        return await self._inner.tokenizer_info(model)

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        return await self._inner.embed(request)

    async def rerank(self, request: RerankRequest) -> RerankResult:
        return await self._inner.rerank(request)


def require_model(client: ModelClient, name: str) -> ModelCard:
    """The served model for a request's `model`, or a 404 that lists the valid names. A
    LoRA adapter (`BASE:NAME`, or an alias of the pair) is its base model's card with
    `adapter` set; an adapter the base does not serve is a 400 naming it."""
    from replicas.errors import InvalidRequestError, NotFoundError

    card = client.resolve(name)
    if card is None:
        for served in client.models():
            adapter = dict(served.adapter_aliases).get(name)
            if adapter is not None:
                return replace(served, adapter=adapter)
        base, colon, adapter = name.rpartition(":")
        card = client.resolve(base) if colon else None
        if card is not None:
            if adapter in card.adapters:
                return replace(card, adapter=adapter)
            known = ", ".join(card.adapters) or "none"
            raise InvalidRequestError(f"model '{base}' has no adapter '{adapter}'; its "
                                      f"adapters: {known}", param="model")
        names = ", ".join(c.id for c in client.models())
        raise NotFoundError(f"model '{name}' is not served here; available models: {names}",
                            param="model")
    return card


def adapted(request: GenerationRequest, card: ModelCard) -> GenerationRequest:
    """The request with the LoRA adapter its `model` named (`require_model`), if any."""
    return replace(request, adapter=card.adapter) if card.adapter else request
