"""Speculative decoding without a draft model: its configuration, the drafters' interface,
chain verification and its counters.

A drafter (``ngram_drafter.py``: prompt lookup; ``suffix_drafter.py``: suffix decoding)
proposes up to ``num_speculative_tokens`` tokens that may follow a request's tokens, from
those tokens alone (and, for suffix decoding, earlier requests' outputs). The scheduler
gives a decoding request with a draft of ``k`` tokens ``1 + k`` rows of one token each: its
last token and the draft, at consecutive positions over the same pages (``scheduler.py``).
The step writes their K/V and samples a token at every row, each with the key a decode at
that position would use (``shiftjax/sampling.py``), and :func:`accepted_length` keeps the
draft up to its first token that differs from the sample; that sample follows.

Why this is exact. Greedy: the samples are the argmaxes, so the output is the greedy
output. Sampled: a draft is deterministic (``q`` puts all its mass on the drafted token
``d``), so rejection sampling accepts ``d`` with probability ``min(1, p(d) / q(d)) = p(d)``
and on rejection draws from ``max(0, p - q)`` renormalised, ``p`` with ``d`` removed. A draw
``x ~ p`` that accepts iff ``x == d`` does both at once: it accepts with probability
``p(d)``, and given that it did not, ``x`` follows ``p`` restricted to ``x != d``. Each row's
draw has its own key, so every kept token has the target's distribution given the tokens
before it, and with a seed the output is the one decoding without speculation gives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

SPECULATIVE_METHODS = ("ngram", "suffix")
MAX_SPECULATIVE_TOKENS = 16


@runtime_checkable
class DraftSource(Protocol):
    """What a drafter reads of a request (``scheduler.Request`` is one)."""

    request_id: int
    prompt_ids: list[int]
    output_ids: list[int]


@runtime_checkable
class Drafter(Protocol):
    def propose(self, request: DraftSource, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens that may follow ``request``'s tokens (maybe none)."""

    def finish(self, request: DraftSource) -> None:
        """``request`` ended: drop its state (suffix decoding also queues its output to learn)."""

    def learn_pending(self, done: Callable[[], bool]) -> None:
        """Work that can wait (suffix decoding: learning finished outputs), done a part at a
        time until ``done()``; the engine calls it while the devices run a step."""


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: ``ngram`` (prompt lookup: the longest n-gram, ``prompt_lookup_max`` down to
    ``prompt_lookup_min`` tokens, that ends the request's tokens and occurred before in them;
    the tokens that followed it) or ``suffix`` (suffix trees over the request's tokens and
    over the outputs of the last ``suffix_max_cached_requests`` requests, to a depth of
    ``suffix_max_depth``; the most frequent continuation of the longest match, cut where
    its estimated probability falls below ``suffix_min_token_prob``, at most
    ``suffix_max_spec_factor`` times the match's length). ``num_speculative_tokens``: the
    most a draft may have. ``disable_by_batch_size``: no request speculates in a step
    scheduled while more than this many requests run (verification then costs more than
    it saves; benchmarks/README.md, "Speculative decoding"); None: no limit."""

    method: str
    num_speculative_tokens: int = 3
    disable_by_batch_size: int | None = 8
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_max_depth: int = 24
    suffix_max_cached_requests: int = 256  # ~2.4 MB of host memory per cached 1k-token output
    suffix_min_token_prob: float = 0.1
    suffix_max_spec_factor: float = 1.0

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be positive or None, got {self.disable_by_batch_size}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.suffix_max_depth < 1 or self.suffix_max_cached_requests < 0:
            raise ValueError("suffix_max_depth must be positive and suffix_max_cached_requests not negative")
        if not 0.0 <= self.suffix_min_token_prob <= 1.0:
            raise ValueError(f"suffix_min_token_prob must be in [0, 1], got {self.suffix_min_token_prob}")
        if self.suffix_max_spec_factor <= 0.0:
            raise ValueError(f"suffix_max_spec_factor must be positive, got {self.suffix_max_spec_factor}")

    def make_drafter(self) -> Drafter:
        if self.method == "ngram":
            from shiftjax.serving.engine.ngram_drafter import NgramDrafter

            return NgramDrafter(self.prompt_lookup_min, self.prompt_lookup_max)
        from shiftjax.serving.engine.suffix_drafter import SuffixDrafter

        return SuffixDrafter(max_depth=self.suffix_max_depth, max_cached_requests=self.suffix_max_cached_requests,
                             min_token_prob=self.suffix_min_token_prob, max_spec_factor=self.suffix_max_spec_factor)


def accepted_length(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """How many of ``draft`` to keep: those before its first token that differs from the
    token sampled at the row before it (``sampled[i]`` is sampled where ``draft[i]`` was fed
    in; ``len(sampled) == len(draft) + 1``). The kept tokens and ``sampled[kept]`` follow."""
    kept = 0
    while kept < len(draft) and draft[kept] == sampled[kept]:
        kept += 1
    return kept


@dataclasses.dataclass(frozen=True)
class SpecDecodeCounters:
    """Speculation so far, as vLLM's ``spec_decode_*`` counters: drafts verified, their
    tokens, the tokens accepted, and per draft position how often it was accepted; the host
    seconds proposing took. Summed over replicas with ``+``."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()
    draft_seconds: float = 0.0

    def __add__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        per_position = tuple(_at(self.accepted_per_position, i) + _at(other.accepted_per_position, i)
                             for i in range(width))
        return SpecDecodeCounters(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                                  self.num_accepted_tokens + other.num_accepted_tokens, per_position,
                                  self.draft_seconds + other.draft_seconds)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over drafted ones."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verified draft's step gave its request: the accepted ones and the one sampled
        after them (vLLM's mean acceptance length); 0 before any draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class DraftBackoff:
    """When the engine gives up asynchronous scheduling to draft. A turn that may draft
    schedules after the commit, which puts the host's scheduling on the step's critical path;
    where the drafter finds nothing (text that does not repeat), that costs every step and
    gains none. After each turn that tried and drafted nothing, the next ``2**misses`` turns
    (at most ``MAX_SKIP``) schedule ahead again, without drafts; a turn that drafts resets it."""

    MAX_SKIP = 16

    def __init__(self):
        self.misses = 0
        self.skip = 0

    def try_drafting(self) -> bool:
        """Whether this turn should schedule after the commit, so as to draft."""
        if self.skip:
            self.skip -= 1
            return False
        return True

    def record(self, drafted: bool) -> None:
        """What a turn that tried found."""
        if drafted:
            self.misses = self.skip = 0
        else:
            self.skip = min(2 ** self.misses, self.MAX_SKIP)
            self.misses += 1


def _at(values: tuple[int, ...], i: int) -> int:
    return values[i] if i < len(values) else 0


@dataclasses.dataclass
class SpecDecodeTally:
    """The engine's running counts behind :class:`SpecDecodeCounters` (mutated by it alone)."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    draft_seconds: float = 0.0

    def __post_init__(self):
        self.accepted_per_position = self.accepted_per_position or [0] * self.num_speculative_tokens

    def count(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    def frozen(self) -> SpecDecodeCounters:
        return SpecDecodeCounters(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                  tuple(self.accepted_per_position), self.draft_seconds)
