"""A request as the scheduler tracks it, and one scheduled step (``scheduler.py``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from shiftjax.batch import StepBatch
from shiftjax.serving.engine.sampling_params import SamplingParams


@dataclasses.dataclass(eq=False)  # identity, not field-by-field comparison, in queues
class Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    output_ids: list[int] = dataclasses.field(default_factory=list)
    output_logprobs: list[float] = dataclasses.field(default_factory=list)
    # per output token, when params.top_logprobs: ((token id, logprob), ...) most likely first
    output_top_logprobs: list[tuple[tuple[int, float], ...]] = dataclasses.field(default_factory=list)
    pages: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache (committed steps)
    num_in_flight: int = 0  # tokens of scheduled steps not yet committed (drafted ones included)
    num_pending: int = 0  # steps in flight that sample for it (their tokens not yet in output_ids)
    pending_source: tuple[int, int] | None = None  # (step id, row) of the latest such token
    finish_reason: str | None = None
    modes: list[str] = dataclasses.field(default_factory=list)  # mode of every step it ran in
    preemptions: int = 0
    # prefix caching (prefix_cache.py): the hash key of its cache salt, the block hashes of
    # its full pages so far, how many of its pages are named, whether its first admission
    # looked the cache up, and the prompt tokens that lookup found cached
    cache_key: bytes = b""
    block_hashes: list[bytes] = dataclasses.field(default_factory=list, repr=False)
    num_registered: int = 0
    prefix_checked: bool = False
    num_cached_tokens: int = 0
    # structured outputs (grammar.py): its place in its grammar, advanced by every commit
    grammar: object | None = dataclasses.field(default=None, repr=False)
    _page_array: np.ndarray | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def page_array(self) -> np.ndarray:
        """``pages`` as int32, converted again only when pages were added (the scheduler
        clears it when it frees them)."""
        if self._page_array is None or len(self._page_array) != len(self.pages):
            self._page_array = np.asarray(self.pages, np.int32)
        return self._page_array

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, first: int, size: int) -> list[int]:
        """``tokens[first:first + size]`` without building the whole list."""
        prompt = len(self.prompt_ids)
        head = self.prompt_ids[first:first + size]
        return head + self.output_ids[max(first - prompt, 0):max(first + size - prompt, 0)]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_scheduled(self) -> int:
        """Tokens whose K/V are in the cache or on their way there: where the next chunk starts."""
        return self.num_computed + self.num_in_flight

    @property
    def ends_in_flight(self) -> bool:
        """A step in flight samples its last token (max_tokens): it ends at that commit."""
        return self.num_pending > 0 and len(self.output_ids) + self.num_pending >= self.params.max_tokens

    @property
    def wants_decode(self) -> bool:
        """Every token it has (pending ones included) but the last is scheduled, and it may
        still grow: its next step is one decode token. (Never while a drafted step is in
        flight: its draft makes ``num_scheduled`` larger, until the commit rolls it back.)"""
        return (self.num_scheduled == self.num_tokens + self.num_pending - 1
                and len(self.output_ids) + self.num_pending < self.params.max_tokens)

    @property
    def may_speculate(self) -> bool:
        """Whether a draft may follow its next decode token: the host knows that token (no
        step in flight samples it), the request did not opt out, and no grammar constrains
        it (its masks would have to follow the draft)."""
        return self.num_pending == 0 and not self.params.disable_speculation and self.grammar is None


@dataclasses.dataclass
class ScheduledStep:
    """What one step computes: host arrays (unpadded sizes) and who gets a sampled token.

    The batch has a row per request, except that a request with a draft has ``1 + k`` rows
    of one token each (its last token, then the draft's), at consecutive positions over
    its pages: ``first_row[b]`` is request ``b``'s first row, ``drafts[b]`` its draft (empty
    for none). Every row of a drafted request samples (``speculative.py``).

    ``token_source[i]`` is -1 where ``batch.token_ids[i]`` is known, else the row of step
    ``source_step``'s result whose sampled token goes there (that step was scheduled
    just before this one and is not yet committed)."""

    batch: StepBatch
    num_tokens: int
    requests: list[Request]
    samples: list[bool]  # per request: is a token sampled for it this step
    step_id: int = 0
    token_source: np.ndarray | None = None  # [num_tokens] int32
    source_step: int | None = None
    preemptions: list[int] = dataclasses.field(default_factory=list)  # per request, when scheduled
    delivered: list[bool] = dataclasses.field(default_factory=list)  # per request, set by commit
    # request indices that sample under a grammar, and whether one of them decodes a token
    # of ``source_step``: its mask then needs that step committed first (core.py)
    constrained: list[int] = dataclasses.field(default_factory=list)
    masks_wait: bool = False
    first_row: list[int] | None = None  # per request (None: request b is row b)
    drafts: list[list[int]] | None = None  # per request (None: no drafts)

    @property
    def takes_sampled_tokens(self) -> bool:
        return self.source_step is not None

    @property
    def num_rows(self) -> int:
        """The batch's sequence rows (what its sequence bucket must hold)."""
        return self.batch.num_seqs

    @property
    def speculative(self) -> bool:
        """Whether a request verifies a draft in it."""
        return self.drafts is not None

    def row_of(self, b: int) -> int:
        """Request ``b``'s first (with no draft: only) row."""
        return b if self.first_row is None else self.first_row[b]
