"""Prompt lookup: drafts copied from where the request's last tokens occurred before.

As vLLM's ``ngram`` speculative method (Saxena, "Prompt Lookup Decoding", 2023): take the
longest ``n``, ``max_n`` down to ``min_n``, such that the last ``n`` tokens of prompt and
output occurred earlier in them, and propose the tokens that followed their most recent
earlier occurrence. Summaries, edits and code that quote their input accept long drafts.

The index is incremental. Per request and per ``n``, a dict maps each n-gram to where the
tokens after its latest occurrence start; an n-gram enters it only once the token after it
exists, so the suffix being looked up never finds itself. A step costs one dict update per
``n`` for each token that arrived and one lookup per ``n``, whatever the context's length:
about 3 us at 1k or 8k tokens, 8 ms for the first call at 8k tokens (it indexes the
prompt), 2.3 MB of state at 8k tokens (a shared 2-core CPU; benchmarks/README.md, "CPU").
The continuation of a recent match may run into the suffix itself (``1 2 1 2 1`` drafts ``2 1``): those tokens are taken as they stand.
"""

from __future__ import annotations

import dataclasses

from shiftjax.serving.engine.speculative import DraftSource


def tokens_after(request: DraftSource, seen: int) -> list[int]:
    """The request's tokens (prompt, then output) from position ``seen`` on, without
    concatenating its whole history (that would cost the context's length every step)."""
    prompt = request.prompt_ids
    if seen < len(prompt):
        return prompt[seen:] + request.output_ids
    return request.output_ids[seen - len(prompt):]


def num_tokens(request: DraftSource) -> int:
    return len(request.prompt_ids) + len(request.output_ids)


@dataclasses.dataclass
class _Lookup:
    """One request's tokens so far and, for each ``n`` from ``min_n``, the n-gram index:
    n-gram -> position of the token that followed its latest occurrence."""

    tokens: list[int]
    continuation_of: list[dict[tuple[int, ...], int]]


class NgramDrafter:
    """Prompt lookup over each request's own tokens, with n-grams of ``min_n`` to ``max_n``."""

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NgramDrafter needs 1 <= min_n <= max_n, got min_n={min_n} and max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._lookups: dict[int, _Lookup] = {}

    def propose(self, request: DraftSource, max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        lookup = self._synced(request)
        tokens = lookup.tokens
        end = len(tokens)
        # An earlier occurrence of an n-gram needs at least n + 1 tokens.
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            start = lookup.continuation_of[n - self.min_n].get(tuple(tokens[end - n:]))
            if start is not None:
                return tokens[start:start + max_tokens]
        return []

    def finish(self, request: DraftSource) -> None:
        self._lookups.pop(request.request_id, None)

    def learn_pending(self, done=None) -> None:
        """Nothing: prompt lookup learns nothing across requests."""

    @property
    def num_requests(self) -> int:
        """Requests whose state is held (proposed for and not finished)."""
        return len(self._lookups)

    def _synced(self, request: DraftSource) -> _Lookup:
        """The request's lookup, after indexing the tokens added since the last call."""
        lookup = self._lookups.get(request.request_id)
        # Tokens never shrink for one request; if they did (a caller's bug), start over
        # rather than draft from a history that is no longer the request's.
        if lookup is None or len(lookup.tokens) > num_tokens(request):
            lookup = _Lookup([], [{} for _ in range(self.min_n, self.max_n + 1)])
            self._lookups[request.request_id] = lookup
        tokens = lookup.tokens
        sizes = list(zip(range(self.min_n, self.max_n + 1), lookup.continuation_of))
        for token in tokens_after(request, len(tokens)):
            end = len(tokens)  # where ``token`` goes: the continuation of every n-gram ending here
            for n, continuation_of in sizes:
                if n > end:
                    break
                continuation_of[tuple(tokens[end - n:end])] = end
            tokens.append(token)
        return lookup
