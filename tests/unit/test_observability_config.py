"""The `observability:` block: defaults, and what turning metrics and logs off leaves."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.config import AppArgs, ObservabilitySettings
from deployments.observability import engine_poller, request_observer
from ingress.request_log import RequestLogger

MODELS = [{"id": "m", "source": "builtin:tiny"}]


def test_defaults_and_unknown_keys() -> None:
    settings = AppArgs.model_validate({"models": MODELS}).observability
    assert (settings.metrics, settings.request_logs, settings.json_logs) == (True, True, False)
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"models": MODELS, "observability": {"metric": False}})
    with pytest.raises(ValidationError):
        ObservabilitySettings(metrics_interval_s=0)


def test_all_off_means_nothing_is_traced_or_polled() -> None:
    off = ObservabilitySettings(metrics=False, request_logs=False)
    assert request_observer(off) is None
    assert engine_poller(off, "m", lambda: pytest.fail("polled")) is None


def test_logs_without_metrics() -> None:
    observer = request_observer(ObservabilitySettings(metrics=False, json_logs=True))
    assert isinstance(observer, RequestLogger)
