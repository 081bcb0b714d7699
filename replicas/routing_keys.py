"""A prompt's prefix keys: hashes over its leading units (messages of a chat, blocks of text
or tokens), which the router (`deployments.routing.prefix`) and each replica's prefix
directory (`replicas.engine.kv.directory`) compute alike from the request, without a
tokenizer. The router looks a request's keys up; a replica publishes the keys whose tokens
its prefix cache holds.

A chain is seeded with the tools (they render before the messages). A routed request
records the key of its whole prompt, and of its prompt less the last message; the next
turn of the conversation extends that prompt, so its chain contains the first, and a retry
with an edited last message contains the second.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable

from replicas.contract import ChatMessage, ChatPrompt, GenerationRequest, TextPrompt, \
    TokenPrompt

TEXT_BLOCK_CHARS = 512  # a completions prompt is chained in blocks of this many characters
TOKEN_BLOCK = 128  # and a token prompt in blocks of this many tokens


@dataclass(frozen=True)
class RoutingKeys:
    """`chain`: lookup keys, deepest first; `record`: the keys a routed request leaves."""

    chain: tuple[bytes, ...]
    record: tuple[bytes, ...]
    session: bool = False


def routing_keys(request: GenerationRequest, policy: str) -> RoutingKeys | None:
    """The request's keys under `policy` (`prefix` or `session`); None: no affinity."""
    if request.session_key:
        key = b"s:" + request.session_key.encode("utf-8", "replace")
        return RoutingKeys((key,), (key,), session=True)
    if policy != "prefix":
        return None
    chain = _prefix_chain(request)
    if not chain:
        return None
    # The whole prompt, and (past a first exchange) the prompt before its last message:
    # not shallower, or every conversation sharing a system prompt would follow the first.
    record = (chain[-1],) + ((chain[-2],) if len(chain) >= 3 else ())
    return RoutingKeys(tuple(reversed(chain)), record)


def token_spans(request: GenerationRequest, prompt_tokens: int,
                boundary: int) -> tuple[tuple[bytes, int], ...]:
    """The request's recorded prefix keys, each with the prompt tokens it stands for: what
    a replica's directory needs to say whether its cache holds that prefix. A chat's whole
    prompt is its `prompt_tokens`, and its prompt less the last message ends at `boundary`
    (0: unknown); a token prompt's keys cover whole blocks. A text prompt's blocks of
    characters end at no known token, so it has none."""
    prompt = request.prompt
    if isinstance(prompt, TextPrompt):
        return ()
    chain = _prefix_chain(request)
    if isinstance(prompt, ChatPrompt):
        spans = [(chain[-1], prompt_tokens)] if chain else []
        if len(chain) >= 3 and boundary > 0:
            spans.append((chain[-2], boundary))
        return tuple(spans)
    spans = [(chain[-1], TOKEN_BLOCK * len(chain))] if chain else []
    if len(chain) >= 3:
        spans.append((chain[-2], TOKEN_BLOCK * (len(chain) - 1)))
    return tuple(spans)


def _prefix_chain(request: GenerationRequest) -> list[bytes]:
    seed = digest(b"t", repr(request.tools).encode())
    if request.adapter is not None:  # a LoRA adapter's KV is its own: another key space
        seed = digest(seed, b"adapter", request.adapter.encode())
    return list(_chain(seed, _units(request)))


def _units(request: GenerationRequest) -> Iterable[bytes]:
    prompt = request.prompt
    if isinstance(prompt, ChatPrompt):
        return (_message_bytes(m) for m in prompt.messages)
    if isinstance(prompt, TextPrompt):
        text = prompt.text.encode("utf-8", "replace")
        step = TEXT_BLOCK_CHARS
        return (text[i:i + step] for i in range(0, len(text) - step + 1, step))
    assert isinstance(prompt, TokenPrompt)
    ids = prompt.token_ids
    return (repr(ids[i:i + TOKEN_BLOCK]).encode()
            for i in range(0, len(ids) - TOKEN_BLOCK + 1, TOKEN_BLOCK))


def _message_bytes(message: ChatMessage) -> bytes:
    return repr((message.role, message.content, message.reasoning, message.tool_calls,
                 message.tool_call_id, message.name)).encode("utf-8", "replace")


def _chain(seed: bytes, units: Iterable[bytes]) -> Iterable[bytes]:
    current = seed
    for unit in units:
        current = digest(current, unit)
        yield current


def digest(*parts: bytes) -> bytes:
    """A 16-byte hash of `parts`, each length-prefixed (no two splits hash alike)."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()

