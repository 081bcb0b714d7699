"""Whose KV a cache entry is: the fingerprint the disk tier files entries under and a pull
checks before adopting. Two models share it only if they would build the same KV for the
same tokens: the same config, tokenizer, dtype, KV quantization, sharding, and weights.

The weights are known by their files, without reading them whole (a 100 GB checkpoint
would take minutes): each safetensors file's name, size and header (names, shapes, dtypes,
offsets, metadata), its Hub blob name where the file is a link into a Hub cache (the blob is
named by its content's SHA-256), and a hash of 256 small pieces spread over its data, which
catches a fine-tune written with the same shapes (it changes nearly every tensor).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from replicas.engine.kv.disk import FORMAT

_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
_SAMPLES = 256
_SAMPLE_BYTES = 4096


def model_fingerprint(directory: Path, model: Any, kv_bits: int | None = None,
                      kv_group_size: int = 0, *sharding: object) -> str:
    """What makes KV reusable: the model's config and tokenizer files, its weights
    (`weights_identity`), its dtype, the KV's quantization (a quantized layer cannot join an
    unquantized batch), and on a sharded replica how it is split (a rank holds its part of
    each layer)."""
    digest = hashlib.sha256(f"orchard-kv {FORMAT}".encode())
    if kv_bits is not None:
        digest.update(f"kv {kv_bits} bits, group {kv_group_size}".encode())
    if sharding:
        digest.update(f"sharded {sharding!r}".encode())
    for name in _FILES:
        path = directory / name
        if path.is_file():
            digest.update(name.encode() + path.read_bytes())
    digest.update(weights_identity(directory).encode())
    weights: dict[str, mx.array] = dict(tree_flatten(model.parameters()))
    digest.update(str(next(iter(weights.values())).dtype if weights else "").encode())
    return digest.hexdigest()[:16]


def weights_identity(directory: Path) -> str:
    """The identity of the safetensors files in `directory` (see the module's note)."""
    files = sorted(Path(directory).glob("*.safetensors"))
    keys = tuple((str(f.resolve()), *_stat(f)) for f in files)
    return _identity(tuple(f.name for f in files), keys)


def _stat(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=16)
def _identity(names: tuple[str, ...], keys: tuple[tuple[str, int, int], ...]) -> str:
    """Cached by path, size and mtime: a replica asks twice (its disk tier, its puller)."""
    digest = hashlib.sha256()
    for name, (real, size, _) in zip(names, keys):
        digest.update(f"{name} {size}\n".encode())
        real_path = Path(real)
        if real_path.parent.name == "blobs":  # a Hub cache: the blob's name is its SHA-256
            digest.update(f"blob {real_path.name}\n".encode())
        with real_path.open("rb") as file:
            head = file.read(8)
            header = file.read(int.from_bytes(head, "little")) if len(head) == 8 else b""
            digest.update(hashlib.sha256(head + header).digest())
            start = len(head) + len(header)
            span = max(0, size - start)
            for i in range(_SAMPLES if span else 0):
                file.seek(start + span * i // _SAMPLES)
                digest.update(file.read(_SAMPLE_BYTES))
            if span:  # the file's end, whatever the spacing missed
                file.seek(max(start, size - _SAMPLE_BYTES))
                digest.update(file.read(_SAMPLE_BYTES))
    return digest.hexdigest()

