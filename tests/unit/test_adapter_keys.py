"""A LoRA adapter's KV in its own key space (`replicas/engine/kv/namespace.py`,
`replicas/routing_keys.py`): the prefix cache's keys keep their length and never meet the
base's or another adapter's; the router's prefix keys and a replica's directory, which
publishes the keys its cache holds, separate adapters alike."""

from __future__ import annotations

import dataclasses

from replicas.contract import ChatMessage, ChatPrompt, GenerationRequest, TokenPrompt
from replicas.engine.kv.directory import BLOCK_TOKENS, PrefixDirectory, block_hashes
from replicas.engine.kv.namespace import namespaced
from replicas.routing_keys import routing_keys, token_spans

TOKENS = list(range(3, 3 + 3 * BLOCK_TOKENS))


def test_a_namespace_keeps_the_length_and_changes_the_first_position() -> None:
    assert namespaced(TOKENS, 0) == TOKENS
    a, b = namespaced(TOKENS, 7), namespaced(TOKENS, 8)
    assert len(a) == len(TOKENS) and a[1:] == TOKENS[1:]
    assert a[0] < 0 and b[0] < 0 and a[0] != b[0]
    assert namespaced([5, *TOKENS[1:]], 7)[0] != a[0]  # the first token still counts
    assert namespaced(TOKENS, (1 << 30) - 1)[0] >= -(1 << 63)  # fits the directory's int64
    # No whole-block prefix is shared: every block hash differs.
    assert not set(block_hashes(a)) & set(block_hashes(TOKENS))
    assert not set(block_hashes(a)) & set(block_hashes(b))


def test_routing_keys_and_the_directory_separate_adapters() -> None:
    chat = GenerationRequest("r", "m", ChatPrompt((ChatMessage("system", "s" * 40),
                                                   ChatMessage("user", "hi"),
                                                   ChatMessage("assistant", "yo"),
                                                   ChatMessage("user", "more"))))
    tokens = GenerationRequest("t", "m", TokenPrompt(tuple(TOKENS)))
    for request in (chat, tokens):
        base = routing_keys(request, "prefix")
        alpha = routing_keys(dataclasses.replace(request, adapter="alpha"), "prefix")
        again = routing_keys(dataclasses.replace(request, adapter="alpha"), "prefix")
        beta = routing_keys(dataclasses.replace(request, adapter="beta"), "prefix")
        assert base is not None and alpha is not None and beta is not None
        assert alpha == again
        assert not set(alpha.chain) & set(base.chain)
        assert not set(alpha.chain) & set(beta.chain)
    # A replica that served alpha's prompt publishes alpha's keys once its cache holds the
    # namespaced tokens, and never the base's for the same text.
    directory = PrefixDirectory()
    alpha_request = dataclasses.replace(tokens, adapter="alpha")
    held = namespaced(TOKENS, 7)
    directory.learn(token_spans(alpha_request, len(TOKENS), 0), held)
    directory.held.add(tuple(held))
    published = directory.published()
    alpha_keys = routing_keys(alpha_request, "prefix")
    base_keys = routing_keys(tokens, "prefix")
    assert alpha_keys is not None and base_keys is not None
    assert set(alpha_keys.record) <= published
    assert not set(base_keys.chain) & published
