"""Ray Serve's own settings that Orchard runs with, in one place.

Serve reads its knobs from environment variables in the processes it starts. A config's
`controller_options.runtime_env.env_vars` reaches the Serve controller, and through it the
proxies and replicas the controller creates, so these live in `serve_config.yaml` and the
cluster config rather than on the command line that starts Ray. Tests and benchmarks that
build their own config or call `serve.start` take them from here, so they run what users run.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

SERVE_ENV: Mapping[str, str] = MappingProxyType({
    # Serve's proxy reaches the replicas over gRPC instead of Ray actor calls: 40% less CPU
    # per streamed token in the proxy, about 10% less in the replica (load/RESULTS.md, "The
    # proxy's hop over gRPC"). Only the proxy's hop: calls between deployments stay actor
    # calls, because a KV pull's answer (gigabytes on a big model) moves through Ray's object
    # store by reference, where gRPC's by-value results would copy it into one message.
    "RAY_SERVE_PROXY_USE_GRPC": "1",
})


def controller_options() -> dict[str, Any]:
    """The `controller_options` block of a Serve config (or `serve.start`'s argument)."""
    return {"runtime_env": {"env_vars": dict(SERVE_ENV)}}
