"""Images for the tests of image input (`ingress/images.py`): real encodings made with
Pillow, broken ones, and a PNG whose header claims more pixels than it holds."""

from __future__ import annotations

import base64
import io
import random
import struct
import zlib

from PIL import Image


def encoded(fmt: str, width: int = 8, height: int = 6, *, noise: bool = False) -> bytes:
    """An RGB image in Pillow's format `fmt`; `noise`: random pixels, so it compresses
    badly (a size that a byte limit can catch, data that truncation breaks)."""
    if noise:
        rng = random.Random(width * 1000 + height)
        image = Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))
    else:
        image = Image.new("RGB", (width, height), (200, 30, 30))
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


def png(width: int = 8, height: int = 6, *, noise: bool = False) -> bytes:
    return encoded("PNG", width, height, noise=noise)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data)}"


def truncated_png() -> bytes:
    """A PNG cut in half: its header opens, its pixels do not decode."""
    whole = png(64, 64, noise=True)
    return whole[:len(whole) // 2]


def header_only_png(width: int, height: int) -> bytes:
    """A PNG that is nothing but a header claiming `width` x `height`: a decompression
    bomb's shape, in 57 bytes."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")
