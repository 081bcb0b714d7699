"""The index both KV tiers look a prompt up in: cached token sequences in a radix tree, and
the entry that serves the longest prefix of a prompt.

mlx-lm's `PromptTrie` is the model (a dict per token), but its search finds the shortest
entry that runs on past a prompt by visiting every entry below the point where the prompt
leaves the trie, copying the path so far at each node. A thousand cached conversations of
1,500 tokens after one shared system prompt made one lookup take 0.87 s on this box, two
thousand of 2,500 took 5.8 s (`load/micro/prefix_lookup.py`), on the engine thread, with
every stream waiting. Here each node keeps the length of the shortest entry at or below it
and the child that leads there, so that entry is one walk down: a lookup costs the prompt
plus that entry, however many entries there are.

A node per token also cost the engine thread on every request that ended: its entry's
answer is text no other entry holds, a chain of ~100 new nodes, and Python's garbage
collector then walked the whole trie again and again, three quarters of an add's time
(97 us of a 160-token add among 2,000 entries, 22 us with the collector off). So runs
without a branch are one node, as SGLang's radix cache keeps them: an entry adds at most
two nodes, however long.
"""

from __future__ import annotations

from typing import Callable, Sequence

Key = tuple[int, ...]


class _Node:
    """The tokens from its parent (`edge`), the entry ending here, and the length of the
    shortest entry at or below it with the child that leads there (`via`, by the first
    token of that child's edge; None: it ends here)."""

    __slots__ = ("edge", "children", "entry", "shortest", "via")

    def __init__(self, edge: Key, entry: Key | None = None, shortest: int = 0,
                 via: int | None = None) -> None:
        self.edge = edge
        self.children: dict[int, _Node] = {}
        self.entry = entry
        self.shortest = shortest
        self.via = via

    def remark(self) -> bool:
        """Recompute the marks from the entry and the children's; whether they changed."""
        best: tuple[int, int | None] | None = \
            (len(self.entry), None) if self.entry is not None else None
        for token, child in self.children.items():
            if best is None or child.shortest < best[0]:
                best = (child.shortest, token)
        assert best is not None, "a node with neither entry nor children is removed"
        if best == (self.shortest, self.via):
            return False
        self.shortest, self.via = best
        return True


def _common(edge: Key, tokens: Sequence[int], at: int) -> int:
    """How many of `edge`'s tokens `tokens` repeat from `at`."""
    end = at + len(edge)
    if end <= len(tokens) and tuple(tokens[at:end]) == edge:
        return len(edge)  # the usual case, a whole edge, compared in C: prompts run long
    n = 0
    for token in edge:
        if at + n >= len(tokens) or tokens[at + n] != token:
            break
        n += 1
    return n


class PrefixTrie:
    """Token sequences (entries). Not thread-safe: each tier calls it under its own rule."""

    def __init__(self) -> None:
        self._root = _Node(())

    def add(self, key: Key) -> bool:
        """Hold `key`; whether it was held already."""
        length, node, depth = len(key), self._root, 0
        while depth < length:
            child = node.children.get(key[depth])
            if child is None:  # the rest is new: one node
                node.children[key[depth]] = _Node(key[depth:], key, length)
                return False
            common = _common(child.edge, key, depth)
            if common < len(child.edge):  # `key` leaves (or ends) inside the edge: split it
                mid = _Node(child.edge[:common], None, child.shortest, child.edge[common])
                child.edge = child.edge[common:]
                mid.children[child.edge[0]] = child
                node.children[key[depth]] = child = mid
            depth += len(child.edge)
            if child.shortest > length:  # ties keep the entry they had
                child.shortest, child.via = length, key[depth] if depth < length else None
            node = child
        held = node.entry is not None
        node.entry = key
        return held

    def remove(self, key: Key) -> None:
        """Forget `key`, which must be held."""
        path, depth = [self._root], 0
        while depth < len(key):
            child = path[-1].children[key[depth]]
            depth += len(child.edge)
            path.append(child)
        node = path[-1]
        assert depth == len(key) and node.entry == key, "not held"
        node.entry = None
        # Up from it: a node left with neither entry nor children goes, one left with one
        # child and no entry joins that child, and marks are redone until one holds.
        for level in range(len(path) - 1, 0, -1):
            node, parent = path[level], path[level - 1]
            if node.entry is None and not node.children:
                del parent.children[node.edge[0]]
            elif node.entry is None and len(node.children) == 1:
                [child] = node.children.values()
                child.edge = node.edge + child.edge
                parent.children[node.edge[0]] = child
            elif not node.remark():
                break  # nothing above it changes either

    def remove_prefixes(self, key: Key) -> list[Key]:
        """Forget the entries that are proper prefixes of `key`; they are returned."""
        node, depth, found = self._root, 0, []
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None or _common(child.edge, key, depth) < len(child.edge):
                break
            depth += len(child.edge)
            node = child
            if node.entry is not None and depth < len(key):
                found.append(node.entry)
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
        through = node  # the node whose entries all run through where `tokens` leave
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            common = _common(child.edge, tokens, depth)
            depth += common
            through = child
            if common < len(child.edge):
                break  # they leave (or end) inside its edge
            node = child
            if node.entry is not None:
                best = (node.entry, depth)
        if best is not None and best[1] == len(tokens):
            return best
        if depth > (best[1] if best is not None else 0):
            longer = _shortest_entry(through)
            if trimmable(longer):
                return longer, depth
        return best


def _shortest_entry(node: _Node) -> Key:
    """The shortest entry at or below `node` (which holds one), by following the marks."""
    while node.via is not None:
        node = node.children[node.via]
    assert node.entry is not None
    return node.entry
