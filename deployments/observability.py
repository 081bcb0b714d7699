"""The `observability:` config made real in a replica: the ingress's request observer
(metrics and request logs) and the engine metrics poller."""

from __future__ import annotations

import logging
import sys
from typing import Callable

from deployments.config import ObservabilitySettings
from deployments.metrics import EngineMetrics, EnginePoller, RequestMetrics
from ingress.observe import FanOut, RequestObserver
from ingress.request_log import RequestLogger
from replicas.engine.stats import EngineStats
from replicas.timings import TimingSamples


def request_observer(settings: ObservabilitySettings) -> RequestObserver | None:
    """What the ingress reports each finished request to; None: nothing is traced."""
    observers: list[RequestObserver] = []
    if settings.metrics:
        observers.append(RequestMetrics())
    if settings.request_logs:
        _show_info("orchard.requests")
        observers.append(RequestLogger(json_lines=settings.json_logs))
    if not observers:
        return None
    return observers[0] if len(observers) == 1 else FanOut(tuple(observers))


def engine_poller(settings: ObservabilitySettings, model: str,
                  read: Callable[[], tuple[EngineStats, TimingSamples]],
                  shards: int = 1) -> EnginePoller | None:
    if not settings.metrics:
        return None
    return EnginePoller(EngineMetrics(model, shards), read, settings.metrics_interval_s).start()


def _show_info(name: str) -> None:
    # A Ray worker leaves the root logger at WARNING: without this, INFO lines are dropped.
    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    if not logger.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
