"""What the HTTP edge enforces before a request costs any replica time.

Plain data so the app is buildable without the deployment layer: `deployments/config.py`
validates the YAML, takes its defaults from here (their one home) and fills these in;
tests build them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ingress.tenancy.policy import TenantPolicy

MIB = 1024 * 1024


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be, for a model that sees (`ingress/images.py`);
    anything past a limit is a 400 that names it."""

    max_count: int = 16  # images in one request, history included
    max_bytes: int = 10 * MIB  # one image, encoded (decoded from base64, or as fetched)
    # One image's width x height, read from its header before any decoding, so a small
    # file that decodes to gigabytes (a decompression bomb) is refused unopened.
    max_pixels: int = 50_000_000
    # Fetching http(s) image URLs makes the server a client of any host a caller names, so
    # it is off unless the operator turns it on; off, only inline (base64) images are read.
    fetch_urls: bool = False
    fetch_timeout_s: float = 10.0  # one fetch, connecting to the last byte
    # Where fetching is on, a URL (or a redirect) to a loopback, private or link-local
    # address is still refused: a caller must not reach the cluster's own services through
    # it. On: every address may be fetched.
    fetch_private: bool = False


@dataclass(frozen=True)
class EdgeOptions:
    # Empty: no authentication. Kept out of repr so logging the options never logs a key.
    api_keys: frozenset[str] = field(default=frozenset(), repr=False)
    # Origins allowed to call from a browser; empty: no CORS headers at all.
    cors_origins: tuple[str, ...] = ()
    # Larger bodies are a 413 before they are parsed. Room for a few inline images: base64
    # makes each a third larger than its bytes (`ImageLimits.max_bytes`).
    max_body_bytes: int = 32 * MIB
    # Wall-clock limit for one HTTP request, queueing included; None: no limit.
    request_timeout_s: float | None = 600.0
    # Stop strings plus stop token ids in one request; the model's own cap may be lower.
    max_stops: int = 16
    # Longest stop string, in characters: the stop matcher's automaton grows with the total.
    max_stop_chars: int = 256
    images: ImageLimits = ImageLimits()
    # Who may call and what each may use (`ingress/tenancy/`); empty: `api_keys` alone
    # decide, every request the default tenant. Out of repr: they hold keys.
    tenants: tuple[TenantPolicy, ...] = field(default=(), repr=False)
