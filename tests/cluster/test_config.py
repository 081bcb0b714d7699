"""Cluster config without a cluster: the example config, placement, scaling options, the
Metal check, the worker helper's command line, and that each value has one home. Fast; no
Ray instance is started."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from deployments import cluster as cluster_cli
from deployments.app import _model_deployment
from deployments.config import (
    AppArgs,
    IngressSettings,
    ModelSettings,
    PlacementSettings,
    replica_max_stops,
)
from deployments.model_clients import REPLICA_WAIT_S
from deployments.model_deployment import ModelDeployment, replica_options
from deployments.serve_options import (
    check_http_ports,
    controller_options,
    direct_ingress_env,
    serving_on,
)
from load.harness.serve_settings import serve_settings
from replicas.engine.config import EngineConfig
from replicas.families.registry import CHANNEL_FORMATS, TOOL_FORMATS
from replicas.replica import ReplicaOptions

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]


def deployments(args: dict[str, Any]) -> dict[str, Any]:
    """Model deployment name to its Serve deployment, as build_app makes them."""
    config = AppArgs.model_validate(args)
    settings = [m.with_placement(config.cluster.placement) for m in config.models]
    return {d.name: d for d in map(_model_deployment, settings)}


def model(**extra: Any) -> dict[str, Any]:
    return {"id": "m", "source": "builtin:tiny", **extra}


@pytest.mark.parametrize("name", ["serve_config.cluster.yaml", "serve_config.yaml"])
def test_shipped_configs_validate(name: str) -> None:
    config = yaml.safe_load((ROOT / name).read_text())
    ServeDeploySchema.model_validate(config)  # the Serve side: what `serve deploy` checks
    for app in config["applications"]:
        AppArgs.model_validate(app["args"])


@pytest.mark.parametrize("name", ["serve_config.cluster.yaml", "serve_config.yaml"])
def test_shipped_configs_carry_orchards_serve_settings(name: str) -> None:
    # One home: the YAML spells out deployments.serve_options, which tests and benchmarks
    # that build their own config use, so what they run is what users run.
    config = yaml.safe_load((ROOT / name).read_text())
    if name == "serve_config.yaml":  # one Mac: its replica serves 8000, Serve's proxy 8001
        assert config == serving_on(config, 8000)
    else:  # a cluster: Serve's proxy on the head serves the port
        assert config["controller_options"] == controller_options()
    assert ServeDeploySchema.model_validate(config).controller_options is not None


def test_benchmarks_serve_as_the_shipped_config_on_any_port() -> None:
    # load/ reads the shipped YAML (it never imports deployments/): moved to another port, its
    # Serve blocks are what the tests' `serving_on` makes of the same config.
    shipped = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    for port in (8000, 8300):
        moved = serving_on(shipped, port)
        assert serve_settings(port) == {k: moved[k] for k in
                                        ("proxy_location", "http_options", "controller_options")}
    assert serving_on(shipped, 8300)["http_options"]["port"] == 8301
    proxied = serve_settings(8300, direct=False)  # HAProxy's, or several HTTP replicas
    assert proxied == {k: serving_on(shipped, 8300, direct=False)[k] for k in proxied}
    assert proxied["http_options"]["port"] == 8300
    assert proxied["controller_options"] == controller_options()


@pytest.mark.parametrize(("ingress", "model", "replicas"), [
    ({}, {}, 1),  # the shipped config: colocated, one replica
    ({"colocate": False}, {"num_replicas": 3}, 1),  # one ingress in front of three
    ({"num_replicas": 2}, {}, 2),
    ({"colocate": True}, {"num_replicas": 2}, 2),
    ({"colocate": True}, {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}, 4),
    ({"colocate": True}, {"num_replicas": "auto"}, None),
])
def test_direct_ingress_takes_as_many_http_replicas_as_it_has_ports(
        ingress: dict[str, Any], model: dict[str, Any], replicas: int | None) -> None:
    args = AppArgs.model_validate({"models": [{"id": "m", "source": "builtin:tiny", **model}],
                                   "ingress": ingress})
    assert args.http_replicas == replicas
    one_port = direct_ingress_env(8000)
    if replicas == 1:
        check_http_ports(args.http_replicas, one_port)
    else:
        with pytest.raises(ValueError, match="gives them port 8000"):
            check_http_ports(args.http_replicas, one_port)
    # Serve's proxy, Serve's own port range, or HAProxy balancing over it: no refusal.
    check_http_ports(args.http_replicas, {})
    check_http_ports(args.http_replicas, {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"})
    check_http_ports(args.http_replicas, {**one_port, "RAY_SERVE_ENABLE_HA_PROXY": "1"})
    if replicas is not None:
        wide = {**one_port, "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(8000 + replicas)}
        check_http_ports(args.http_replicas, wide)


def test_cluster_config_pins_every_model_to_macs() -> None:
    config = yaml.safe_load((ROOT / "serve_config.cluster.yaml").read_text())
    built = deployments(config["applications"][0]["args"])
    assert built["model:qwen3-4b"].ray_actor_options["resources"] == {"apple_silicon": 1}
    assert built["model:qwen3-0.6b"].ray_actor_options["resources"] == {"apple_silicon": 0.5}
    assert config["proxy_location"] == "HeadOnly"


def test_default_config_runs_anywhere() -> None:
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    args = AppArgs.model_validate(config["applications"][0]["args"])
    (built,) = deployments(config["applications"][0]["args"]).values()
    assert built.ray_actor_options == {"num_cpus": 0}  # no custom resource asked for
    assert not args.models[0].with_placement(args.cluster.placement).placement.metal_required


def test_model_placement_overrides_only_the_keys_it_sets() -> None:
    raw = {
        "cluster": {"placement": {"pin": True, "resource": "mac", "require_metal": False}},
        "models": [model(id="a"), model(id="b", placement={"resource_per_replica": 0.25}),
                   model(id="c", placement={"pin": False}),
                   model(id="d", ray_actor_options={"num_cpus": 1, "resources": {"x": 1}})],
    }
    args = AppArgs.model_validate(raw)
    placed = {m.id: m.with_placement(args.cluster.placement).placement for m in args.models}
    assert placed["b"].pin and placed["b"].resource == "mac" and not placed["b"].metal_required
    assert placed["b"].resource_per_replica == 0.25
    built = deployments(raw)
    assert built["model:a"].ray_actor_options == {"num_cpus": 0, "resources": {"mac": 1.0}}
    assert built["model:b"].ray_actor_options["resources"] == {"mac": 0.25}
    assert "resources" not in built["model:c"].ray_actor_options
    assert built["model:d"].ray_actor_options == {"num_cpus": 1, "resources": {"x": 1, "mac": 1.0}}


def test_require_metal_follows_pin_unless_set() -> None:
    for placement, required in (({"pin": True}, True), ({"pin": False}, False),
                                ({"pin": True, "require_metal": False}, False),
                                ({"require_metal": True}, True)):
        settings = ModelSettings.model_validate(model(placement=placement))
        assert settings.placement is not None
        assert settings.placement.metal_required is required


@pytest.mark.parametrize("bad", [
    {"placement": {"pin": True, "resource": ""}},
    {"placement": {"resource_per_replica": 0}},
    {"placement": {"pinned": True}},
    {"autoscaling_config": {"max_replica": 4}},  # a typo Ray itself would ignore
    {"autoscaling_config": {"min_replicas": 3, "max_replicas": 2}},
    {"num_replicas": 2, "autoscaling_config": {"max_replicas": 4}},
])
def test_bad_placement_and_scaling_are_rejected(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"models": [model(**bad)]})


def test_scaling_options_reach_serve() -> None:
    built = deployments({"models": [
        model(id="fixed", num_replicas=3),
        model(id="auto", num_replicas="auto"),
        model(id="auto-capped", num_replicas="auto", autoscaling_config={"max_replicas": 3}),
        model(id="scaled", autoscaling_config={"min_replicas": 1, "max_replicas": 4}),
    ]})
    assert built["model:fixed"].num_replicas == 3
    auto = built["model:auto"]._deployment_config.autoscaling_config
    assert auto.target_ongoing_requests == 16  # half the default batch of 32, not Ray's 2
    capped = built["model:auto-capped"]._deployment_config.autoscaling_config
    assert (capped.max_replicas, capped.target_ongoing_requests) == (3, 16)
    scaled = built["model:scaled"]._deployment_config.autoscaling_config
    assert (scaled.min_replicas, scaled.max_replicas) == (1, 4)
    assert built["model:fixed"]._deployment_config.graceful_shutdown_timeout_s == 300


def test_replica_without_metal_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_cli, "metal_available", lambda: False)
    settings = ModelSettings.model_validate(model(id="big", placement={"pin": True}))
    with pytest.raises(RuntimeError, match=r"model 'big' requires Metal .* has no Metal GPU"):
        ModelDeployment.func_or_class(settings.model_dump())  # before any model loading


def test_worker_command(capsys: pytest.CaptureFixture[str],
                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_cli, "metal_available", lambda: True)
    assert cluster_cli.main(["worker", "--address", "10.0.0.1:6379", "--dry-run",
                             "--", "--block"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[1:] == ["start", "--address", "10.0.0.1:6379", "--num-cpus", "0",
                           "--resources", '\'{"apple_silicon":', "1}'", "--block"]
    assert cluster_cli.main(["head", "--with-models", "--amount", "0.5", "--dry-run"]) == 0
    assert '\'{"apple_silicon": 0.5}\'' in capsys.readouterr().out


def test_worker_without_metal_is_refused(capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_cli, "metal_available", lambda: False)
    assert cluster_cli.main(["worker", "--address", "h:6379", "--dry-run"]) == 2
    assert "no Metal GPU" in capsys.readouterr().err
    assert cluster_cli.main(["worker", "--address", "h:6379", "--dry-run",
                             "--allow-no-metal"]) == 0


# ---- each config value in one place -----------------------------------------------------

def test_engine_and_replica_defaults_come_from_the_replica_side() -> None:
    defaults = ModelSettings.model_validate(model())
    engine = EngineConfig()
    assert defaults.engine.model_dump() == {
        "max_batch_size": engine.max_batch_size,
        "prefill_batch_size": engine.prefill_batch_size,
        "prefill_step_size": engine.prefill_step_size,
        "stuck_after_s": engine.stuck_after_s,
        "kv_bits": engine.kv_bits,
        "kv_group_size": engine.kv_group_size,
    }
    assert defaults.stream_flush_ms == ReplicaOptions("m", "s").flush_interval_s * 1000
    options = replica_options(defaults)
    assert options.engine == engine
    assert options.flush_interval_s == ReplicaOptions("m", "s").flush_interval_s
    assert defaults.stream_chunks_per_s == ReplicaOptions("m", "s").max_chunks_per_s
    assert options.max_chunks_per_s == ReplicaOptions("m", "s").max_chunks_per_s
    tuned = replica_options(ModelSettings.model_validate(model(stream_chunks_per_s=0)))
    assert tuned.max_chunks_per_s == 0  # no bound: one chunk per engine step, as before


def test_constants_are_the_config_defaults() -> None:
    assert cluster_cli.DEFAULT_RESOURCE == PlacementSettings().resource
    assert REPLICA_WAIT_S == IngressSettings().replica_wait_s


def test_channel_format_is_checked_against_the_registry() -> None:
    for name in CHANNEL_FORMATS:
        assert ModelSettings.model_validate(model(channel_format=name)).channel_format == name
    with pytest.raises(ValidationError, match="unknown channel_format 'thinktags'"):
        ModelSettings.model_validate(model(channel_format="thinktags"))


def test_tool_format_is_checked_against_the_registry() -> None:
    assert TOOL_FORMATS, "the tool-format registry is empty"
    for name in TOOL_FORMATS:
        settings = ModelSettings.model_validate(model(tool_format=name))
        assert replica_options(settings).tool_format == name
    assert replica_options(ModelSettings.model_validate(model())).tool_format is None
    with pytest.raises(ValidationError, match="unknown tool_format 'no-such-format'"):
        ModelSettings.model_validate(model(tool_format="no-such-format"))


def test_max_tokens_past_context_reaches_the_replica() -> None:
    assert replica_options(ModelSettings.model_validate(model())).max_tokens_past_context == \
        "clamp"
    rejecting = ModelSettings.model_validate(model(max_tokens_past_context="reject"))
    assert replica_options(rejecting).max_tokens_past_context == "reject"
    with pytest.raises(ValidationError, match="max_tokens_past_context"):
        ModelSettings.model_validate(model(max_tokens_past_context="truncate"))


def test_one_stop_limit_the_replica_allows_it_plus_the_defaults() -> None:
    settings = ModelSettings.model_validate(model(default_stops=["a", "b"]))
    assert replica_options(settings, 5).max_stops == 7
    assert replica_options(settings).max_stops == IngressSettings().max_stops + 2
    assert replica_max_stops(3, settings) == 5
    with pytest.raises(ValidationError, match="max_stops"):  # the per-model key is gone
        ModelSettings.model_validate(model(max_stops=4))


def test_a_batch_smaller_than_a_prefill_is_refused() -> None:
    # mlx-lm would silently decode prefill_batch_size sequences at once instead.
    with pytest.raises(ValidationError, match="prefill_batch_size .* must not exceed"):
        ModelSettings.model_validate(model(engine={"max_batch_size": 4}))
    settings = ModelSettings.model_validate(
        model(engine={"max_batch_size": 4, "prefill_batch_size": 4}))
    assert replica_options(settings).engine.max_batch_size == 4


def test_an_empty_queue_bound_is_refused_before_ray_sees_it() -> None:
    with pytest.raises(ValidationError, match="max_queued_requests is -1"):
        ModelSettings.model_validate(model(max_queued_requests=0))
    assert ModelSettings.model_validate(model(max_queued_requests=1)).max_queued_requests == 1


def test_memory_waits_less_than_the_request_deadline() -> None:
    """Unless set, a request waits for KV memory 90% of ingress.request_timeout_s, so the
    engine's overloaded error (with Retry-After) comes before the deadline's 504."""
    config = AppArgs.model_validate({"models": [model()], "ingress": {"request_timeout_s": 100}})
    derived = config.models[0].with_memory_wait(config.ingress.request_timeout_s)
    assert derived.memory.max_wait_s == pytest.approx(90)
    assert replica_options(derived).engine.max_memory_wait_s == pytest.approx(90)
    pinned = ModelSettings.model_validate(model(memory={"max_wait_s": 5}))
    assert pinned.with_memory_wait(100).memory.max_wait_s == 5
    assert ModelSettings.model_validate(model()).with_memory_wait(None).memory.max_wait_s is None
    whole = ModelSettings.model_validate(model(memory={"reservation": "whole"}))
    assert replica_options(whole).engine.kv_reservation == "whole"
