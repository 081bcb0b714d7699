"""The index both KV tiers look a prompt up in: cached token sequences in a trie, and the
entry that serves the longest prefix of a prompt.

mlx-lm's `PromptTrie` is the model (a dict per token), but its search finds the shortest
entry that runs on past a prompt by visiting every entry below the point where the prompt
leaves the trie, copying the path so far at each node. A thousand cached conversations of
1,500 tokens after one shared system prompt made one lookup take 0.87 s on this box, two
thousand of 2,500 took 5.8 s (`load/bench_prefix_lookup.py`), on the engine thread, with
every stream waiting. Here each node keeps the length of the shortest entry at or below it
and the child that leads there, so that entry is one walk down: a lookup costs the prompt
plus that entry, however many entries there are.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

Key = tuple[int, ...]
_KEY = "key"  # a node where an entry ends: the entry (token keys are ints, never these)
_SHORTEST = "shortest"  # the length of the shortest entry at or below a node
_VIA = "via"  # the child token toward that entry (None: it ends at this node)

Node = dict[Any, Any]


class PrefixTrie:
    """Token sequences (entries). Not thread-safe: each tier calls it under its own rule."""

    def __init__(self) -> None:
        self._root: Node = {}

    def add(self, key: Key) -> bool:
        """Hold `key`; whether it was held already."""
        node = self._root
        for depth, token in enumerate(key, 1):
            node = node.setdefault(token, {})
            if node.get(_SHORTEST, len(key) + 1) > len(key):
                node[_SHORTEST] = len(key)
                node[_VIA] = key[depth] if depth < len(key) else None
        held = _KEY in node
        node[_KEY] = key
        return held

    def remove(self, key: Key) -> None:
        """Forget `key`, which must be held."""
        path = [self._root]
        for token in key:
            path.append(path[-1][token])
        del path[-1][_KEY]
        for depth in range(len(key), 0, -1):
            node = path[depth]
            if len(node) == 2:  # its marks alone: no entry at or below it now
                del path[depth - 1][key[depth - 1]]
                continue
            shortest, via = _shortest(node)
            if (shortest, via) == (node[_SHORTEST], node[_VIA]):
                break  # nothing above it changes either
            node[_SHORTEST], node[_VIA] = shortest, via

    def remove_prefixes(self, key: Key) -> list[Key]:
        """Forget the entries that are proper prefixes of `key`; they are returned."""
        node, found = self._root, []
        for token in key[:-1]:
            if token not in node:
                break
            node = node[token]
            if _KEY in node:
                found.append(node[_KEY])
        for prefix in found:
            self.remove(prefix)
        return found

    def longest_prefix(self, tokens: Sequence[int],
                       trimmable: Callable[[Key], bool]) -> tuple[Key, int] | None:
        """The entry serving the longest prefix of `tokens`, and that prefix's length.

        An entry that is a prefix of `tokens` serves all of itself. Where `tokens` run on in
        the trie past the longest such entry, the shortest entry through the point where
        they leave it serves that far instead, if `trimmable` says it can drop its tail
        (recurrent state cannot)."""
        node, depth, best = self._root, 0, None
        for token in tokens:
            child = node.get(token)
            if child is None:
                break
            node, depth = child, depth + 1
            if _KEY in node:
                best = (node[_KEY], depth)
        if best is not None and best[1] == len(tokens):
            return best
        if depth > (best[1] if best is not None else 0):
            longer = _shortest_entry(node)
            if trimmable(longer):
                return longer, depth
        return best


def _shortest(node: Node) -> tuple[int, int | None]:
    """The length of the shortest entry at or below `node` and the way to it, from its
    own entry and its children's marks."""
    options: list[tuple[int, int | None]] = [
        (child[_SHORTEST], token) for token, child in node.items() if isinstance(token, int)]
    if _KEY in node:
        options.append((len(node[_KEY]), None))
    return min(options, key=lambda option: option[0])


def _shortest_entry(node: Node) -> Key:
    """The shortest entry at or below `node` (which holds one), by following the marks."""
    while node[_VIA] is not None:
        node = node[node[_VIA]]
    key: Key = node[_KEY]
    return key
