"""Ray Serve's own settings that Orchard runs with, in one place.

Serve reads its knobs from environment variables in the processes it starts. A config's
`controller_options.runtime_env.env_vars` reaches the Serve controller, and through it the
proxies and replicas the controller creates, so these live in `serve_config.yaml` and the
cluster config rather than on the command line that starts Ray. Tests and benchmarks that
build their own config or call `serve.start` take them from here, so they run what users run.
"""

from __future__ import annotations

import copy
import os
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


def direct_ingress_env(port: int) -> dict[str, str]:
    """Serve's direct ingress on `port`: the replica that serves HTTP (the colocated model
    replica, or the ingress replica) listens there itself, so no token crosses Serve's proxy
    and no gRPC hop (load/RESULTS.md, "The replica serves HTTP itself"). Serve's proxy still
    runs, on the head node only, at the config's `http_options.port`."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        # One port, as any server has, and Serve hands it to a replacement replica. Serve's
        # own range (30000-31000) is for a load balancer in front, which one Mac has none of.
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # exclusive
        # Serve keeps a dead replica's port from its replacement for 150 s, so that HAProxy's
        # old processes cannot reach a new server; without HAProxy nothing else holds it.
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        # A stopping replica stays open 30 s for a load balancer to take it out of rotation
        # (its open requests are drained either way); with none, that is only a slow stop.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }


def check_http_ports(http_replicas: int | None, environ: Mapping[str, str]) -> None:
    """Refuse, at build time, more HTTP-serving replicas than direct ingress has ports: Serve
    would start the first and retry the others forever. `environ`: where the app is built
    (the controller's task, which has the config's `controller_options` variables)."""
    if environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") != "1":
        return
    first = environ.get("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT")
    end = environ.get("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT")
    if first is None or end is None or environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        return  # Serve's own range, or HAProxy in front: it balances over many ports
    ports = int(end) - int(first)
    if http_replicas is None or http_replicas > ports:
        many = "an unbounded number of" if http_replicas is None else str(http_replicas)
        given = f"port {first}" if ports == 1 else f"{ports} ports, {first}-{int(end) - 1}"
        raise ValueError(
            f"this config serves HTTP from {many} replicas, but gives them {given} (Serve's "
            "direct ingress: controller_options' RAY_SERVE_DIRECT_INGRESS_* variables). "
            "Serve HTTP from one "
            "replica (ingress.num_replicas: 1, or ingress.colocate: false in front of "
            "several model replicas), or serve through Serve's proxy as "
            "serve_config.cluster.yaml does: drop the direct-ingress variables and set "
            "http_options.port to the port clients use")


def bind_like_serves_proxy() -> None:
    """Let this replica's direct-ingress server bind as Serve's proxy binds its port.

    Ray 2.60 binds the replica's port without SO_REUSEADDR, where its proxy sets it (with
    SO_REUSEPORT, `SERVE_SOCKET_REUSE_PORT_ENABLED`). A replica replacing one that closed
    connections in the last minute then fails to bind (they linger in TIME_WAIT), and Serve
    blocks the port for good: with one port, the app never comes back. Seen here on a
    restart of `serve run` and between the end-to-end layouts. Called in the constructor of
    each deployment that may hold the port, which runs before Serve starts that server."""
    from ray.serve._private import replica as serve_replica

    start = serve_replica.start_asgi_http_server
    if getattr(start, "binds_like_proxy", False) or \
            os.environ.get("SERVE_SOCKET_REUSE_PORT_ENABLED", "1") != "1":
        return

    async def binding_like_proxy(app: Any, options: Any, *, event_loop: Any,
                                 enable_so_reuseport: bool = False) -> Any:
        return await start(app, options, event_loop=event_loop, enable_so_reuseport=True)

    binding_like_proxy.binds_like_proxy = True  # type: ignore[attr-defined]
    setattr(serve_replica, "start_asgi_http_server", binding_like_proxy)  # noqa: B010


def controller_options(direct_port: int | None = None) -> dict[str, Any]:
    """The `controller_options` block of a Serve config (or `serve.start`'s argument);
    `direct_port`: the replica serves HTTP there itself (`direct_ingress_env`)."""
    env = {**SERVE_ENV, **(direct_ingress_env(direct_port) if direct_port else {})}
    return {"runtime_env": {"env_vars": env}}


def serving_on(config: Mapping[str, Any], port: int, *, direct: bool = True) -> dict[str, Any]:
    """A copy of a one-Mac config (`serve_config.yaml`) that serves on `port`: the replica
    there, Serve's proxy on the next port, as the shipped config has them at 8000 and 8001.
    `direct=False`: Serve's proxy (or HAProxy) on `port` in front of the replicas, as the
    cluster config has it; for several replicas serving HTTP on one machine."""
    moved = copy.deepcopy(dict(config))
    moved["http_options"] = {**moved.get("http_options", {}), "port": port + direct}
    moved["controller_options"] = controller_options(direct_port=port if direct else None)
    return moved
