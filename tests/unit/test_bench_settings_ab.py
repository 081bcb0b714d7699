"""`load.serving.settings_ab`: what a variant is, where its keys land in the config the
bench runs, and that each variant is judged against the shipped run of its own round."""

from __future__ import annotations

import argparse

import pytest

from load.harness.servers import orchard_config
from load.serving.driver import LevelRun
from load.serving.settings_ab import SHIPPED, Variant, parse_variant, summarize


def test_a_variant_is_a_name_and_model_or_app_keys() -> None:
    v = parse_variant('nice0={"model": {"ray_actor_options": {"num_cpus": 0}}}')
    assert v == Variant("nice0", {"ray_actor_options": {"num_cpus": 0}}, {})
    v = parse_variant('quiet = {"app": {"logging_config": {"enable_access_log": false}}}')
    assert v == Variant("quiet", {}, {"logging_config": {"enable_access_log": False}})


@pytest.mark.parametrize("text", [
    "nice0", '={"model": {}}', 'x={"model": ', 'x=[1]', "x={}", 'x={"engine": {}}',
    'x={"model": 3}', 'shipped={"model": {"a": 1}}'])
def test_a_malformed_variant_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_variant(text)


def test_variant_keys_merge_into_the_model_and_the_application() -> None:
    config = orchard_config("builtin:ceiling", "ceiling", 20.0, settings={"num_replicas": 2},
                          app={"logging_config": {"enable_access_log": False},
                               "args": {"observability": {"metrics": False}}})
    application = config["applications"][0]  # type: ignore[index]
    assert application["logging_config"] == {"enable_access_log": False}
    assert application["args"]["observability"] == {"metrics": False}
    model = application["args"]["models"][0]
    assert model["num_replicas"] == 2 and model["source"] == "builtin:ceiling"
    assert model["stream_flush_ms"] == 20.0
    assert application["import_path"] == "deployments.app:build_app"
    # Without a variant, the shipped config as every other benchmark runs it.
    plain = orchard_config("builtin:ceiling", "ceiling", 20.0)["applications"][0]  # type: ignore[index]
    assert plain["args"]["observability"] == {"metrics": True, "request_logs": True}
    assert "logging_config" not in plain


def _run(tps: float, cpu: float = 1.0) -> LevelRun:
    return LevelRun(tokens=int(tps), seconds=1.0, requests=8, ttft_ms=[30.0, 50.0],
                    cpu_s={"model replica": cpu})


def test_each_ratio_is_to_the_shipped_run_of_its_own_round() -> None:
    fast = Variant("fast", {"a": 1})
    rounds = [{"shipped": _run(1000), "fast": _run(1100)},
              {"shipped": _run(800), "fast": _run(900)},
              {"shipped": _run(1200), "fast": _run(1260)}]
    out = summarize([SHIPPED, fast], rounds)
    assert out["shipped"]["over_shipped"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    ratios = out["fast"]["per_round_over_shipped"]
    assert ratios == pytest.approx([1.1, 1.125, 1.05])
    assert out["fast"]["over_shipped"]["median"] == pytest.approx(1.1)
    # The unpaired medians would say 1100 / 1000 = 1.1 too, but only by luck: the pairing
    # is what survives a slow round.
    assert out["fast"]["tps"]["median"] == 1100
    assert out["fast"]["replica_cpu_ms_per_token"] == pytest.approx(3 * 1e3 / 3260)
    assert out["fast"]["ttft_p50_ms"] == 40.0
