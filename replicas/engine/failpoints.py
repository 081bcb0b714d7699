"""Test-only fault injection, in the style of etcd's gofail and fail-rs failpoints.

Off unless the environment variable `ORCHARD_FAILPOINTS` names a directory (read once, at
import): a call site then costs one module-level boolean test,
`if failpoints.ENABLED: failpoints.hit(...)`. On, a test arms a failpoint by creating the
file `<dir>/<name>.<scope>` (`arm`); the first process that reaches `hit(name, scope)`
claims the file by renaming it (atomic: exactly one process wins, across processes and
nodes of one machine) and raises `FailpointError`, so the fault takes the code's real path.
Armed once, it fires once: a replacement replica does not fail again. The claimed file
stays, renamed `<name>.<scope>.fired.<pid>`, so a test can tell which process fired it.

A hold is the other kind: `hold(name, scope)` waits while the file `<dir>/<name>.<scope>`
exists (`arm_hold`), up to the seconds written in it, so a test makes a step slow for as
long as it wants and ends the wait by deleting the file.

Failpoints (name: where, scope):
- `step`: `Engine._step`, before the batch steps (rank 0 of a sharded replica); the model id.
- `load` (a hold): `ModelReplica.start`, before the model loads; the model id. A model that
  is still loading, for as long as the test needs one.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "ORCHARD_FAILPOINTS"

ENABLED: bool = False
_directory: Path | None = None


class FailpointError(RuntimeError):
    """An armed failpoint fired."""


def configure(directory: str | os.PathLike[str] | None) -> None:
    """Arm-able failpoints under `directory`, or none (None or empty: off)."""
    global ENABLED, _directory
    _directory = Path(directory) if directory else None
    ENABLED = _directory is not None


def armed_path(directory: str | os.PathLike[str], name: str, scope: str) -> Path:
    # A model id may hold a slash ("org/model"): one file name either way.
    return Path(directory) / f"{name}.{scope.replace(os.sep, '_')}"


def arm(directory: str | os.PathLike[str], name: str, scope: str) -> Path:
    """Make `name` fire once in the next process of `scope` that reaches it."""
    path = armed_path(directory, name, scope)
    path.touch()
    return path


def hit(name: str, scope: str) -> None:
    """Raise `FailpointError` if `name` is armed for `scope` and this process claims it.
    Callers test `ENABLED` first, so that off, nothing but that test runs."""
    if _directory is None:
        return
    armed = armed_path(_directory, name, scope)
    try:
        armed.rename(armed.with_name(f"{armed.name}.fired.{os.getpid()}"))
    except FileNotFoundError:  # not armed, or another process claimed it first
        return
    raise FailpointError(f"failpoint {name} fired for {scope} (test-only fault injection)")


configure(os.environ.get(ENV))


# A hold's longest wait where its file names none: a forgotten file cannot hang a replica.
HOLD_S = 300.0


def arm_hold(directory: str | os.PathLike[str], name: str, scope: str,
             limit_s: float = HOLD_S) -> Path:
    """Make `name` wait in every process of `scope` that reaches it, until the file is
    deleted or `limit_s` passed."""
    path = armed_path(directory, name, scope)
    path.write_text(f"{limit_s}\n")
    return path


def hold(name: str, scope: str, poll_s: float = 0.1) -> float:
    """Wait while `name` is armed as a hold for `scope` (its file exists), up to the
    seconds the file says; the seconds waited. Callers test `ENABLED` first."""
    if _directory is None:
        return 0.0
    armed = armed_path(_directory, name, scope)
    start = time.monotonic()
    try:
        limit = float(armed.read_text().strip() or HOLD_S)
    except FileNotFoundError:
        return 0.0
    except ValueError:
        limit = HOLD_S
    while armed.exists() and time.monotonic() - start < limit:
        time.sleep(poll_s)
    return time.monotonic() - start
