"""The frequency-counted tries of suffix decoding (``suffix_drafter.py``), depth-bounded.

A trie holds every run of up to ``max_depth`` consecutive tokens of its sources as a path
from the root, and each node counts the occurrences of its path. Both kinds keep, per
node, its most frequent child (ties: the smallest token), so that walking the likeliest
continuation costs one lookup a token. :class:`RequestTrie` holds one request's tokens and
only grows; :class:`OutputsTrie` holds finished outputs and also forgets them.

Why flat arrays and dicts of ints, not an object a node: the garbage collector walks every
object that can hold references, and with an object a node a global trie of 1.5M nodes
made a full collection take 0.5 s and learning a 1k-token output 67 ms instead of 10
(a shared 2-core CPU; benchmarks/README.md, "CPU"). Arrays and dicts of ints are never walked. The
children's dict is split by parent into shards, so that rebuilding one (as a dict does when
it grows, or after many deletions) stalls a step for milliseconds, not seconds.
"""

from __future__ import annotations

from array import array

NONE = -1
ROOT = 0
_TOKEN_RANGE = 1 << 32  # a child's key: parent * _TOKEN_RANGE + token (token ids are in [0, 2**31))


class RequestTrie:
    """One request's trie. Its counts only grow, so a node's best child is always known.
    ``suffixes[k]`` is the node of the request's last ``k + 1`` tokens; ``num_seen`` counts
    the tokens added."""

    def __init__(self, max_depth: int, num_shards: int = 64):
        self.max_depth = max_depth
        self.shard_mask = num_shards - 1  # a power of two
        self.child_of: list[dict[int, int]] = [{} for _ in range(num_shards)]
        self.count, self.token, self.best = array("i", [0]), array("i", [NONE]), array("i", [NONE])
        self.suffixes: list[int] = []
        self.num_seen = 0

    def best_child(self, node: int) -> int:
        return self.best[node]

    def add(self, tokens: list[int]) -> None:
        """Extends the request's up to ``max_depth`` current suffixes by each token in turn."""
        # One loop, no call a node: this is most of a step's time (max_depth nodes a token),
        # and a call a node costs about a third more.
        count, token_of, best_of, child_of, mask = self.count, self.token, self.best, self.child_of, self.shard_mask
        suffixes, keep = self.suffixes, self.max_depth - 1
        for token in tokens:
            extended = []
            for node in [ROOT] + suffixes[:keep]:
                key, children = node * _TOKEN_RANGE + token, child_of[node & mask]
                child = children.get(key)
                if child is None:
                    child = children[key] = len(count)
                    count.append(1)
                    token_of.append(token)
                    best_of.append(NONE)
                else:
                    count[child] += 1
                best = best_of[node]
                if (best == NONE or count[child] > count[best]
                        or (count[child] == count[best] and token < token_of[best])):
                    best_of[node] = child  # counts only grew, so the previous best still beats the others
                extended.append(child)
            suffixes = extended
        self.suffixes = suffixes
        self.num_seen += len(tokens)


class OutputsTrie:
    """The trie of finished outputs, which learns them and forgets them. When a count falls,
    the node's best child may change: it is marked unknown (``NONE`` with children) and
    found again when needed, through the node's children, which are linked (first child,
    next and previous sibling) for that. Freed nodes are reused."""

    def __init__(self, num_shards: int = 1024):
        self.shard_mask = num_shards - 1  # a power of two
        self.child_of: list[dict[int, int]] = [{} for _ in range(num_shards)]
        self.count, self.token, self.best = array("i", [0]), array("i", [NONE]), array("i", [NONE])
        self.first_child, self.next_sibling, self.prev_sibling = (array("i", [NONE]) for _ in range(3))
        self.free: list[int] = []

    @property
    def num_nodes(self) -> int:
        return len(self.count) - len(self.free) - 1

    def walk(self, tokens: list[int]) -> int:
        """The node of the path ``tokens`` (``NONE``: not a path)."""
        node = ROOT
        for token in tokens:
            node = self.child_of[node & self.shard_mask].get(node * _TOKEN_RANGE + token, NONE)
            if node == NONE:
                break
        return node

    def has_children(self, node: int) -> bool:
        return self.first_child[node] != NONE

    def best_child(self, node: int) -> int:
        best = self.best[node]
        if best == NONE:
            child = self.first_child[node]
            while child != NONE:
                if best == NONE or (-self.count[child], self.token[child]) < (-self.count[best], self.token[best]):
                    best = child
                child = self.next_sibling[child]
            self.best[node] = best
        return best

    def learn(self, tokens: list[int], max_depth: int, first: int = 0, end: int | None = None) -> None:
        """Adds the run of up to ``max_depth`` tokens that starts at each of ``tokens``
        (``first`` to ``end``: those that start there, so that a long output is learned in parts)."""
        for start in range(first, len(tokens) if end is None else min(end, len(tokens))):
            node = ROOT
            for token in tokens[start:start + max_depth]:
                node = self._extend(node, token)

    def forget(self, tokens: list[int], max_depth: int, first: int = 0, end: int | None = None) -> None:
        """Takes back what ``learn(tokens, max_depth, first, end)`` added; nodes left empty are freed."""
        count, best = self.count, self.best
        for start in range(first, len(tokens) if end is None else min(end, len(tokens))):
            node = ROOT
            for token in tokens[start:start + max_depth]:
                key, children = node * _TOKEN_RANGE + token, self.child_of[node & self.shard_mask]
                child = children[key]
                count[child] -= 1
                if best[node] == child:
                    best[node] = NONE
                if count[child] == 0:  # the nodes below it on this path held only this run too
                    del children[key]
                    self._unlink(node, child)
                node = child

    def _extend(self, node: int, token: int) -> int:
        """``node``'s child for ``token``, made if new, with one more occurrence."""
        key, children = node * _TOKEN_RANGE + token, self.child_of[node & self.shard_mask]
        child = children.get(key)
        if child is None:
            child = children[key] = self._new_child(node, token)
        count, best = self.count, self.best[node]
        count[child] += 1
        if best == NONE:
            if self.first_child[node] == child and self.next_sibling[child] == NONE:
                self.best[node] = child  # its only child; with others, the best is not known
        elif count[child] > count[best] or (count[child] == count[best] and token < self.token[best]):
            self.best[node] = child  # counts only grew, so the previous best still beats the others
        return child

    def _new_child(self, parent: int, token: int) -> int:
        head = self.first_child[parent]
        if self.free:
            child = self.free.pop()
            self.count[child], self.token[child], self.best[child] = 0, token, NONE
            self.first_child[child], self.next_sibling[child], self.prev_sibling[child] = NONE, head, NONE
        else:
            child = len(self.count)  # appended one by one: a loop over the arrays took twice as long
            self.count.append(0)
            self.token.append(token)
            self.best.append(NONE)
            self.first_child.append(NONE)
            self.next_sibling.append(head)
            self.prev_sibling.append(NONE)
        if head != NONE:
            self.prev_sibling[head] = child
        self.first_child[parent] = child
        return child

    def _unlink(self, parent: int, child: int) -> None:
        before, after = self.prev_sibling[child], self.next_sibling[child]
        if before == NONE:
            self.first_child[parent] = after
        else:
            self.next_sibling[before] = after
        if after != NONE:
            self.prev_sibling[after] = before
        self.free.append(child)
