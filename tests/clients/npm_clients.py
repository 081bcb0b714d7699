"""The pinned coding agents from npm, installed once per pinned set and reused.

`package.json` beside this file pins exact versions. The install lives in
`$ORCHARD_CACHE_DIR/npm/<hash>` (else `~/.cache/orchard/npm/<hash>`), the hash covering
that file and the platform (the packages pull a native binary per OS and CPU). One
installer holds an flock and installs into a temporary folder that is renamed into place,
so a folder under its final name is always complete.
"""

from __future__ import annotations

import hashlib
import platform
import shutil
import subprocess
from pathlib import Path

from replicas.builtin.build import cached_build, orchard_cache

PACKAGE_JSON = Path(__file__).with_name("package.json")
BINARIES = ("claude", "codex")
INSTALL_TIMEOUT_S = 900


class NpmInstallError(RuntimeError):
    pass


def npm_cache_root() -> Path:
    return orchard_cache("npm")


def install_key() -> str:
    material = PACKAGE_JSON.read_bytes() + f"{platform.system()}-{platform.machine()}".encode()
    return hashlib.sha256(material).hexdigest()[:16]


def ensure_clients(root: Path | None = None) -> Path:
    """The `node_modules/.bin` folder holding `claude` and `codex`, installed if missing."""
    folder = cached_build(root or npm_cache_root(), install_key(), _install)
    return folder / "node_modules" / ".bin"


def _complete(folder: Path) -> bool:
    return all((folder / "node_modules" / ".bin" / name).exists() for name in BINARIES)


def _install(folder: Path) -> None:
    npm = shutil.which("npm")
    if npm is None:
        raise NpmInstallError("npm is not on PATH; the client tests need node and npm")
    shutil.copy(PACKAGE_JSON, folder / "package.json")
    argv = [npm, "install", "--no-audit", "--no-fund", "--loglevel=warn"]
    try:
        done = subprocess.run(argv, cwd=folder, capture_output=True, text=True,
                              timeout=INSTALL_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise NpmInstallError(f"npm install ran past {INSTALL_TIMEOUT_S}s") from exc
    if done.returncode != 0 or not _complete(folder):
        raise NpmInstallError(
            f"npm install failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n"
            f"{done.stderr[-3000:]}")
