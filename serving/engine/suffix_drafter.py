"""Suffix decoding: drafts from frequency-counted suffix tries of this request and of earlier outputs.

SuffixDecoding (Oliaro et al., arXiv 2411.04975; as in Snowflake's Arctic Inference) keeps
two tries of bounded depth ``max_depth``: one per request over its prompt and output, and
one global trie over the outputs of the last ``max_cached_requests`` finished requests. A
trie holds every run of up to ``max_depth`` consecutive tokens of its sources as a path,
and a node counts the occurrences of its path. To draft, take the longest suffix of the
request's tokens that is a path with a continuation (match length ``m``), then walk
greedily to the most frequent child (ties: the smallest token), estimating each step's
probability as the child's count over the node's; stop when the product of those falls
below ``min_token_prob``, or at ``ceil(max_spec_factor * m)`` or ``max_tokens`` tokens.
A chain's score is the sum of its tokens' cumulative probabilities (the expected number
accepted); the per-request trie's chain wins ties with the global trie's. The tries
themselves are in ``suffix_trie.py``.

Two refinements of that recipe. In the per-request trie the path of the request's own
suffix ends at its last token with no continuation yet: that occurrence is left out of
its node's count when estimating a step (so ``1 2 3 4 1 2 3`` drafts ``4 1 2`` with
probability 1, not 1/2). And a match is at most as long as leaves the chain room within
``max_depth`` (``m + min(max_tokens, ceil(max_spec_factor * m)) <= max_depth``): on text
that repeats, the longest match would otherwise sit at depth ``max_depth - 1`` and draft a
single token.

Costs (measured on a shared 2-core CPU; benchmarks/README.md, "CPU"). A token that
arrives extends the up to ``max_depth`` suffixes that end at it; every node keeps its most frequent child, so a chain step is one lookup: at depth 24 a step's
``propose`` takes about 25 us (median) at 1k or 8k tokens. Building a request's trie from
its prompt costs ``len * max_depth`` node updates on its first call (about 100 ms at 8k
tokens), and learning an output into the global trie as much, and forgetting the one it
evicts (about 45 ms for 1k tokens): ``finish`` only queues an output, and
:meth:`SuffixDrafter.learn_pending` learns it a part at a time while the devices run steps. A trie has up to ``max_depth`` nodes a token, about 90 bytes each:
17 MB for a request of 8k tokens, and 2.4 MB per 1k-token output the global trie holds
(2.4 GB at 1000 of them).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable

from shiftjax.serving.engine.ngram_drafter import num_tokens, tokens_after
from shiftjax.serving.engine.speculative import DraftSource
from shiftjax.serving.engine.suffix_trie import NONE, OutputsTrie, RequestTrie

LEARN_CHUNK = 16  # token positions of an output learned at a time: about 0.7 ms at depth 24


class SuffixDrafter:
    """Suffix decoding over each request's tokens and the last ``max_cached_requests`` outputs."""

    def __init__(self, *, max_depth: int, max_cached_requests: int, min_token_prob: float, max_spec_factor: float):
        if max_depth < 1 or max_cached_requests < 0:
            raise ValueError(f"SuffixDrafter needs max_depth >= 1 and max_cached_requests >= 0, "
                             f"got {max_depth} and {max_cached_requests}")
        if not 0.0 <= min_token_prob <= 1.0 or max_spec_factor <= 0.0:
            raise ValueError(f"SuffixDrafter needs min_token_prob in [0, 1] and max_spec_factor > 0, "
                             f"got {min_token_prob} and {max_spec_factor}")
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.min_token_prob = min_token_prob
        self.max_spec_factor = max_spec_factor
        self._requests: dict[int, RequestTrie] = {}
        self._global = OutputsTrie()
        self._cached_outputs: collections.deque[list[int]] = collections.deque()
        # ("learn" | "forget", output, first position not yet done), oldest first
        self._work: collections.deque[tuple[str, list[int], int]] = collections.deque()
        self._match_caps: dict[int, int] = {}

    def propose(self, request: DraftSource, max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        own = self._synced(request)
        longest = self._match_cap(max_tokens)
        suffixes = own.suffixes
        m = min(longest, len(suffixes))
        while m > 0 and own.count[suffixes[m - 1]] < 2:  # 1: only the suffix itself, nothing after it
            m -= 1
        draft, score = self._chain(own, suffixes[m - 1], m, max_tokens, suffixes) if m else ([], 0.0)
        if self._cached_outputs:
            node, m = self._global_match(request, longest)
            if m:
                global_draft, global_score = self._chain(self._global, node, m, max_tokens, ())
                if global_score > score:
                    draft = global_draft
        return draft

    def finish(self, request: DraftSource) -> None:
        """Drops the request's trie and queues its output for the global trie
        (:meth:`learn_pending` learns it)."""
        self._requests.pop(request.request_id, None)
        output = list(request.output_ids)
        if self.max_cached_requests == 0 or not output:
            return
        self._work.append(("learn", output, 0))
        while sum(kind == "learn" for kind, _, _ in self._work) > self.max_cached_requests:
            self._work.remove(next(item for item in self._work if item[0] == "learn"))  # the oldest waiting

    def learn_pending(self, done: Callable[[], bool] = lambda: False) -> None:
        """Learns queued outputs into the global trie (and forgets the oldest beyond
        ``max_cached_requests``), ``LEARN_CHUNK`` token positions at a time, until ``done()``
        says to stop (after at least one part) or nothing is left. The engine calls it while
        the devices run a step: learning a 1k-token output takes about 45 ms of host time,
        which on the engine's thread between steps would stall every request."""
        worked = False
        while self._work and not (worked and done()):
            kind, output, first = self._work.popleft()
            end = first + LEARN_CHUNK
            (self._global.learn if kind == "learn" else self._global.forget)(output, self.max_depth, first, end)
            worked = True
            if end < len(output):
                self._work.appendleft((kind, output, end))
            elif kind == "learn":
                self._cached_outputs.append(output)
                if len(self._cached_outputs) > self.max_cached_requests:
                    self._work.appendleft(("forget", self._cached_outputs.popleft(), 0))

    @property
    def num_pending(self) -> int:
        """Outputs waiting to be learned or forgotten."""
        return len(self._work)

    @property
    def num_requests(self) -> int:
        """Requests whose trie is held (proposed for and not finished)."""
        return len(self._requests)

    @property
    def num_cached_outputs(self) -> int:
        return len(self._cached_outputs)

    @property
    def num_global_nodes(self) -> int:
        return self._global.num_nodes

    def _synced(self, request: DraftSource) -> RequestTrie:
        """The request's trie, after adding the tokens that arrived since the last call."""
        own = self._requests.get(request.request_id)
        if own is None or own.num_seen > num_tokens(request):  # shrank: a caller's bug, start over
            own = self._requests[request.request_id] = RequestTrie(self.max_depth)
        own.add(tokens_after(request, own.num_seen))
        return own

    def _draft_limit(self, match_length: int, max_tokens: int) -> int:
        # The epsilon keeps a rounding error (0.1 * 3 * 10 = 3.0000000000000004) from adding a token.
        return min(max_tokens, math.ceil(self.max_spec_factor * match_length - 1e-9))

    def _match_cap(self, max_tokens: int) -> int:
        """The longest match whose draft the trie's depth does not cut short (0: none)."""
        if max_tokens not in self._match_caps:
            self._match_caps[max_tokens] = next(
                (m for m in range(self.max_depth - 1, 0, -1) if m + self._draft_limit(m, max_tokens) <= self.max_depth),
                0)
        return self._match_caps[max_tokens]

    def _global_match(self, request: DraftSource, longest: int) -> tuple[int, int]:
        """The global trie's node for the longest suffix, of at most ``longest`` tokens, that
        is a path with children, and its length (0: none)."""
        output = request.output_ids
        if len(output) >= longest:
            tail = output[len(output) - longest:]
        else:
            prompt = request.prompt_ids
            tail = prompt[max(0, len(prompt) - longest + len(output)):] + output
        # A suffix's suffixes occur wherever it does: the lengths that are paths are 0 to some
        # m, found by bisection. Where that path ends an output, a shorter one may go on.
        low, high = 0, len(tail)
        while low < high:
            middle = (low + high + 1) // 2
            if self._global.walk(tail[len(tail) - middle:]) == NONE:
                high = middle - 1
            else:
                low = middle
        for m in range(low, 0, -1):
            node = self._global.walk(tail[len(tail) - m:])
            if self._global.has_children(node):
                return node, m
        return NONE, 0

    def _chain(self, trie: OutputsTrie | RequestTrie, node: int, match_length: int, max_tokens: int,
               suffixes: list[int] | tuple[()]) -> tuple[list[int], float]:
        """The greedy chain from ``node`` (the path of the last ``match_length`` tokens) and its
        score. ``suffixes``: the request's current suffix nodes when ``trie`` is its own."""
        limit = self._draft_limit(match_length, max_tokens)
        draft, score, prob, depth = [], 0.0, 1.0, match_length
        while len(draft) < limit:
            child = trie.best_child(node)
            if child == NONE:
                break
            occurrences = trie.count[node]
            if depth <= len(suffixes) and suffixes[depth - 1] == node:
                occurrences -= 1  # the one that ends the request's tokens has no next token yet
            prob *= trie.count[child] / occurrences
            if prob < self.min_token_prob:
                break
            draft.append(trie.token[child])
            score += prob
            node, depth = child, depth + 1
        return draft, score
