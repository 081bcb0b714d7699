"""What the HTTP edge enforces before a request costs any replica time.

Plain data so the app is buildable without the deployment layer: `deployments/config.py`
validates the YAML, takes its defaults from here (their one home) and fills these in;
tests build them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIB = 1024 * 1024


@dataclass(frozen=True)
class EdgeOptions:
    # Empty: no authentication. Kept out of repr so logging the options never logs a key.
    api_keys: frozenset[str] = field(default=frozenset(), repr=False)
    # Origins allowed to call from a browser; empty: no CORS headers at all.
    cors_origins: tuple[str, ...] = ()
    # Larger bodies are a 413 before they are parsed; chat prompts fit far below this.
    max_body_bytes: int = 4 * MIB
    # Wall-clock limit for one HTTP request, queueing included; None: no limit.
    request_timeout_s: float | None = 600.0
    # Stop strings plus stop token ids in one request; the model's own cap may be lower.
    max_stops: int = 16
    # Longest stop string, in characters: the stop matcher's automaton grows with the total.
    max_stop_chars: int = 256
