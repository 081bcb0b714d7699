"""The edge's part of `serve_config.yaml`'s `args:`: the HTTP ingress (`ingress:`, its
images), the Responses store (`responses:`) and observability (`observability:`).
`deployments.config` re-exports them beside the models' settings. The edge's limits take
their defaults from `ingress.options.EdgeOptions`, their one home."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from deployments.replica_settings import _Strict
from ingress.options import EdgeOptions

_EDGE = EdgeOptions()
_IMAGES = _EDGE.images


class ImageSettings(_Strict):
    """`ingress.images`: what a request's images may be, for a model that sees; defaults
    from `ingress.options.ImageLimits`. Past a limit: a 400 naming it."""

    max_count: int = Field(_IMAGES.max_count, ge=0,
                           description="Images in one request, history included.")
    max_bytes: int = Field(_IMAGES.max_bytes, ge=1, description="One image's encoded size "
                           "(decoded from base64, or as fetched), in bytes.")
    max_pixels: int = Field(_IMAGES.max_pixels, ge=1, description="One image's width x "
                            "height, read from its header before it is decoded.")
    fetch_urls: bool = Field(_IMAGES.fetch_urls, description="Fetch http(s) image URLs "
                             "(the server then requests any host a client names); false: "
                             "only inline base64 images, a URL is a 400.")
    fetch_timeout_s: float = Field(_IMAGES.fetch_timeout_s, gt=0,
                                   description="One image fetch, connecting to the last byte.")
    fetch_private: bool = Field(_IMAGES.fetch_private, description="With `fetch_urls`: "
                                "also fetch from loopback, private and link-local addresses "
                                "(refused by default, redirects included, so a caller cannot "
                                "reach the cluster's own services).")


class IngressSettings(_Strict):
    """The edge's limits take their defaults from `ingress.options.EdgeOptions`, their one
    home, so an app built without a config (tests, `create_app`) enforces the same ones."""

    num_replicas: int = Field(1, ge=1)
    max_ongoing_requests: int = Field(1024, ge=1)
    request_timeout_s: float | None = Field(
        _EDGE.request_timeout_s, gt=0, description="Wall-clock limit for one HTTP request, "
        "queueing included: a 504, or an error event ending a stream that outlives it. "
        "null: no limit.")
    max_body_bytes: int = Field(_EDGE.max_body_bytes, ge=1024,
                                description="Larger request bodies are a 413.")
    max_stops: int = Field(_EDGE.max_stops, ge=1, description="Most stop strings plus stop "
                           "token ids one request may send, checked before any replica time. "
                           "A model's replicas allow this many plus its `default_stops` "
                           "(`replica_max_stops`), so defaults never eat into it.")
    max_stop_chars: int = Field(_EDGE.max_stop_chars, ge=1,
                                description="Longest stop string, in characters.")
    cors_origins: list[str] = Field(default_factory=list, description="Origins allowed to "
                                    "call from a browser (`*` for any); empty: CORS off.")
    images: ImageSettings = Field(default_factory=ImageSettings)
    replica_wait_s: float | None = Field(
        15.0, gt=0, description="How long a request waits for a model replica to accept it "
        "(none running, all busy starting) before a 503/529. null: wait without limit.")
    resume_attempts: int = Field(
        4, ge=0, description="Times one stream may move to another replica (or the "
        "replacement) after its replica died, froze or lost a shard under it: the new "
        "replica continues where the old one stopped. 0: the stream ends with the error "
        "event.")
    resume_wait_s: float = Field(
        60.0, gt=0, description="Seconds a stream may spend resuming, from its first "
        "failure, waiting for a replica included; past it, the protocol's error event.")
    colocate: bool | Literal["auto"] = Field(
        "auto", description="Serve HTTP from the model's own replicas: one process and one Ray "
        "hop fewer per token, admission in the replica. `auto` (default): when one model runs "
        "on exactly one fixed replica and `num_replicas` here is 1; `true`: one model at any "
        "scale (behind Serve's proxy, which then picks a replica with no cache-aware routing: "
        "the shipped config's one port serves one replica); `false`: "
        "always an ingress deployment in front. Colocated, `num_replicas`, "
        "`max_ongoing_requests`, `replica_wait_s` and the resume settings "
        "here are unused: the replica is the HTTP server, so its streams end with it.")


class ResponsesSettings(_Strict):
    """The Responses API's store (`store: true`, `previous_response_id`)."""

    store: Literal["sqlite", "memory", "redis"] = Field(
        "sqlite", description="`sqlite`: a file that survives replica and store restarts; "
        "`memory`: in the process (lost on a restart); `redis`: a Redis server at `url`, "
        "shared by every HTTP-serving replica on every node.")
    url: str | None = Field(None, min_length=1, description="`store: redis`'s server: "
                            "`redis://[:password@]host:port/db` (`rediss://`: TLS).")
    key_prefix: str | None = Field(None, min_length=1, description="`store: redis`'s key "
                                   "prefix; unset: `orchard:responses:<app>:`.")
    path: str | None = Field(None, min_length=1, description="The SQLite file; unset: "
                             "`responses/<app>.sqlite3` under Orchard's cache directory "
                             "($ORCHARD_CACHE_DIR, else ~/.cache/orchard). With several "
                             "HTTP-serving replicas one store actor owns it, on one node.")
    max_entries: int = Field(1024, ge=1, description="Responses kept (least recently used "
                             "go first).")
    max_bytes: int = Field(64 << 20, ge=1024, description="JSON bytes kept.")
    ttl_s: float = Field(3600.0, gt=0, description="How long a response is kept.")

    @model_validator(mode="after")
    def _url_for_redis(self) -> "ResponsesSettings":
        if (self.store == "redis") != (self.url is not None) or \
                (self.key_prefix is not None and self.store != "redis"):
            raise ValueError("responses.url (needed) and .key_prefix are for store: redis only")
        return self


class ObservabilitySettings(_Strict):
    """Metrics and logs (`deployments.metrics`, `ingress.observe`); README "Observability"."""

    metrics: bool = Field(True, description="Export `orchard_*` metrics at Ray's Prometheus "
                          "endpoint; false: no per-request tracing and no engine polling.")
    metrics_interval_s: float = Field(2.0, gt=0, description="How often a replica reads its "
                                      "engine's gauges and counters into the metrics.")
    request_logs: bool = Field(True, description="One log line per finished request: ids, "
                               "token counts, timings, finish reason; never prompt or output.")
    json_logs: bool = Field(False, description="Write request log lines as JSON objects "
                            "instead of `key=value` text.")
