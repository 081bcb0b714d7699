"""`build_app(args)`: the Serve application named by `serve_config.yaml`."""

from __future__ import annotations

import time

_IMPORTED = time.time()  # the startup split's mark (deployments.startup_split), first

import os
from typing import Any

from ray.serve import Application, Deployment

from deployments.colocated_deployment import ColocatedModel
from deployments.config import AppArgs, ModelSettings
from deployments.ingress_deployment import EdgeArgs, Ingress
from deployments.model_deployment import ModelDeployment
from deployments.routing.prefix import PrefixAffinityRouter
from deployments.roles import served
from deployments.serve_options import check_http_ports
from deployments.startup_split import BuildMarks
from replicas.sources import BUILTIN_PREFIX, resolve_source
from replicas.versions import MODEL_STACK, SERVING, check as check_versions


def build_app(args: dict[str, Any]) -> Application:
    marks = BuildMarks(imported=_IMPORTED)
    config = AppArgs.model_validate(args)
    # At `serve run`, before Ray starts anything: the head's versions; each replica checks
    # its own node's again before it loads (`replicas.replica`).
    check_versions({**MODEL_STACK, **SERVING})
    check_http_ports(config.http_replicas, os.environ)
    for model in config.models:
        if model.source.startswith(BUILTIN_PREFIX):
            # Build the project's own models here, once, before any replica starts: the app
            # then comes up ready instead of answering 503 while replicas build them. A
            # replica on another node still builds its own copy on first use.
            began = time.perf_counter()
            resolve_source(model.source)
            marks.builtin_s += time.perf_counter() - began
        if model.shards > 1:
            _check_sharding(model)
    created = int(time.time())
    cards = [
        {"id": m.id, "aliases": tuple(m.aliases), "created": created,
         "context_length": m.max_model_len, "capabilities": _capabilities(m),
         "adapters": tuple(m.adapters),
         "adapter_aliases": tuple((a, n) for n, s in m.adapters.items() for a in s.aliases)}
        for m in config.served_models
    ]
    # Each deployment gets its effective placement, so a replica can check Metal itself.
    settings = [m.with_placement(config.cluster.placement)
                .with_memory_wait(config.ingress.request_timeout_s) for m in config.models]
    edge = EdgeArgs.from_config(config)
    if config.colocated:
        # Serve's own limit sits above the replica's admission, so a full replica answers
        # with the API's overloaded error instead of queueing in Ray's router.
        only = settings[0]
        marks.save([only.id])
        colocated = _deployment(ColocatedModel).options(
            **_deployment_options(only, only.max_ongoing_requests + _COLOCATED_HEADROOM))
        return colocated.bind(only.model_dump(), cards[0], edge=edge)
    observability = config.observability.model_dump()
    # A split model's prefill replicas are a deployment of their own, which only its decode
    # replicas call (`prefill:ID`); clients reach the decode ones, under the model's name.
    prefill = {m.id: _model_deployment(m).bind(m.model_dump(), config.ingress.max_stops,
                                               observability)
               for m in settings if m.role == "prefill"}
    models = [_model_deployment(m).bind(m.model_dump(), config.ingress.max_stops, observability,
                                        prefill=prefill.get(m.id))
              for m in served(settings)]
    marks.save([m.id for m in settings])
    return _deployment(Ingress).options(
        num_replicas=config.ingress.num_replicas,
        max_ongoing_requests=config.ingress.max_ongoing_requests,
        # The ingress relays the models' streams: while it is replaced it must drain them too.
        graceful_shutdown_timeout_s=max(m.graceful_shutdown_timeout_s for m in settings),
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
    ).bind(cards, *models, edge=edge)


# How often a stopping replica checks whether its in-flight requests are done. Serve's 2 s
# default is slept before the first check too, so an idle app's stop (ingress, then models)
# waited 4 s for nothing; the drain itself still lasts up to graceful_shutdown_timeout_s.
DRAIN_POLL_S = 0.5

# Requests a colocated replica takes beyond its generation limit: model lists, token counts
# and the over-limit requests it answers with an overloaded error.
_COLOCATED_HEADROOM = 16


def _capabilities(model: ModelSettings) -> tuple[str, ...]:
    """What `/v1/models` says the model does, from its config and its files on disk. A Hub
    model not fetched yet shows what its config says; its replica reads the files it loads,
    and serves embeddings if they say so."""
    from replicas.embedding_files import SENTENCE_TRANSFORMERS_FILES, capabilities, \
        embedding_support
    from replicas.sources import model_files

    if model.shards > 1:  # a sharded replica serves neither (embedder.py, vision.py)
        return ("text",)
    reranks = _reranks(model)
    if reranks is not None:
        return reranks
    directory = model_files(model.source, SENTENCE_TRANSFORMERS_FILES, fetch=False)
    support = embedding_support(directory, model.embeddings, model.embedding_dimensions)
    found = capabilities(support, opted_in=model.embeddings is not None)
    return (*found, "vision") if _sees(model) and "text" in found else found


def _reranks(model: ModelSettings) -> tuple[str, ...] | None:
    """A reranker's capabilities (replicas/reranker.py): a decoder with `kind: rerank` also
    generates; a cross-encoder only reranks. None: not a reranker."""
    from replicas.reranker import is_cross_encoder
    from replicas.sources import model_config

    if model.kind == "rerank":
        return ("text", "rerank")
    config = model_config(model.source, fetch=False)
    return ("rerank",) if config is not None and is_cross_encoder(config) else None


def _sees(model: ModelSettings) -> bool:
    """Whether the model takes images: its config.json, or (a Hub model not on disk yet)
    `kind: vision`, which its replica then holds it to."""
    from replicas.sources import model_config
    from replicas.vision import sees

    config = model_config(model.source, fetch=False)
    if config is None:
        return model.kind == "vision"
    return sees(config, model.kind)


def _check_sharding(model: ModelSettings) -> None:
    """A `shards`/`sharding` the architecture cannot take fails the deploy, naming the
    field; a Hub model not on disk is checked by its replica, once fetched."""
    from replicas.sharding import sharding_problem
    from replicas.sources import model_config

    config = model_config(model.source, fetch=False)
    if config is None:
        return
    problem = sharding_problem(config, model.shards, model.sharding,
                               model.distributed.pipeline_layers)
    if problem is not None:
        raise ValueError(f"model '{model.id}': {problem}")


def _model_deployment(settings: ModelSettings) -> Deployment:
    options = _deployment_options(settings, settings.max_ongoing_requests)
    return _deployment(ModelDeployment).options(**options)


def _deployment(decorated: object) -> Deployment:
    # `@serve.deployment` turned the class into a Deployment; a type checker still sees the class.
    assert isinstance(decorated, Deployment)
    return decorated


def _deployment_options(settings: ModelSettings, max_ongoing: int) -> dict[str, Any]:
    options: dict[str, Any] = {
        "name": f"{'prefill' if settings.role == 'prefill' else 'model'}:{settings.id}",
        "max_ongoing_requests": max_ongoing,
        "max_queued_requests": settings.max_queued_requests,
        "ray_actor_options": _actor_options(settings),
        "graceful_shutdown_timeout_s": settings.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": DRAIN_POLL_S,
    }
    if settings.shards > 1:
        # One bundle per shard: Serve reserves them with the replica, which runs in the
        # first and starts the other ranks in the rest (`deployments.shards`).
        options["placement_group_bundles"] = [_bundle(settings)] * settings.shards
        options["placement_group_strategy"] = settings.placement_strategy
    policy = settings.routing_policy
    if policy != "none":
        options["request_router_config"] = {
            "request_router_class": PrefixAffinityRouter,
            "request_router_kwargs": {"policy": policy, "max_keys": settings.routing.max_keys,
                                      "max_imbalance": settings.routing.max_imbalance},
            # How fresh the KV memory the router weighs is (`record_routing_stats`).
            "request_routing_stats_period_s": settings.routing.stats_period_s}
    if settings.num_replicas == "auto":
        options["num_replicas"] = "auto"
        options["autoscaling_config"] = {**_auto_defaults(settings),
                                         **(settings.autoscaling_config or {})}
    elif settings.autoscaling_config is not None:
        options["autoscaling_config"] = settings.autoscaling_config
    else:
        options["num_replicas"] = settings.num_replicas
    return options


def _actor_options(settings: ModelSettings) -> dict[str, Any]:
    options = dict(settings.ray_actor_options or {"num_cpus": 0})
    placement = settings.placement
    if placement is not None and placement.pin:
        options["resources"] = {**options.get("resources", {}),
                                placement.resource: placement.resource_per_replica}
    return options


def _bundle(settings: ModelSettings) -> dict[str, float]:
    placement = settings.placement
    if placement is not None and placement.pin:
        return {placement.resource: placement.resource_per_replica}
    # Unpinned shards take no resource of their own; Ray needs a bundle to hold something.
    return {"CPU": 0.01}


def _auto_defaults(settings: ModelSettings) -> dict[str, Any]:
    # Ray's `auto` targets 2 ongoing requests per replica, right for a model that serves one
    # at a time; ours batch max_batch_size sequences, so scale out when a batch is half full.
    return {"target_ongoing_requests": max(1, settings.engine.max_batch_size // 2)}
