"""A streamed chat completion over a bare socket, for benchmarks that share their cores
with the server they measure (`load.serving.ceiling`): no HTTP client library and no JSON per
chunk, so the load generator's own CPU stays out of the figures."""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass

from load.harness.servers import HOST

# A text-carrying delta; `"content":""` (Orchard's role chunk) is not the first token.
_CONTENT = re.compile(rb'"content":\s*"[^"]')


@dataclass
class Result:
    """One streamed request: tokens from its usage (0 unless exactly as asked)."""

    tokens: int = 0
    ttft: float | None = None
    error: str | None = None


def dechunk(body: bytes) -> bytes:
    """HTTP/1.1 chunked framing, undone once per request: a usage line split across two
    chunks would otherwise not parse."""
    out, pos = bytearray(), 0
    while True:
        end = body.index(b"\r\n", pos)
        size = int(body[pos:end].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += body[end + 2:end + 2 + size]
        pos = end + 2 + size + 2


def final_usage(body: bytes) -> dict[str, int] | None:
    """The last SSE line with a non-null usage, searched from the end: only it is parsed."""
    for line in reversed(body.split(b"\n")):
        if line.startswith(b"data:") and b'"usage"' in line:
            usage = json.loads(line[5:]).get("usage")
            if usage:
                return usage
    return None


async def stream_once(port: int, model: str, prompt: str, tokens: int,
                      bias: dict[str, float]) -> Result:
    """One streamed chat completion over a bare socket. The load generator shares the 2
    cores with the server, so no HTTP client library and no JSON per chunk: the bytes are
    kept as they come, and only the final usage line is parsed."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True},
                       **({"logit_bias": bias} if bias else {})}).encode()
    # Connection: close, so the end of the response is simply EOF, for either server.
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(HOST, port)
    data, ttft = bytearray(), None
    try:
        writer.write(head + body)
        while piece := await reader.read(65536):
            data += piece
            if ttft is None and _CONTENT.search(data, max(0, len(data) - len(piece) - 16)):
                ttft = time.perf_counter() - start
    finally:
        writer.close()
    headers, _, payload = bytes(data).partition(b"\r\n\r\n")
    status = headers.split(b"\r\n", 1)[0]
    if b" 200 " not in status + b" ":
        return Result(error=status.decode(errors="replace") or "no response")
    if b"transfer-encoding: chunked" in headers.lower():
        payload = dechunk(payload)
    usage = final_usage(payload)
    if not usage:
        return Result(error="no usage (stream cut short)")
    if usage["completion_tokens"] != tokens:  # unequal work would skew the comparison
        return Result(error=f"short: {usage['completion_tokens']} of {tokens} tokens")
    return Result(tokens, ttft)


async def bounded(port: int, model: str, prompt: str, tokens: int, bias: dict[str, float],
                  timeout_s: float) -> Result:
    try:
        return await asyncio.wait_for(stream_once(port, model, prompt, tokens, bias), timeout_s)
    except (OSError, ValueError, asyncio.TimeoutError) as exc:
        return Result(error=f"{type(exc).__name__}: {exc}")
