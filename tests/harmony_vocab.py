"""openai-harmony's o200k_base vocabulary, offline, for the tests that load the real encoding.

`openai_harmony.load_harmony_encoding()` reads `o200k_base.tiktoken` from
`$TIKTOKEN_ENCODINGS_BASE` when that is set (else it downloads it from
openaipublic.blob.core.windows.net, which this machine cannot reach) and checks its
SHA-256 either way. The `bpe-openai` wheel (a test extra) ships the very same file gzipped
as package data, so it is unpacked once into `$ORCHARD_CACHE_DIR/tiktoken/` (else
`~/.cache/orchard/tiktoken/`) and the variable is pointed there.

Production code never needs this: the replica's Harmony routing is text-level data
(`replicas/families/harmony.py`).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

from replicas.builtin.build import orchard_cache

FILE_NAME = "o200k_base.tiktoken"
# The hash openai-harmony 0.0.8 (and tiktoken) pin for o200k_base; a wrong file fails to load.
SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
ENV_VAR = "TIKTOKEN_ENCODINGS_BASE"


class VocabUnavailable(RuntimeError):
    """bpe-openai is not installed, or its file is not the pinned vocabulary."""


def vocab_dir() -> Path:
    return orchard_cache("tiktoken")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _packaged_vocab() -> bytes:
    # find_spec locates the wheel without importing it (its native library is 74 MB).
    spec = importlib.util.find_spec("bpe_openai")
    if spec is None or spec.origin is None:
        raise VocabUnavailable("bpe-openai is not installed (pip install -e '.[test]')")
    packed = Path(spec.origin).parent / "data" / f"{FILE_NAME}.gz"
    if not packed.is_file():
        raise VocabUnavailable(f"bpe-openai ships no {packed.name}")
    data = gzip.decompress(packed.read_bytes())
    if _sha256(data) != SHA256:
        raise VocabUnavailable(f"{packed} is not the o200k_base vocabulary openai-harmony pins")
    return data


def ensure_vocab(directory: Path | None = None) -> Path:
    """The directory holding a verified `o200k_base.tiktoken`, written there if missing."""
    directory = directory or vocab_dir()
    target = directory / FILE_NAME
    if target.is_file() and _sha256(target.read_bytes()) == SHA256:
        return directory
    data = _packaged_vocab()
    directory.mkdir(parents=True, exist_ok=True)
    # Write then rename: a concurrent reader sees no file or the whole file.
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{FILE_NAME}.")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return directory


def use_offline_vocab() -> Path:
    """Point `TIKTOKEN_ENCODINGS_BASE` at a verified vocabulary; returns the directory.

    A value already set is kept when it holds the file (someone provisioned it on purpose).
    """
    current = os.environ.get(ENV_VAR)
    if current and (Path(current) / FILE_NAME).is_file():
        return Path(current)
    directory = ensure_vocab()
    os.environ[ENV_VAR] = str(directory)
    return directory


def load_gpt_oss_encoding() -> Any:
    """`openai_harmony`'s HARMONY_GPT_OSS encoding, loaded without network access."""
    import openai_harmony as oh  # type: ignore[import-untyped]

    use_offline_vocab()
    return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)


def render_completion(encoding: Any, messages: Any) -> str:
    """What the model writes after the generation prompt `<|start|>assistant`: the assistant
    messages as the encoder renders each, the last ending the turn (`<|return|>` after a
    final message, as in training; a call already ends in `<|call|>`).

    `render_conversation_for_training` would drop analysis before a final message (gpt-oss
    does not see old reasoning), but a completion holds it, so messages render one by one.
    """
    text = "".join(encoding.decode(encoding.render(m)) for m in messages)
    text = text.removeprefix("<|start|>assistant")
    return text.removesuffix("<|end|>") + "<|return|>" if text.endswith("<|end|>") else text
